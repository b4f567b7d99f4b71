"""hscap merge on a dump from the REAL CPU server (pre-norm capture on): every format's
samples equal transformers' hidden states; multi-dir, sharded and resumed merges give the
same files as one clean merge; incomplete samples are listed, never written."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.offline.merge.output_dir import MANIFEST
from tests.conftest import NUM_LAYERS
from tests.sglang_cpu.harness import hf_hidden_states, write_jsonl

LAYERS = [2, 3, 5]
TOL = 1e-4


@pytest.fixture(scope="module")
def dump(served_dump):
    return served_dump


def run_merge(*args):
    res = CliRunner().invoke(main, ["merge", "--json", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def files_of(out):
    """The output's files (the report and merge's manifest of what it wrote apart: they record how
    the output was made, in the order its runs made it)."""
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))
            if n not in ("merge_report.json", MANIFEST)}


def by_rid(rows):
    return {r["id"]: r for r in rows}


def test_specforge_samples_equal_transformers(dump, tiny_model, tmp_path):
    out = str(tmp_path / "sf")
    s = run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", dump["data"])
    assert s["written"] == len(dump["rows"]) and s["incomplete"] == 0 and s["loss_mask"] == "dataset"
    rows = by_rid(dump["rows"])
    seen = set()
    for name in os.listdir(out):
        if not name.endswith(".ckpt"):
            continue
        d = torch.load(os.path.join(out, name), mmap=True, weights_only=True)  # how SpecForge loads
        ids = d["input_ids"].tolist()
        row = next(r for r in rows.values() if r["input_ids"] == ids)
        seen.add(row["id"])
        t = len(ids)
        assert d["input_ids"].dtype == torch.int64 and d["loss_mask"].dtype == torch.int64
        assert d["loss_mask"].tolist() == row["loss_mask"]
        assert d["aux_hidden_state"].shape == (1, t, 3 * 256) and d["hidden_state"].shape == (1, t, 256)
        ref = hf_hidden_states(tiny_model, ids)
        aux = np.concatenate([ref[k] for k in LAYERS], axis=-1)
        assert np.abs(d["aux_hidden_state"][0].numpy() - aux).max() <= TOL
        assert np.abs(d["hidden_state"][0].numpy() - ref[NUM_LAYERS]).max() <= TOL
    assert seen == set(rows)


def test_modelopt_samples_load_weights_only_and_match(dump, tiny_model, tmp_path):
    out = str(tmp_path / "mo")
    summary = run_merge(dump["dir"], "-o", out, "--format", "modelopt", "--dataset", dump["data"])
    # the ids SGLang 0.5.23's DeepSeek set_eagle3_layers_to_capture turns into layers 2,3,5 (its
    # first id is 1, so it adds 1; tests/test_serving_ids.py runs that code); the dataset's
    # masks need answer_only_loss
    want = {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "answer_only_loss": True}
    assert summary["settings"] == want and summary["warnings"] == []
    assert summary["serving"]["engine"] == "sglang" and summary["serving"]["family"] == "deepseek"
    assert json.load(open(os.path.join(out, "trainer_settings.json")))["settings"] == want
    rows = by_rid(dump["rows"])
    names = [n for n in os.listdir(out) if n.endswith(".pt")]
    assert len(names) == len(rows)
    for name in names:
        d = torch.load(os.path.join(out, name), weights_only=True)
        assert set(d) == {"conversation_id", "input_ids", "hidden_states", "aux_hidden_states", "loss_mask",
                          "hidden_states_prenorm"}
        row = rows[d["conversation_id"]]
        assert d["input_ids"].tolist() == row["input_ids"] and d["loss_mask"].tolist() == row["loss_mask"]
        ref = hf_hidden_states(tiny_model, row["input_ids"])
        assert np.abs(d["hidden_states"].numpy() - ref[NUM_LAYERS]).max() <= TOL
        aux = np.concatenate([ref[k] for k in LAYERS], axis=-1)
        assert np.abs(d["aux_hidden_states"].numpy() - aux).max() <= TOL


def test_speculators_rows_hold_three_aux_and_the_prenorm_final(dump, tiny_model, tmp_path):
    from safetensors.torch import load_file  # the reader speculators uses

    out = str(tmp_path / "sp")
    summary = run_merge(dump["dir"], "-o", out, "--format", "speculators", "--dataset", dump["data"])
    assert summary["settings"] == {"target_layer_ids": LAYERS}  # speculators counts as we do
    for row, r in enumerate(dump["rows"]):  # rows follow the dataset order
        d = load_file(os.path.join(out, f"hs_{row}.safetensors"))
        t = len(r["input_ids"])
        assert d["token_ids"].tolist() == r["input_ids"] and d["hidden_states"].shape == (t, 4, 256)
        ref, pre = hf_hidden_states(tiny_model, r["input_ids"], prenorm=True)
        for j, layer in enumerate(LAYERS):
            assert np.abs(d["hidden_states"][:, j].numpy() - ref[layer]).max() <= TOL
        assert np.abs(d["hidden_states"][:, 3].numpy() - pre).max() <= TOL
        assert np.abs(pre - ref[NUM_LAYERS]).max() > 0.1  # pre-norm really differs from post-norm


def test_multi_dir_and_sharded_merges_equal_one_merge(dump, tmp_path):
    one = str(tmp_path / "one")
    run_merge(dump["dir"], "-o", one, "--format", "specforge")
    # two "nodes": each holds part of the run's index lines (the data files are shared)
    (run_dir,) = [os.path.join(dump["dir"], d) for d in os.listdir(dump["dir"])]
    halves = []
    for k in range(2):
        node = tmp_path / f"node{k}" / os.path.basename(run_dir)
        shutil.copytree(run_dir, node)
        index = node / "index" / "dp0-tp0-pp0.jsonl"
        lines = index.read_text().splitlines(keepends=True)
        index.write_text("".join(lines[k::2]))
        halves.append(str(node.parent))
    multi = str(tmp_path / "multi")
    run_merge(*halves, "-o", multi, "--format", "specforge")
    sharded = str(tmp_path / "sharded")
    for i in range(3):
        run_merge(dump["dir"], "-o", sharded, "--format", "specforge", "--shard", f"{i}/3", "-j", "2")
    assert files_of(multi) == files_of(one) == files_of(sharded)


def test_a_killed_merge_resumes_to_identical_output(dump, tmp_path):
    clean = str(tmp_path / "clean")
    run_merge(dump["dir"], "-o", clean, "--format", "modelopt")
    out = str(tmp_path / "resumed")
    shutil.copytree(clean, out)
    names = sorted(n for n in os.listdir(out) if n.endswith(".pt"))
    for n in names[::2]:  # what a kill leaves: some files done, others not started,
        os.remove(os.path.join(out, n))
    with open(os.path.join(out, f".{names[0]}.tmp-12345"), "wb") as f:  # and one half written
        f.write(b"PK\x03\x04 half a zip")
    s = run_merge(dump["dir"], "-o", out, "--format", "modelopt")
    assert s["skipped_existing"] == len(names) - len(names[::2]) and s["written"] == len(names[::2])
    assert files_of(out) == files_of(clean)


def test_incomplete_samples_are_listed_never_written(dump, tmp_path):
    rows = [dict(r) for r in dump["rows"]]
    rows[3] = {**rows[3], "input_ids": rows[3]["input_ids"] + [7], "loss_mask": rows[3]["loss_mask"] + [1]}
    rows[4] = {**rows[4], "input_ids": [9] + rows[4]["input_ids"][1:]}  # same length, other tokens
    rows.append({"id": "never-sent", "input_ids": [1, 2, 3]})
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "inc")
    s = run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", data)
    report = json.load(open(os.path.join(out, "merge_report.json")))
    assert s["written"] == len(rows) - 3 and s["incomplete"] == 3
    assert report["incomplete"] == {
        rows[3]["id"]: f"positions {len(rows[3]['input_ids']) - 1}..{len(rows[3]['input_ids']) - 1} missing",
        rows[4]["id"]: "token ids differ from the dataset at position 0",
        "never-sent": "never captured"}
    assert len([n for n in os.listdir(out) if n.endswith(".ckpt")]) == len(rows) - 3


def test_without_a_dataset_sglangs_warmup_is_left_out_and_said(dump, tmp_path):
    """The fixture's server ran without the launcher, so SGLang's startup warmup (ids [10, 11,
    12], a generated rid) was captured: merge without --dataset must not make it a sample, and
    verify, which plans the same way, must not count it either."""
    from hs_capture.offline.read.planning import Captured, plan

    users = {r["id"] for r in dump["rows"]}
    warm = [rid for rid in Captured([dump["dir"]]).pieces if rid not in users]
    assert len(warm) == 1  # the dump does hold it
    p = plan([dump["dir"]])
    assert list(p.left_out) == warm and set(p.samples) == users
    res = CliRunner().invoke(main, ["verify", dump["dir"], "--json"])
    stats = json.loads(res.output.strip().splitlines()[-1])["stats"]
    assert stats["samples_complete"] == len(users) and stats["samples_left_out"] == 1
    out = str(tmp_path / "nods")
    res = CliRunner().invoke(main, ["merge", dump["dir"], "-o", out, "--format", "specforge"])
    assert res.exit_code == 0, res.output
    assert f"left out '{warm[0]}': SGLang's startup warmup" in res.output
    report = json.load(open(os.path.join(out, "merge_report.json")))
    assert list(report["left_out"]) == warm and report["written"] == len(dump["rows"])
    assert report["unattributed"] == []
    ids = {tuple(torch.load(os.path.join(out, n), weights_only=True)["input_ids"].view(-1).tolist())
           for n in os.listdir(out) if n.endswith(".ckpt")}
    assert (10, 11, 12) not in ids and len(ids) == len(dump["rows"])


def test_bad_merge_input_is_one_line(dump, tmp_path):
    res = CliRunner().invoke(main, ["merge", str(tmp_path), "-o", str(tmp_path / "o"), "--format", "specforge"])
    assert res.exit_code == 1 and "no hs_capture run found" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["merge", dump["dir"], "-o", str(tmp_path / "o"), "--format", "specforge",
                                    "--shard", "3/2"])
    assert res.exit_code == 2 and "need 0 <= i < N" in res.output


def test_native_packed_shards_random_access_and_resume(dump, tiny_model, tmp_path):
    from hs_capture.offline.train.dataset import HsCaptureDataset

    out = str(tmp_path / "native")
    s = run_merge(dump["dir"], "-o", out, "--format", "hscap", "--dataset", dump["data"])
    assert s["written"] == len(dump["rows"])
    ds = HsCaptureDataset(out)
    assert ds.ids() == [r["id"] for r in dump["rows"]]  # rows in dataset order
    for r in reversed(dump["rows"]):  # any order: random access
        item = ds.by_id(r["id"])
        assert item["input_ids"].tolist() == r["input_ids"] and item["loss_mask"].tolist() == r["loss_mask"]
        ref, pre = hf_hidden_states(tiny_model, r["input_ids"], prenorm=True)
        aux = np.concatenate([ref[k] for k in LAYERS], axis=-1)
        assert np.abs(item["aux_hidden_state"].numpy() - aux).max() <= TOL
        assert np.abs(item["hidden_state"].numpy() - ref[NUM_LAYERS]).max() <= TOL
        assert np.abs(item["prenorm_hidden_state"].numpy() - pre).max() <= TOL
    # split over two "machines", then a re-run: same shards, nothing rewritten
    split = str(tmp_path / "split")
    for i in range(2):
        run_merge(dump["dir"], "-o", split, "--format", "hscap", "--dataset", dump["data"], "--shard", f"{i}/2")
    again = run_merge(dump["dir"], "-o", split, "--format", "hscap", "--dataset", dump["data"], "--shard", "1/2")
    assert again["written"] == 0 and again["skipped_existing"] == len(dump["rows"]) // 2
    ds2 = HsCaptureDataset(split)
    assert ds2.ids() == ds.ids()
    for rid in ds.ids():
        a, b = ds.by_id(rid), ds2.by_id(rid)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_cli_starts_without_torch_and_knows_every_format():
    import subprocess
    import sys

    code = ("import sys; from hs_capture.cli import main; from hs_capture.cli.merge_cmd import merge_cmd; "
            "choices = [p for p in merge_cmd.params if p.name == 'fmt_name'][0].type.choices; "
            "assert sorted(choices) == ['hscap', 'modelopt', 'specforge', 'speculators'], choices; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _framework_module(package: str, relpath: str, name: str):
    """A framework's reader module loaded from its installed file, without running the
    package __init__ (which imports its training stack: datasets, deepspeed, ...)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    path = os.path.join(list(spec.submodule_search_locations)[0], relpath)
    mod_spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def test_specforge_own_offline_reader_accepts_the_output(dump, tmp_path):
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import _OFFLINE_EAGLE3_KEYS, _inspect_feature_file, list_feature_files

    out = str(tmp_path / "sf")
    run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", dump["data"])
    files = list_feature_files(out)
    assert len(files) == len(dump["rows"])
    lengths = sorted(len(r["input_ids"]) for r in dump["rows"])
    got = []
    for f in files:
        specs, num_tokens, nbytes = _inspect_feature_file(f, _OFFLINE_EAGLE3_KEYS)
        assert specs["aux_hidden_state"].shape == (1, num_tokens, 768) and specs["hidden_state"].dtype == "float32"
        assert load_feature_file(f)["loss_mask"].shape == (num_tokens,)
        got.append(num_tokens)
    assert sorted(got) == lengths


