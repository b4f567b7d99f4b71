"""One training step of a trainer's OWN model code on merge's output, where that trainer runs
on a CPU: nvidia-modelopt 0.47.0's EAGLE-3 (in the ModelOpt overlay venv that
bin/setup_env.sh makes; tests/trainer_steps/modelopt_step.py). SpecForge 0.2.0 and
speculators 0.9.0 train on a GPU only (docs/training.md "Layer ids for the engine that serves the drafter"); their own data
loaders read the same output in test_merge.py and test_speculators_e2e.py."""

import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from hs_capture.cli import main
from tests.sglang_cpu.harness import REPO

MODELOPT_PY = os.path.join(REPO, ".venvs", "modelopt", "bin", "python")
STEP = os.path.join(REPO, "tests", "trainer_steps", "modelopt_step.py")


def test_modelopt_trains_on_merged_output_with_the_settings_merge_wrote(served_dump, tiny_model, tmp_path):
    if not os.path.exists(MODELOPT_PY):
        pytest.skip("no ModelOpt overlay venv: bash bin/setup_env.sh makes .venvs/modelopt")
    out = str(tmp_path / "mo")
    res = CliRunner().invoke(main, ["merge", served_dump["dir"], "-o", out, "--format", "modelopt",
                                    "--dataset", served_dump["data"], "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": ""}
    p = subprocess.run([MODELOPT_PY, STEP, out, tiny_model], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["samples"] == len(served_dump["rows"]) and got["batch"] == 6
    # every trainable tensor of the draft moved, and on one batch the loss goes down
    assert got["changed_by_first_step"] == got["trainable"] > 0
    losses = got["losses"]
    assert all(x == x and x < float("inf") for x in losses) and losses[-1] < losses[0]
