"""SpecForge 0.2.0 trains straight from a dump (hs_capture.offline.train.trainers.specforge).

Against the real CPU server's dump (served_dump: layers 2,3,5 = SpecForge ids 1,2,4, float32):
`hscap train specforge` runs SpecForge's own `specforge train --config`; its own reader, store,
normalizer, collator and FeatureDataLoader (threads) give, from the dump, batches equal to those
it gives from `hscap merge --format specforge`'s files in the same sample order, in the order
DumpDataset.sampler sets, and the same vocab map; a path that is no dump is left to SpecForge.
Each data-parallel rank takes its share of that order, and SpecForge's own launcher starts its
torchrun ranks through the patch. On this CPU it stops where it stops on merged files (FSDP);
with SpecForge's own backend unwrapped and its Triton loss interpreted, its Trainer takes a
training step from the dump. check() names what it cannot patch in one line.
"""

import ast
import glob
import importlib.metadata
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from hs_capture import DumpDataset
from hs_capture.cli import main
from hs_capture.offline.formats.common import sample_file_stem
from hs_capture.offline.train.trainers import specforge as patch
from hs_capture.patching import owner_of
from tests.sglang_cpu.harness import REPO

AUX_IDS = [1, 2, 4]  # what merge prints for the served dump's layers 2,3,5
FSDP_STOP = "FSDP needs a non-CPU accelerator device"


@pytest.fixture
def target(tiny_target):
    return tiny_target


@pytest.fixture
def isolated():
    """A SpecForge patch for the test, undone after it; SpecForge's CLI sets the one-process
    rendezvous variables in os.environ, put back too."""
    saved = dict(os.environ)
    sf = patch.SpecForgePatch()
    yield sf
    if sf.is_instrumented:
        sf.uninstrument()
    os.environ.clear()
    os.environ.update(saved)