def specforge_target_head(model_dir: str, tmp_path):
    """SpecForge 0.2.0's own TargetHead (what its offline trainer multiplies the stored final
    state by) from a tiny model dir; it needs a *.index.json, as real checkpoints have."""
    from safetensors import safe_open
    from specforge.modeling.target.target_head import TargetHead

    d = tmp_path / "target"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(model_dir, name), d / name)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return TargetHead.from_pretrained(str(d))


def test_merge_warns_when_specforge_cannot_train_on_the_captured_dtype(dump, tiny_model, tmp_path):
    """A float32 capture: SpecForge's own target head (bf16 whatever its config says) cannot
    take its states, and merge says so (bf16 dumps pass: test_reference_bf16)."""
    out = str(tmp_path / "sf")
    s = run_merge(dump["dir"], "-o", out, "--format", "specforge")
    assert len(s["warnings"]) == 1 and "bfloat16" in s["warnings"][0] and "float32" in s["warnings"][0]
    assert json.load(open(os.path.join(out, "merge_report.json")))["warnings"] == s["warnings"]
    f = next(os.path.join(out, n) for n in sorted(os.listdir(out)) if n.endswith(".ckpt"))
    with pytest.raises(RuntimeError, match="dtype"):
        specforge_target_head(tiny_model, tmp_path)(torch.load(f)["hidden_state"])
    assert run_merge(dump["dir"], "-o", str(tmp_path / "mo"), "--format", "modelopt")["warnings"] == []


