"""Every model family on every sglang release this checkout has a venv for: served for
real on the CPU with the hook, every layer, the final and the pre-norm state equal to
transformers' float32 forward within 1e-4.

The suite's own release (0.5.23, from bin/setup_env.sh) always runs. Older releases run
where `bash bin/setup_sglang_venv.sh X` made .venvs/sglang-X, and skip (saying how to
make it) where not; `python -m tests.sglang_cpu.matrix` runs the same pairs and prints the
README's table.
"""

import os

import pytest

from tests.sglang_cpu.fidelity import run_fidelity
from tests.sglang_cpu.matrix import LAYERS, TOL, release_pythons
from tests.sglang_cpu.models import FAMILIES, SERVER_FLAGS, make_tiny

RELEASES = ("0.5.10", "0.5.15", "0.5.23")
_PYTHONS = release_pythons()
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "kimi_k25": "KimiK25ForConditionalGeneration"}


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family-models"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("release", RELEASES)
def test_capture_matches_transformers(release, family, models_root, tmp_path):
    python = _PYTHONS.get(release)
    if python is None:
        pytest.skip(f"no venv for sglang {release}: bash bin/setup_sglang_venv.sh {release}")
    model = make_tiny(family, os.path.join(models_root, family), layers=LAYERS)
    r = run_fidelity(model, str(tmp_path), LAYERS, python=python, extra_flags=SERVER_FLAGS.get(family, ()),
                     warmup=False)
    assert r.sglang == release
    assert not r.problems, r.problems
    assert r.samples == 8
    # every layer the convention allows, the final and the pre-norm state
    assert sorted(r.max_diff) == [f"L{i:02d}" for i in range(1, LAYERS)] + ["final", "prenorm"]
    assert r.worst <= TOL, r.max_diff
    assert r.architecture == ARCHITECTURES[family]
    inner = "DeepseekV3ForCausalLM" if family == "kimi_k25" else r.architecture  # Kimi's language_model
    assert f"[HS_DUMP] {inner}: layers_to_capture=[1, 2, 3, 4, 5]" in r.log
    assert "ERROR" not in "\n".join(line for line in r.log.splitlines() if line.startswith("[HS_DUMP]"))


@pytest.mark.parametrize("release", RELEASES)
def test_doctor_finds_every_family_and_the_release_prefill_graph_trap(release, tmp_path):
    """doctor in that release's own Python: every family patchable, and --disable-cuda-graph
    alone is judged by what the release does (0.5.10 keeps piecewise prefill graphs on)."""
    import json
    import subprocess

    from tests.sglang_cpu.harness import REPO, SHIMS, graph_flags

    python = _PYTHONS.get(release)
    if python is None:
        pytest.skip(f"no venv for sglang {release}: bash bin/setup_sglang_venv.sh {release}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSCAP_")}
    env.update(HSCAP_DIR=str(tmp_path / "dump"), TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([os.path.join("hs_capture", "sitecustomize"), SHIMS]))
    model = make_tiny("qwen3_moe", str(tmp_path / "m"), layers=LAYERS)

    def doctor(*flags):
        out = subprocess.run([python, "-m", "hs_capture.cli", "doctor", "--json", "--", "--model-path", model,
                              "--disable-radix-cache", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        return out.returncode, {f["topic"]: f for f in json.loads(out.stdout.strip().splitlines()[-1])["findings"]}

    flags = graph_flags(python)
    code, f = doctor(*flags)
    assert code == 0 and f["sglang"]["detail"].startswith(f"sglang {release}")
    assert all(f[t]["status"] == "ok" for t in f if t.startswith("target ")), f
    assert f["model"]["status"] == "ok" and f["prefill CUDA graphs"]["status"] == "ok"
    if "--disable-piecewise-cuda-graph" in flags:
        code, f = doctor("--disable-cuda-graph")
        assert code == 1 and f["prefill CUDA graphs"]["status"] == "block"
        assert "--disable-piecewise-cuda-graph" in f["prefill CUDA graphs"]["action"]