def run_yaml(path: str, model: str, data: str, out: str, **extra: str) -> str:
    """README's cpu-trainer block for SpecForge, with `data` for data.hidden_states_path."""
    text = (f"model:\n  target_model_path: {model}\n  aux_hidden_state_layer_ids: {AUX_IDS}\n"
            f"  torch_dtype: bfloat16\ndata:\n  hidden_states_path: {data}\n  cache_dir: {out}-cache\n"
            f"output_dir: {out}\n")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_the_dump_gives_specforges_own_loader_the_batches_merged_files_give(served_dump, target, tmp_path,
                                                                            isolated, monkeypatch):
    import specforge.cli
    import specforge.launch as launch
    import specforge.runtime.data_plane.feature_store as store
    import specforge.training.trainer as trainer

    batch, workers, seed, max_length = 3, 2, 5, 256
    overrides = [f"training.batch_size={batch}", f"data.dataloader_num_workers={workers}",
                 f"training.seed={seed}", f"data.max_length={max_length}", "training.num_epochs=2"]
    dump = os.path.abspath(served_dump["dir"])
    merged = str(tmp_path / "sf")
    res = CliRunner().invoke(main, ["merge", dump, "-o", merged, "--format", "specforge", "--dataset",
                                    served_dump["data"]], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    ds = DumpDataset(dump, served_dump["data"], keys="specforge")
    file_of = {f"file://{dump}{patch.MARK}{i}": f"file://{os.path.join(merged, sample_file_stem(rid))}.ckpt"
               for i, rid in enumerate(ds.rids)}

    # SpecForge's Trainer builds its FeatureDataLoader, then wraps the model in FSDP: each run's
    # loader is read there, two epochs, while the run (and the patch) is live
    loaders, runs = [], []

    def recording(*args, **kwargs):
        loaders.append(feature_loader(*args, **kwargs))
        return loaders[-1]

    def before_fsdp(backend, *args, **kwargs):
        loader, epochs = loaders[-1], []
        for epoch in (0, 1):
            loader.set_epoch(epoch)  # SpecForge's own per-epoch plan (refs_for_epoch)
            own = [r.feature_store_uri for r in loader._refs]
            if runs:  # merge's files: read in the order the dump's samples were read
                by_uri = {r.feature_store_uri: r for r in loader._refs}
                loader._refs = [by_uri[file_of[u]] for u in runs[0][epoch][0]]
            epochs.append((own, list(loader)))
        live = owner_of(vars(store)["load_feature_file"])  # the patch `hscap train` put on
        views = live.dumps[dump].views if not runs else []
        runs.append(epochs + [[v.bytes_decoded for v in views]])
        return prepare_model(backend, *args, **kwargs)

    feature_loader, prepare_model = trainer.FeatureDataLoader, trainer.FSDPTrainingBackend.prepare_model
    monkeypatch.setattr(trainer, "FeatureDataLoader", recording)
    monkeypatch.setattr(trainer.FSDPTrainingBackend, "prepare_model", before_fsdp)

    # from the dump: `hscap train specforge` stops where SpecForge stops on this CPU (README)
    yaml = run_yaml(str(tmp_path / "dump.yaml"), target, dump, str(tmp_path / "out-dump"))
    res = CliRunner().invoke(main, ["train", "specforge", "--dataset", served_dump["data"], "--",
                                    "--config", yaml, *overrides])
    assert FSDP_STOP in res.output + repr(res.exception), res.output
    # from merge's files: SpecForge's own command, the patch on
    isolated.instrument(served_dump["data"])
    yaml = run_yaml(str(tmp_path / "merged.yaml"), target, merged, str(tmp_path / "out-merged"))
    with pytest.raises(RuntimeError, match=FSDP_STOP):
        specforge.cli.main(["train", "--config", yaml, *overrides])
    assert len(runs) == 2
    from_dump, from_files = runs

    # a path that is no dump is SpecForge's own: its files, sorted, in DistributedSampler's order
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    files = sorted(glob.glob(os.path.join(merged, "*.ckpt")))
    for epoch in (0, 1):
        own = launch._distributed_sampler_indices.__wrapped__(len(files), dp_rank=0, dp_size=1, seed=seed,
                                                               epoch=epoch)
        assert from_files[epoch][0] == [f"file://{files[i]}" for i in own]
    # the dump's samples are listed as SpecForge lists merge's files, so its vocab map is theirs
    listed = [file_of[r.feature_store_uri] for r in OfflineManifestReader(dump).read()]
    assert listed == [f"file://{f}" for f in files]
    maps = [torch.load(glob.glob(os.path.join(str(tmp_path / out) + "-cache", "vocab_mapping", "*.pt"))[0])
            for out in ("out-dump", "out-merged")]
    assert all(torch.equal(maps[0][k], maps[1][k]) for k in ("d2t", "t2d"))
    # read in DumpDataset.sampler's order, with SpecForge's batch size, workers and seed
    for epoch in (0, 1):
        sampler = ds.sampler(batch_size=batch, num_workers=workers, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        assert from_dump[epoch][0] == [f"file://{dump}{patch.MARK}{i}" for i in sampler]
        got, want = from_dump[epoch][1], from_files[epoch][1]
        assert len(got) == len(want) == len(ds) // batch  # SpecForge drops the short last batch
        for a, b in zip(got, want):
            assert a.metadata == b.metadata and set(a.tensors) == set(b.tensors)
            for k in a.tensors:
                assert a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]), k
            assert a.tensors["hidden_state"].shape[-1] == len(AUX_IDS) * a.tensors["target"].shape[-1]
            assert a.tensors["input_ids"].shape[1] <= max_length
    # one decode cache per loader thread, none decoding a step twice
    whole = DumpDataset(dump, served_dump["data"], keys="specforge")
    for i in range(len(whole)):
        whole[i]
    decoded = from_dump[2]
    assert len(decoded) == workers and all(0 < n <= whole.bytes_decoded for n in decoded)


def test_every_rank_and_worker_process_reads_the_dump(served_dump, target, tmp_path, isolated, capsys):
    import specforge.launch as launch
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    isolated.instrument(served_dump["data"])
    dump = os.path.abspath(served_dump["dir"])
    ds = DumpDataset(dump, served_dump["data"], keys="specforge")
    refs = OfflineManifestReader(dump).read()
    # SpecForge's own sharding, given a data-parallel rank: that rank's share of the dump's sampler
    shares = [[r.feature_store_uri for r in launch._shard_offline_refs(
        refs, use_usp_preprocess=False, seed=3, epoch=1, dp_rank=rank, dp_size=2)] for rank in (0, 1)]
    for rank, share in enumerate(shares):
        sampler = ds.sampler(seed=3, rank=rank, world_size=2)
        sampler.set_epoch(1)
        assert share == [f"file://{dump}{patch.MARK}{i}" for i in sampler]
    assert sorted(shares[0] + shares[1]) == sorted(r.feature_store_uri for r in refs)

    # with 2 processes SpecForge starts torchrun; each rank runs through the patch, dataset and all
    yaml = run_yaml(str(tmp_path / "run.yaml"), target, dump, str(tmp_path / "out"))
    patch.main(["--config", yaml, "deployment.trainer.nproc_per_node=2", "--plan"])
    argv = json.loads(capsys.readouterr().out)["commands"][0]["argv"]
    assert argv[:4] == [sys.executable, "-m", "torch.distributed.run", "--no-python"]
    at = argv.index(patch.__spec__.name)
    assert argv[at - 2:at + 4] == [sys.executable, "-m", patch.__spec__.name, "--dataset", served_dump["data"], "train"]