def test_specforge_own_manifest_reader_and_feature_loader_serve_the_output(dump, tmp_path):
    """SpecForge 0.2.0's OfflineManifestReader -> LocalFeatureStore -> FeatureDataLoader, the
    path its offline trainer takes, on merge's output: every sample, its tokens and mask."""
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    out = str(tmp_path / "sf")
    run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", dump["data"])
    refs = OfflineManifestReader(out, validate_files=True).read()
    assert len(refs) == len(dump["rows"])
    by_ids = {tuple(r["input_ids"]): r for r in dump["rows"]}
    seen = 0
    for batch in FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=1):
        t = batch.tensors
        ids = tuple(t["input_ids"].reshape(-1).tolist())
        row = by_ids[ids]  # KeyError: tokens that are no dataset row
        n = len(ids)
        assert t["loss_mask"].reshape(-1).tolist() == row["loss_mask"] and t["input_ids"].dtype == torch.int64
        assert t["aux_hidden_state"].shape[-2:] == (n, 3 * 256) and t["hidden_state"].shape[-2:] == (n, 256)
        seen += 1
    assert seen == len(dump["rows"])


def test_modelopt_own_dataset_and_collator_read_the_output(dump, tmp_path):
    """ModelOpt 0.47.0's OfflineSupervisedDataset + EagleOfflineDataCollator, loaded from its
    own files (its package __init__ pulls its training stack), on merge's output, with the
    settings merge wrote for it."""
    import sys

    loss_mask_mod = _framework_module("modelopt", "torch/utils/loss_mask.py", "modelopt.torch.utils.loss_mask")
    sys.modules["modelopt.torch.utils.loss_mask"] = loss_mask_mod  # what eagle/utils.py imports
    try:
        eagle = _framework_module("modelopt", "torch/speculative/eagle/utils.py", "modelopt_eagle_utils")
    finally:
        sys.modules.pop("modelopt.torch.utils.loss_mask", None)
    out = str(tmp_path / "mo")
    run_merge(dump["dir"], "-o", out, "--format", "modelopt", "--dataset", dump["data"])
    settings = json.load(open(os.path.join(out, "trainer_settings.json")))["settings"]
    files = sorted(os.path.join(out, n) for n in os.listdir(out) if n.endswith(".pt"))
    rows = by_rid(dump["rows"])
    ds = eagle.OfflineSupervisedDataset(files, answer_only_loss=settings["answer_only_loss"])
    items = [ds[i] for i in range(len(ds))]
    h = 256
    for f, item in zip(files, items):
        row = rows[torch.load(f, weights_only=True)["conversation_id"]]
        t = len(row["input_ids"])
        assert item["input_ids"].tolist() == row["input_ids"] and item["input_ids"].dtype == torch.int64
        assert item["loss_mask"].tolist() == row["loss_mask"]  # answer_only_loss: the dataset's mask is used
        assert item["labels"][:-1].tolist() == row["input_ids"][1:]
        assert item["aux_hidden_states"].shape == (t, len(settings["eagle_aux_hidden_state_layer_ids"]) * h)
        assert item["base_model_hidden_states"].shape == (t, h) and item["base_hidden_prenorm"] is False
    # without answer_only_loss ModelOpt trains on every token: why merge says to set it
    plain = eagle.OfflineSupervisedDataset(files, answer_only_loss=False)
    assert all(plain[i]["loss_mask"].tolist() == [1] * len(items[i]["input_ids"]) for i in range(len(plain)))
    batch = eagle.EagleOfflineDataCollator(train_len=512)(items[:4])
    assert batch["input_ids"].shape == (4, 512) and batch["loss_mask"].shape == (4, 512)
    assert batch["base_model_outputs"]["aux_hidden_states"].shape == (4, 512, 3 * h)
    assert batch["base_model_outputs"]["aux_hidden_states"].dtype == torch.float32


