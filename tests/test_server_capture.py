"""End to end on the REAL SGLang: a CPU server on a tiny DeepSeek-V3, started with the
documented PYTHONPATH command, captures what transformers computes on the same weights."""

import json
import os
import random
import time

import numpy as np
import pytest

from hs_capture.dump import hst as fmt
from hs_capture.dump.paths import TEMP_MARK, rank_meta_path
from hs_capture.offline.read.reader import open_runs
from tests.conftest import NUM_LAYERS
from tests.sglang_cpu.harness import Server, hf_hidden_states, server_env
from tests.sglang_cpu.stitch import stitch

LAYERS = [2, 3, 5]  # the shared served dump's (conftest.served_dump), pre-norm on
CHUNK = 128
TOL = 1e-4


@pytest.fixture(scope="module")
def captured(served_dump):
    """conftest's shared served dump: concurrent requests (forwards hold several), prompts of 1
    to 600 tokens chunked at 128."""
    return {"dump": served_dump["dir"], "reqs": {r["id"]: r["input_ids"] for r in served_dump["rows"]},
            "log": served_dump["log"]}


def test_logs_say_capture_is_live(captured):
    log = captured["log"]
    assert "[HS_DUMP] DeepseekV3ForCausalLM: layers_to_capture=[2, 3, 5]" in log
    assert "[HS_DUMP] CausalLM: capture_aux_hidden_states=True" in log
    assert "[HS_DUMP] rank dp0-tp0-pp0: closed:" in log
    ours = [line for line in log.splitlines() if line.startswith("[HS_DUMP]")]
    assert not [line for line in ours if "ERROR" in line or "failed (" in line]  # no capture error counted


def test_every_layer_and_final_state_match_transformers(captured, tiny_model):
    (run,) = open_runs(captured["dump"])
    samples = stitch(run)
    for rid, ids in captured["reqs"].items():
        s = samples[rid]
        assert s.complete and s.input_ids.tolist() == ids, rid
        ref, pre = hf_hidden_states(tiny_model, ids, prenorm=True)
        assert sorted(s.layers) == LAYERS
        for layer in LAYERS:
            diff = np.abs(s.layers[layer] - ref[layer]).max()
            assert diff <= TOL, (rid, layer, diff)
        diff = np.abs(s.final - ref[NUM_LAYERS]).max()
        assert diff <= TOL, (rid, "final", diff)
        diff = np.abs(s.prenorm - pre).max()
        assert diff <= TOL, (rid, "prenorm", diff)


def test_long_prompts_were_chunked_and_batches_held_several_requests(captured):
    (run,) = open_runs(captured["dump"])
    lines = [x.to_json() for x in run.index("dp0-tp0-pp0") if x.written]
    assert all(x["num_tokens"] <= CHUNK for x in lines)
    assert any(s["prefix"] > 0 for x in lines for s in x["seqs"])  # a later chunk
    assert any(len(x["seqs"]) > 1 for x in lines)  # a batch of several requests
    assert {x["mode"] for x in lines} == {"EXTEND"}


def test_run_metadata_records_the_contract(captured, tiny_model):
    (run,) = open_runs(captured["dump"])
    meta = json.load(open(rank_meta_path(run.path, "dp0-tp0-pp0")))  # the file as written
    assert meta["status"] == "closed"
    assert meta["layers"] == LAYERS and meta["num_layers"] == NUM_LAYERS and meta["hidden_size"] == 256
    assert meta["final_state"] == "post_norm" and "entering" in meta["layer_convention"]
    assert meta["architectures"] == ["DeepseekV3ForCausalLM"]
    assert meta["model_path"] == tiny_model
    assert meta["server_flags"]["disable_radix_cache"] is True
    assert meta["server_flags"]["chunked_prefill_size"] == CHUNK
    assert meta["sglang_version"].startswith("0.5") and meta["parallel"]["tp_size"] == 1
    assert meta["stats"]["steps_failed"] == 0 and meta["stats"]["steps_dropped"] == 0


def test_files_are_self_describing_and_named_by_rank_and_layer(captured):
    (run,) = open_runs(captured["dump"])
    files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(run.path, "data")) for n in names]
    leftovers = [n for _, _, names in os.walk(run.path) for n in names if TEMP_MARK in n]
    assert files and not leftovers
    parts = {os.path.basename(f).split(".")[2] for f in files}
    assert parts == {"L02", "L03", "L05", "final", "prenorm"}
    assert all(os.path.basename(f).startswith("dp0-tp0-pp0.s") for f in files)
    with open(files[0], "rb") as f:
        header = fmt.read_header(f, os.fstat(f.fileno()).st_size)
    e = header.tensors["hidden"]
    assert e.codec == "bytegroup" and e.dtype == "float32" and e.shape[1] == 256
    assert header.metadata["rank"] == "dp0-tp0-pp0" and header.metadata["run_id"] == os.path.basename(run.path)
    for line in run.index("dp0-tp0-pp0"):  # every index line points at files that exist
        for part in (line.files or {}).values():
            assert os.path.getsize(os.path.join(run.path, part.path)) == part.bytes