CPU_STEP = """if True:
    import runpy, sys, wrapt
    def unwrapped(wrapped, instance, args, kwargs):  # FSDP takes an accelerator: SpecForge's own backend, unwrapped
        return wrapped(*args, **{**kwargs, "wrap": False})
    def float32(wrapped, instance, args, kwargs):  # SpecForge's target head is bfloat16; this capture is float32
        return wrapped(*args, **kwargs).float()
    wrapt.wrap_function_wrapper("specforge.training.backend", "FSDPTrainingBackend.prepare_model", unwrapped)
    wrapt.wrap_function_wrapper("specforge.modeling.target.target_head", "TargetHead.from_pretrained", float32)
    sys.argv = ["hscap", *sys.argv[1:]]
    runpy.run_module("hs_capture.cli", run_name="__main__")
"""


def test_hscap_train_specforge_takes_a_training_step_from_the_dump(served_dump, target, tmp_path):
    assert not glob.glob(os.path.join(served_dump["root"], "**", "*.ckpt"), recursive=True)
    draft = tmp_path / "draft.json"  # a draft vocabulary smaller than the target's: the map is counted from the dump
    draft.write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,
        "vocab_size": 1024, "draft_vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "pad_token_id": 0, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS}}))
    out = str(tmp_path / "out")
    yaml = run_yaml(str(tmp_path / "run.yaml"), target, served_dump["dir"], out)
    # the CPU's settings: float32 as captured, sdpa (flex attention has no CPU backward), short rows
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "TRITON_INTERPRET": "1",  # SpecForge's loss is a Triton kernel
           "PYTHONPATH": REPO}
    p = subprocess.run([sys.executable, "-c", CPU_STEP, "train", "specforge", "--dataset", served_dump["data"], "--",
                        "--config", yaml, f"model.draft_model_config={draft}", "model.torch_dtype=float32",
                        "training.attention_backend=sdpa", "data.max_length=128", "training.batch_size=2",
                        "training.max_steps=1", "training.log_interval=1", "data.dataloader_num_workers=2"],
                       capture_output=True, text=True, env=env, timeout=900)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    steps = [ast.literal_eval(line.split(": ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("step 1: ")]
    assert len(steps) == 1, log[-4000:]
    assert math.isfinite(steps[0]["loss"]) and steps[0]["loss"] > 0 and steps[0]["grad_norm"] > 0
    assert "Added missing tokens to reach draft vocab size: 512" in log
    assert glob.glob(os.path.join(out + "-cache", "vocab_mapping", "*.pt"))
    assert os.path.exists(os.path.join(out, "specforge-run-step1", "training_state.pt"))


def test_check_names_what_cannot_be_patched_and_uninstrument_undoes_every_patch(monkeypatch, isolated):
    import specforge.launch as launch
    import specforge.runtime.data_plane.feature_store as store
    import specforge.runtime.data_plane.offline_reader as reader

    assert patch.check() is None
    before = (store.load_feature_file, reader.list_feature_files, launch._shard_offline_refs)
    isolated.instrument(None)
    assert all(a is not b for a, b in zip(before, (store.load_feature_file, reader.list_feature_files,
                                                   launch._shard_offline_refs)))
    isolated.uninstrument()
    assert (store.load_feature_file, reader.list_feature_files, launch._shard_offline_refs) == before

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0" if name == "specforge" else real(name))
    assert patch.check().startswith("specforge 0.3.0 is not supported")
    monkeypatch.setattr(importlib.metadata, "version", real)
    monkeypatch.delattr(launch, "_distributed_sampler_indices")
    assert patch.check() == "specforge 0.2.0: no specforge.launch._distributed_sampler_indices to patch"
    for name in [m for m in sys.modules if m == "specforge" or m.startswith("specforge.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    message = patch.check()
    assert message.startswith("SpecForge's training code cannot be imported") and "\n" not in message