def test_speculators_own_checks_accept_the_output(dump, tmp_path):
    from pathlib import Path

    from safetensors.torch import load_file

    offline = _framework_module("speculators", "data_generation/offline.py", "speculators_offline")
    out = str(tmp_path / "sp")
    summary = run_merge(dump["dir"], "-o", out, "--format", "speculators", "--dataset", dump["data"])
    assert summary["settings"] == {"target_layer_ids": LAYERS}  # speculators counts as we do
    assert offline.get_existing_hidden_state_indices(Path(out)) == list(range(len(dump["rows"])))
    assert offline.find_corrupt_hidden_state_indices(Path(out), list(range(len(dump["rows"])))) == {}
    for row, r in enumerate(dump["rows"]):
        offline.check_hidden_states(load_file(os.path.join(out, f"hs_{row}.safetensors")), r["input_ids"])


def test_a_missing_layer_or_unreadable_file_skips_only_that_sample(dump, tmp_path):
    copy = tmp_path / "dump"
    shutil.copytree(dump["dir"], copy)
    (run,) = [copy / d for d in os.listdir(copy)]
    lines = [json.loads(x) for x in (run / "index" / "dp0-tp0-pp0.jsonl").read_text().splitlines()]
    solo = [x for x in lines if "files" in x and len(x["seqs"]) == 1 and x["seqs"][0]["rid"].startswith("m/")]
    gone, corrupt = solo[0], solo[-1]
    os.remove(run / gone["files"]["L03"]["path"])  # a missing layer file
    del gone["files"]["L03"]  # ...and, in a second step, an index line that lacks the layer
    with open(run / corrupt["files"]["final"]["path"], "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff\xff")
    (run / "index" / "dp0-tp0-pp0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = str(tmp_path / "o")
    s = run_merge(str(copy), "-o", out, "--format", "specforge", "--dataset", dump["data"])
    report = json.load(open(os.path.join(out, "merge_report.json")))["incomplete"]
    assert report[gone["seqs"][0]["rid"]] == f"step {gone['step']} of dp0-tp0-pp0 lacks L03"
    assert report[corrupt["seqs"][0]["rid"]].startswith("unreadable: ")
    assert s["written"] == len(dump["rows"]) - 2


def _merge(*args):
    return CliRunner().invoke(main, ["merge", *args], catch_exceptions=False)


def test_merge_refuses_an_output_dir_holding_other_files_and_never_writes_into_a_dump(dump, tmp_path):
    # files merge did not write: refused, even with --overwrite, and left as they were
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "other-run.ckpt").write_text("a stranger SpecForge's glob would train on")
    for extra in ([], ["--overwrite"]):
        res = _merge(dump["dir"], "-o", str(out), "--format", "specforge", *extra)
        assert res.exit_code == 1 and "holds 2 files and 1 directory merge did not write" in res.output
        assert "Traceback" not in res.output
        assert sorted(os.listdir(out)) == ["notes.txt", "sub"] and (out / "notes.txt").read_text() == "mine"
    # into the dump itself, or a directory inside it: refused, nothing written there
    copy = tmp_path / "dump"
    shutil.copytree(dump["dir"], copy)
    (run,) = [d for d in os.listdir(copy)]
    before = sorted(os.path.relpath(os.path.join(r, n), copy) for r, _, ns in os.walk(copy) for n in ns)
    for target in (copy, copy / run, copy / "train"):
        res = _merge(str(copy), "-o", str(target), "--format", "modelopt")
        assert res.exit_code == 1 and "merge never writes into a dump" in res.output, res.output
    assert sorted(os.path.relpath(os.path.join(r, n), copy) for r, _, ns in os.walk(copy) for n in ns) == before
    res = _merge(str(copy / run), "-o", str(tmp_path), "--format", "modelopt")  # the dump inside OUT
    assert res.exit_code == 1 and "is inside" in res.output