def test_without_hscap_dir_the_server_is_untouched(tiny_model, tmp_path):
    would_be = tmp_path / "would-be-dump"
    env = server_env(None)
    srv = Server(tiny_model, env, str(tmp_path / "server.log"), ["--chunked-prefill-size", str(CHUNK)], warmup=False)
    try:
        srv.wait_healthy()
        out = srv.generate("plain", list(range(2, 40)))
        assert out["meta_info"]["prompt_tokens"] == 38
    finally:
        srv.stop()
    assert "HS_DUMP" not in srv.log()
    assert not would_be.exists() and os.listdir(tmp_path) == ["server.log"]


@pytest.mark.parametrize("env_extra, message", [
    ({"HSCAP_LAYERS": "1,9"}, "HSCAP_LAYERS has [9] outside 1..5 for this 6-layer model"),
    ({"HSCAP_LAYERS": "2,x"}, "HSCAP_LAYERS='2,x': 'x' is not a layer index"),
    ({"HSCAP_DIR": "/proc/hscap-cannot-exist"}, "is not writable"),
])
def test_misconfiguration_stops_the_server_at_start(tiny_model, tmp_path, env_extra, message):
    env = server_env(str(tmp_path / "dump"), **env_extra)
    srv = Server(tiny_model, env, str(tmp_path / "server.log"))
    try:
        rc = srv.wait_exit(180)
    finally:
        srv.kill()
    assert rc != 0
    errors = [line for line in srv.log().splitlines() if line.startswith("[HS_DUMP] ERROR:")]
    assert errors and message in errors[0], srv.log()[-2000:]


def test_hscap_ls_summarises_the_dump(captured):
    from click.testing import CliRunner

    from hs_capture.cli import main

    res = CliRunner().invoke(main, ["ls", "--json", captured["dump"]], catch_exceptions=False)
    assert res.exit_code == 0
    (row,) = json.loads(res.output)
    assert row["rank"] == "dp0-tp0-pp0" and row["status"] == "closed" and row["layers"] == LAYERS
    assert row["tokens"] >= sum(map(len, captured["reqs"].values())) and row["dropped"] == 0
    bad = CliRunner().invoke(main, ["ls", "/nonexistent-dump"])
    assert bad.exit_code == 2 and "does not exist" in bad.output


def test_sigterm_flushes_every_queued_step(tiny_model, tmp_path):
    """A stalled disk leaves steps queued when the orchestrator sends SIGTERM: none is lost."""
    dump = str(tmp_path / "dump")
    gate = tmp_path / "disk-stalled"
    gate.write_text("")
    env = server_env(dump, HSCAP_LAYERS="2", HSCAP_WRITER_THREADS="1", HSCAP_TEST_SLOW_DISK_MS="100",
                     HSCAP_TEST_DISK_GATE=str(gate))
    srv = Server(tiny_model, env, str(tmp_path / "server.log"), ["--chunked-prefill-size", "64"], warmup=False)
    rng = random.Random(1)
    reqs = {f"s{i}": [rng.randrange(2, 1000) for _ in range(rng.randrange(20, 200))] for i in range(8)}
    try:
        srv.wait_healthy()
        for rid, ids in reqs.items():  # one at a time: many small steps pile up in the queue
            srv.generate(rid, ids)
        (run,) = open_runs(dump)
        queued = len(reqs) - len({r for x in run.index("dp0-tp0-pp0") for r in x.rids()} & set(reqs))
        srv.proc.send_signal(15)
        time.sleep(1.0)  # the signal is taken while the disk is still stalled
        gate.unlink()
        rc = srv.wait_exit(120)
    finally:
        srv.kill()
    assert queued > 0  # the test really had pending writes at SIGTERM
    assert "[HS_DUMP] rank dp0-tp0-pp0: closed:" in srv.log() and "TIMED OUT" not in srv.log()
    samples = stitch(run)
    assert all(samples[rid].complete and samples[rid].input_ids.tolist() == ids for rid, ids in reqs.items())
    assert json.load(open(os.path.join(run.path, "ranks", "dp0-tp0-pp0.json")))["status"] == "closed"
    assert rc is not None
