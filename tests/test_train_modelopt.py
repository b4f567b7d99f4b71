"""ModelOpt 0.47.0 trains straight from a dump (hs_capture.offline.train.trainers.modelopt): its own
EAGLE-3 model, dataset, collator and HF Trainer, on the CPU, with no merged file anywhere.
Everything ModelOpt runs in its overlay venv (.venvs/modelopt); its training entry, main.py, is
in a Model-Optimizer checkout (MODELOPT_EXAMPLES=.../examples/speculative_decoding): the test
that runs it is skipped without one."""

import glob
import json
import math
import os
import re
import subprocess

import pytest

from tests.sglang_cpu.harness import REPO

MODELOPT_PY = os.path.join(REPO, ".venvs", "modelopt", "bin", "python")
STEP = os.path.join(REPO, "tests", "trainer_steps", "modelopt_step.py")
ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": REPO}

pytestmark = pytest.mark.skipif(not os.path.exists(MODELOPT_PY),
                                reason="no ModelOpt overlay venv: bash bin/setup_env.sh makes .venvs/modelopt")


def run_step(*args: str) -> dict:
    p = subprocess.run([MODELOPT_PY, STEP, *args], capture_output=True, text=True, env=ENV, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_modelopt_trains_three_steps_from_the_dump_with_no_merged_file(served_dump, tiny_model):
    assert not glob.glob(os.path.join(served_dump["root"], "**", "*.pt"), recursive=True)
    got = run_step(served_dump["dir"], tiny_model, "--from-dump", "--dataset", served_dump["data"], "--aux-ids", "1,2,4",
                   "--steps", "3", "--batch", "2", "--workers", "1")
    # ModelOpt's own dataset over the dump's samples, read in the dump's own order
    assert got["samples"] == len(served_dump["rows"])
    assert got["dataset"] == "modelopt.torch.speculative.eagle.utils.OfflineSupervisedDataset"
    assert got["dumped_files"] == "_Samples"
    assert got["sampler"] == "hs_capture.offline.train.step_sampler.StepWindowSampler"
    assert got["steps"] == 3 and len(got["losses"]) == 3
    assert all(math.isfinite(x) for x in got["losses"])
    assert got["changed"] == got["trainable"] > 0


def test_the_dump_items_through_modelopts_collator_equal_merged_ones(served_dump, tmp_path):
    from click.testing import CliRunner

    from hs_capture.cli import main

    out = str(tmp_path / "mo")
    res = CliRunner().invoke(main, ["merge", served_dump["dir"], "-o", out, "--format", "modelopt",
                                    "--dataset", served_dump["data"]], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    got = run_step(served_dump["dir"], "-", "--from-dump", "--dataset", served_dump["data"], "--steps", "0",
                   "--same-as", out)
    assert got["same_as_merged"] == {"samples": len(served_dump["rows"]), "merged_files": len(served_dump["rows"]),
                                     "items_equal": True, "batches_equal": True}


def test_check_names_an_unsupported_release_and_uninstrument_undoes_every_patch():
    code = """if True:
        import json, torch, modelopt, transformers.trainer as t
        import modelopt.torch.speculative.eagle.utils as items
        from hs_capture.offline.train.trainers import modelopt as patch
        load, sampler = torch.load, t.Trainer._get_train_sampler
        supported = patch.check()
        inst = patch.ModelOptPatch()
        inst.instrument(None)
        # the dataset's module alone loads through the patch: torch.load itself is left alone
        patched = (items.torch is not torch and items.torch.load is not load and torch.load is load
                   and t.Trainer._get_train_sampler is not sampler)
        inst.uninstrument()
        restored = items.torch is torch and torch.load is load and t.Trainer._get_train_sampler is sampler
        modelopt.__version__ = "0.46.0"
        print(json.dumps({"supported": supported, "unsupported": patch.check(), "patched": patched,
                          "restored": restored}))"""
    p = subprocess.run([MODELOPT_PY, "-c", code], capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["supported"] is None and got["patched"] and got["restored"]
    assert "nvidia-modelopt 0.46.0 is not supported" in got["unsupported"] and "\n" not in got["unsupported"]


def test_hscap_train_runs_modelopts_main_on_the_dump(served_dump, tiny_target, tmp_path):
    examples = os.environ.get("MODELOPT_EXAMPLES")
    if not examples or not os.path.exists(os.path.join(examples, "main.py")):
        pytest.skip("ModelOpt's training entry is in a Model-Optimizer checkout: set MODELOPT_EXAMPLES to its "
                    "examples/speculative_decoding")
    model = tiny_target
    ckpt = str(tmp_path / "ckpt")
    # README's CPU overrides; "no" quoted, or OmegaConf reads it as False
    cmd = [MODELOPT_PY, "-m", "hs_capture.cli", "train", "modelopt", "--dataset", served_dump["data"], "--",
           "main.py", "--config", "../../modelopt_recipes/general/speculative_decoding/eagle3.yaml",
           f"model.model_name_or_path={model}", f"data.offline_data_path={served_dump['dir']}",
           f"training.output_dir={ckpt}", "eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids=[1,2,4]",
           "training.answer_only_loss=true", "training.bf16=false", "training.tf32=false", "training.use_cpu=true",
           "training.training_seq_len=128", "training.max_steps=3", 'training.save_strategy="no"',
           "training.logging_steps=1", "training.report_to=none", "training.disable_tqdm=true",
           "training.dataloader_num_workers=1"]
    p = subprocess.run(cmd, cwd=examples, capture_output=True, text=True, env=ENV, timeout=900)
    out = p.stdout + p.stderr
    losses = [float(x) for x in re.findall(r"\{'loss': '([^']+)'", out)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out[-4000:]
    assert "'train_runtime'" in out, out[-4000:]
    # the trained drafter is written; main.py's final save then pickles its HfTrainingArguments,
    # a dataclasses.make_dataclass class Python 3.11 cannot pickle (3.12 can): docs/cpu.md "By hand on this CPU"
    assert os.path.exists(os.path.join(ckpt, "model.safetensors")), out[-4000:]
    assert p.returncode == 0 or "Can't pickle <class 'types.HfTrainingArguments'>" in out, out[-4000:]


@pytest.mark.parametrize("drop_last", [False, True])
def test_under_accelerate_each_process_reads_its_own_ranks_sampler(served_dump, drop_last):
    """With N processes the Trainer's one sampler is sharded by accelerate (every N-th batch to a
    process): the patch interleaves the ranks' samplers so process p reads rank p's, batch for batch."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from hs_capture import DumpDataset
    from hs_capture.offline.train.trainers.modelopt import _Interleaved

    ds = DumpDataset(served_dump["dir"], served_dump["data"], keys="modelopt")
    world, batch = 2, 4  # 6 samples a rank: a short last batch
    ranks = [ds.sampler(batch_size=batch, num_workers=2, seed=3, drop_last=drop_last, rank=r, world_size=world)
             for r in range(world)]
    stream = _Interleaved(ranks, batch, drop_last)
    for p in range(world):
        got = list(BatchSamplerShard(BatchSampler(stream, batch, drop_last), num_processes=world, process_index=p))
        own = list(BatchSampler(ranks[p], batch, drop_last))
        assert len(got) == len(own) == len(stream) // batch // world
        assert got[:-1] == own[:-1]
        # a short last batch is filled from the rank's own share, as accelerate's even_batches does
        assert got[-1][:len(own[-1])] == own[-1] and set(got[-1]) <= set(ranks[p])


def test_data_sample_size_reads_the_first_rows_in_the_dumps_order(served_dump):
    """ModelOpt's data.sample_size=N trains on its first N files; from a dump, the first N rows."""
    from hs_capture import DumpDataset
    from hs_capture.offline.train.trainers.modelopt import _Samples

    ds = DumpDataset(served_dump["dir"], served_dump["data"], keys="modelopt")
    files = _Samples(ds, 5)
    assert [files[i].index for i in range(len(files))] == list(range(5))
    assert sorted(files.sampler(batch_size=2, num_workers=2, seed=1)) == list(range(5))
    assert ds[files[4].index]["conversation_id"] == served_dump["rows"][4]["id"]