def test_files_named_as_merge_names_them_are_not_merges_unless_it_recorded_writing_them(dump, tmp_path):
    # a user's own SpecForge data (SpecForge's capture script names files data_N.ckpt, as merge
    # does) and another .ckpt: refused, with or without --overwrite, and both left as they were
    out = tmp_path / "users"
    out.mkdir()
    (out / "data_0.ckpt").write_bytes(b"the user's own sample")
    (out / "foreign.ckpt").write_bytes(b"another")
    for extra in ([], ["--overwrite"]):
        res = _merge(dump["dir"], "-o", str(out), "--format", "specforge", *extra)
        assert res.exit_code == 1 and "holds 2 files merge did not write" in res.output, res.output
        assert sorted(os.listdir(out)) == ["data_0.ckpt", "foreign.ckpt"]
        assert (out / "data_0.ckpt").read_bytes() == b"the user's own sample"
    # merge's own output, then a file of the user's put beside it: --overwrite still refuses
    own = str(tmp_path / "own")
    run_merge(dump["dir"], "-o", own, "--format", "specforge")
    with open(os.path.join(own, "data_0.ckpt.user"), "wb") as f:
        f.write(b"x")
    res = _merge(dump["dir"], "-o", own, "--format", "modelopt", "--overwrite")
    assert res.exit_code == 1 and "1 file merge did not write" in res.output and "data_0.ckpt.user" in res.output
    assert os.path.exists(os.path.join(own, "data_0.ckpt.user"))


