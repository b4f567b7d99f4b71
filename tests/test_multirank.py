"""Several ranks for real: the REAL SGLang with --tp 2, and with --tp 2 --dp 2
--enable-dp-attention, as two scheduler processes on this CPU with gloo collectives between
them (tests/sglang_cpu/README.md says how). Which rank writes, how files are named, what
merge and verify make of several ranks, and fidelity against transformers under batched and
chunked prefill."""

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hs_capture.cli import main
from tests.conftest import NUM_LAYERS
from tests.sglang_cpu.harness import Server, hf_hidden_states, hscap_send, server_env, write_jsonl

LAYERS = [1, 3, 5]
TOL = 1e-4
TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank


def rows(seed):
    rng = random.Random(seed)
    return [{"id": f"mr{seed}-{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(n)]}
            for i, n in enumerate([1, 7, 64, 129, 300, 511, 40, 260, 3, 90])]


def serve(tiny_model, root, flags, data):
    dump = str(root / "dump")
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5", **TWO_RANKS), str(root / "server.log"),
                 ["--chunked-prefill-size", "128", "--disable-radix-cache", *flags])
    try:
        srv.wait_healthy(timeout=300)
        rc, summary = hscap_send(data, "--url", srv.url, "-c", "4", "--failures", str(root / "f.jsonl"))
        assert rc == 0 and summary["failed"] == 0
    finally:
        srv.stop()
    return dump, srv.log()


def run_cli(*args):
    res = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])


def index(dump):
    (run,) = os.listdir(dump)
    out = {}
    for name in os.listdir(os.path.join(dump, run, "index")):
        with open(os.path.join(dump, run, "index", name)) as f:
            out[name[:-len(".jsonl")]] = [json.loads(x) for x in f]
    return os.path.join(dump, run), out


def assert_merged_equal_transformers(dump, data, samples, tiny_model, out):
    code, s = run_cli("merge", dump, "-o", out, "--format", "specforge", "--dataset", data)
    assert code == 0 and s["written"] == len(samples) and s["incomplete"] == 0
    by_ids = {tuple(r["input_ids"]): r["id"] for r in samples}
    seen = set()
    for name in os.listdir(out):
        if name.endswith(".ckpt"):
            d = torch.load(os.path.join(out, name), weights_only=True)
            ids = d["input_ids"].tolist()
            seen.add(by_ids[tuple(ids)])
            ref = hf_hidden_states(tiny_model, ids)
            aux = np.concatenate([ref[k] for k in LAYERS], axis=-1)
            assert np.abs(d["aux_hidden_state"][0].numpy() - aux).max() <= TOL
            assert np.abs(d["hidden_state"][0].numpy() - ref[NUM_LAYERS]).max() <= TOL
    assert seen == {r["id"] for r in samples}


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    samples = rows(1)
    data = write_jsonl(root / "d.jsonl", samples)
    dump, log = serve(tiny_model, root, ["--tp", "2"], data)
    return {"dump": dump, "log": log, "data": data, "rows": samples, "root": root}


def test_tp2_only_tp_rank_0_writes_and_says_who_does_not(tp2):
    run, idx = index(tp2["dump"])
    assert sorted(idx) == ["dp0-tp0-pp0"] and sorted(os.listdir(os.path.join(run, "data"))) == ["dp0-tp0-pp0"]
    assert "writing" in tp2["log"] and "as dp0-tp0-pp0" in tp2["log"]
    assert "rank dp0-tp1-pp0 does not write (attention-TP rank 1)" in tp2["log"]
    meta = json.load(open(os.path.join(run, "ranks", "dp0-tp0-pp0.json")))
    assert meta["parallel"]["tp_size"] == 2 and meta["parallel"]["dp_size"] == 1


def test_tp2_batched_and_chunked_capture_equals_transformers(tp2, tiny_model, tmp_path):
    _, idx = index(tp2["dump"])
    lines = [x for x in idx["dp0-tp0-pp0"] if "files" in x]
    assert max(len(x["seqs"]) for x in lines) > 1  # batched
    assert any(s["prefix"] > 0 for x in lines for s in x["seqs"])  # chunked
    assert_merged_equal_transformers(tp2["dump"], tp2["data"], tp2["rows"], tiny_model, str(tmp_path / "sf"))
    code, doc = run_cli("verify", tp2["dump"], "--dataset", tp2["data"], "--reference", tiny_model,
                        "--reference-samples", "3")
    assert code == 0, doc["findings"]


@pytest.fixture(scope="module")
def dpa(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpa")
    samples = rows(2)
    data = write_jsonl(root / "d.jsonl", samples)
    dump, log = serve(tiny_model, root, ["--tp", "2", "--dp", "2", "--enable-dp-attention"], data)
    return {"dump": dump, "log": log, "data": data, "rows": samples, "root": root}


def test_dp_attention_one_writer_per_dp_group_each_sample_in_one(dpa):
    run, idx = index(dpa["dump"])
    assert sorted(idx) == ["dp0-tp0-pp0", "dp1-tp1-pp0"]  # attention-TP rank 0 of each DP group
    for tag in idx:
        meta = json.load(open(os.path.join(run, "ranks", tag + ".json")))
        assert meta["parallel"]["dp_size"] == 2 and meta["parallel"]["dp_rank"] == int(tag[2])
        names = os.listdir(os.path.join(run, "data", tag, "000000"))
        assert names and all(n.startswith(tag + ".s") for n in names)
    owners = {}
    ids = {r["id"] for r in dpa["rows"]}  # (the server's own warm-up requests are there too)
    for tag, lines in idx.items():
        for x in lines:
            for s in x.get("seqs", []):
                if s["rid"] in ids:
                    owners.setdefault(s["rid"], set()).add(tag)
    assert set(owners) == ids and all(len(v) == 1 for v in owners.values())
    assert len({next(iter(v)) for v in owners.values()}) == 2  # both DP groups served some


def test_dp_attention_capture_equals_transformers_and_verifies(dpa, tiny_model, tmp_path):
    assert_merged_equal_transformers(dpa["dump"], dpa["data"], dpa["rows"], tiny_model, str(tmp_path / "sf"))
    code, doc = run_cli("verify", dpa["dump"], "--dataset", dpa["data"])
    assert code == 0, doc["findings"]


@pytest.mark.parametrize("what", ["rank", "data"])
def test_verify_fails_when_one_ranks_files_are_removed(dpa, tmp_path, what):
    copy = tmp_path / "dump"
    shutil.copytree(dpa["dump"], copy)
    run, idx = index(str(copy))
    gone = {s["rid"] for x in idx["dp1-tp1-pp0"] for s in x.get("seqs", [])} & {r["id"] for r in dpa["rows"]}
    shutil.rmtree(os.path.join(run, "data", "dp1-tp1-pp0"))
    if what == "rank":  # everything that rank wrote
        os.remove(os.path.join(run, "index", "dp1-tp1-pp0.jsonl"))
        os.remove(os.path.join(run, "ranks", "dp1-tp1-pp0.json"))
    code, doc = run_cli("verify", str(copy), "--dataset", dpa["data"])
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert code == 1
    if what == "rank":
        assert any(f["check"] == "ranks" and "DP group 1 of 2" in f["message"] for f in errors)
    else:
        assert any(f["check"] == "files" and "missing" in f["message"] and "dp1-tp1-pp0" in f["path"] for f in errors)
    assert {f["rid"] for f in errors if f["check"] == "coverage"} == gone