def test_the_output_of_a_merge_that_recorded_no_files_is_refused_in_one_line_and_left_alone(dump, tmp_path):
    # a merge before the manifest existed left its files and its report, and no list of the files:
    # neither a resume nor --overwrite can tell them from a user's, so the directory is refused
    out = str(tmp_path / "old")
    run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", dump["data"])
    os.remove(os.path.join(out, MANIFEST))
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    for fmt, extra in (("specforge", []), ("specforge", ["--overwrite"]), ("modelopt", ["--overwrite"])):
        res = _merge(dump["dir"], "-o", out, "--format", fmt, "--dataset", dump["data"], *extra)
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        (line,) = res.output.strip().splitlines()
        assert "kept no record of its files" in line and "merge into a new directory" in line, line
        assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before


def test_merge_and_verify_take_one_jobs_default_from_the_machine(monkeypatch):
    from hs_capture.cli.merge_cmd import merge_cmd
    from hs_capture.cli.send_cmd import send
    from hs_capture.cli.verify_cmd import verify_cmd
    from hs_capture.offline.workers import procs

    defaults = {cmd.name: next(p for p in cmd.params if p.name == "jobs").default
                for cmd in (merge_cmd, verify_cmd, send)}
    assert set(defaults.values()) == {procs.default_jobs}, defaults
    assert 1 <= procs.default_jobs() <= procs.cores()
    monkeypatch.setattr(procs, "cores", lambda: 64)
    monkeypatch.setattr(procs, "WORKER_MEMORY", 1 << 50)  # more than any machine has: one worker
    assert procs.default_jobs() == 1
    monkeypatch.setattr(procs, "WORKER_MEMORY", 1)  # memory to spare: one per core
    assert procs.default_jobs() == 64


def test_a_rerun_over_finished_output_keeps_the_record_of_what_the_directory_holds(dump, tmp_path):
    out = str(tmp_path / "o")
    first = run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", dump["data"])
    before = json.load(open(os.path.join(out, "merge_report.json")))
    settings = json.load(open(os.path.join(out, "trainer_settings.json")))
    again = run_merge(dump["dir"], "-o", out, "--format", "specforge", "--dataset", dump["data"])
    assert again["written"] == 0 and again["skipped_existing"] == first["written"]
    after = json.load(open(os.path.join(out, "merge_report.json")))
    for key in ("written", "tokens", "raw_bytes", "bytes_out", "warnings", "incomplete", "dtypes"):
        assert after[key] == before[key], key
    assert after["written"] == first["written"] > 0 and after["tokens"] > 0
    assert json.load(open(os.path.join(out, "trainer_settings.json")))["warnings"] == settings["warnings"]


def test_merge_resumes_its_own_format_and_replaces_another_only_with_overwrite(dump, tmp_path):
    out = str(tmp_path / "o")
    first = run_merge(dump["dir"], "-o", out, "--format", "modelopt")
    again = run_merge(dump["dir"], "-o", out, "--format", "modelopt")  # its own output: a resume
    assert again["skipped_existing"] == first["written"] and again["written"] == 0
    res = _merge(dump["dir"], "-o", out, "--format", "specforge")
    assert res.exit_code == 1 and "holds the modelopt output of an earlier merge" in res.output
    assert "--overwrite" in res.output and not any(n.endswith(".ckpt") for n in os.listdir(out))
    s = run_merge(dump["dir"], "-o", out, "--format", "specforge", "--overwrite")
    names = os.listdir(out)
    assert s["written"] == first["written"] and not any(n.endswith(".pt") for n in names)
    assert sum(n.endswith(".ckpt") for n in names) == s["written"]
    assert json.load(open(os.path.join(out, "trainer_settings.json")))["format"] == "specforge"
