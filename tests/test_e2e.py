"""The real extraction path, end to end: bin/hscap-serve starts the REAL SGLang on the CPU
(tiny DeepSeek-V3), `hscap send` feeds a seeded dataset at concurrency 8 (batched forwards,
prompts longer than the chunked-prefill size, lengths 1..1500, shared prefixes), the dump is
stitched and compared with transformers. Then the radix cache ON and shared by captured
requests (HSCAP_CACHE_NAMESPACE=0): prefix hits are reported as incomplete samples, never
silently wrong or short (test_production_capture.py has the default: no hits)."""

import json
import os
import random
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.offline.read.planning import Captured
from hs_capture.offline.read.reader import open_runs
from tests.conftest import NUM_LAYERS
from tests.sglang_cpu.harness import LAUNCHER, Server, hf_hidden_states, hscap_send, server_env, write_jsonl
from tests.sglang_cpu.stitch import stitch

LAYERS = [1, 3, 5]
CHUNK = 256
TOL = 1e-4


def make_dataset(seed=0):
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, 1000) for _ in range(n)]  # noqa: E731
    lengths = [1, 2, 3, 50, 255, 256, 257, 511, 600, 1000, 1500, 1499] + [rng.randrange(1, 1500) for _ in range(12)]
    samples = [tok(n) for n in lengths]
    shared_a, shared_b = tok(300), tok(100)
    samples += [shared_a + tok(rng.randrange(1, 400)) for _ in range(8)]  # one long shared prefix
    samples += [shared_b + tok(rng.randrange(1, 50)) for _ in range(4)]
    return [{"id": f"s{i:03d}", "input_ids": ids, "loss_mask": [1] * len(ids)} for i, ids in enumerate(samples)]


def assert_equal_to_transformers(sample, ids, model, positions=None):
    ref = hf_hidden_states(model, ids)
    rows = slice(None) if positions is None else positions
    for layer in LAYERS:
        diff = np.abs(sample.layers[layer][rows] - ref[layer][rows]).max()
        assert diff <= TOL, (sample.rid, layer, diff)
    diff = np.abs(sample.final[rows] - ref[NUM_LAYERS][rows]).max()
    assert diff <= TOL, (sample.rid, "final", diff)


@pytest.fixture(scope="module")
def extraction(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    dump = str(root / "dump")
    rows = make_dataset()
    first, full = write_jsonl(root / "first.jsonl", rows[:12]), write_jsonl(root / "all.jsonl", rows)
    srv = Server(tiny_model, server_env(None, hook=False), str(root / "server.log"),
                 ["--chunked-prefill-size", str(CHUNK)],
                 launcher=[LAUNCHER, "-d", dump, "--layers", ",".join(map(str, LAYERS)), "--python", sys.executable, "--"])
    try:
        srv.wait_healthy()
        rc1, s1 = hscap_send(first, "--url", srv.url, "-c", "8", "--failures", str(root / "f1.jsonl"))
        rc2, s2 = hscap_send(full, "--url", srv.url, "-c", "8", "--dump-dir", dump, "--failures", str(root / "f2.jsonl"))
    finally:
        srv.stop()
    return {"dump": dump, "rows": rows, "first": (rc1, s1), "resumed": (rc2, s2), "log": srv.log()}


def test_send_then_resume_skips_what_is_captured(extraction):
    rc1, s1 = extraction["first"]
    rc2, s2 = extraction["resumed"]
    assert rc1 == 0 and s1["sent"] == 12 and s1["failed"] == 0
    assert rc2 == 0 and s2["skipped_already_captured"] == 12 and s2["sent"] == len(extraction["rows"]) - 12
    assert s2["tokens"] == sum(len(r["input_ids"]) for r in extraction["rows"][12:])


def test_launcher_added_the_capture_flags(extraction):
    (run,) = open_runs(extraction["dump"])
    flags = run.ranks["dp0-tp0-pp0"].extra["server_flags"]
    assert flags["disable_radix_cache"] is True and flags["chunked_prefill_size"] == CHUNK
    assert "radix cache is on" not in extraction["log"]


def test_a_layer_set_sglang_cannot_serve_is_said_at_capture_and_at_merge(extraction, tmp_path):
    """1,3,5 on DeepSeek: SGLang >= 0.5.13 adds 1 to a drafter's ids only when the first is 1, so
    [0, 2, 4] is served as 0,2,4 and [1, 3, 5] as 2,4,6: no drafter trained on it is served right."""
    assert ("[HS_DUMP] WARNING: sglang >=0.5.13 (deepseek) cannot serve an EAGLE-3 drafter on the captured "
            "layers [1, 3, 5]") in extraction["log"]
    out = str(tmp_path / "mo")
    res = CliRunner().invoke(main, ["merge", extraction["dump"], "-o", out, "--format", "modelopt", "--json"],
                             catch_exceptions=False)
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert res.exit_code == 0 and doc["written"] == len(extraction["rows"])  # the data itself is right
    assert doc["settings"]["eagle_aux_hidden_state_layer_ids"] is None
    assert any("first layer other than 1, e.g. 2" in w for w in doc["warnings"]), doc["warnings"]
    saved = json.load(open(os.path.join(out, "trainer_settings.json")))
    assert saved["served_by"]["other_releases"] == {"<0.5.13": [0, 2, 4]} and saved["warnings"] == doc["warnings"]


def test_forwards_were_batched_and_chunked(extraction):
    (run,) = open_runs(extraction["dump"])
    lines = [x.to_json() for x in run.index("dp0-tp0-pp0") if x.written]
    assert max(len(x["seqs"]) for x in lines) >= 3  # several requests in one forward
    assert max(x["num_tokens"] for x in lines) <= CHUNK
    long_rids = {r["id"] for r in extraction["rows"] if len(r["input_ids"]) > CHUNK}
    chunks = {}
    for x in lines:
        for s in x["seqs"]:
            chunks[s["rid"]] = chunks.get(s["rid"], 0) + 1
    assert long_rids and all(chunks[rid] >= 2 for rid in long_rids)


def test_every_sample_equals_transformers_once_stitched(extraction, tiny_model):
    (run,) = open_runs(extraction["dump"])
    samples = stitch(run)
    for row in extraction["rows"]:
        s = samples[row["id"]]
        assert s.complete and s.input_ids.tolist() == row["input_ids"], row["id"]
        assert_equal_to_transformers(s, row["input_ids"], tiny_model)


def test_radix_cache_hits_are_reported_incomplete_never_wrong(tiny_model, tmp_path):
    dump = str(tmp_path / "dump")
    rows = make_dataset()[-12:]  # the prefix-sharing samples
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS=",".join(map(str, LAYERS)), HSCAP_CACHE_NAMESPACE="0"),
                 str(tmp_path / "server.log"), ["--chunked-prefill-size", str(CHUNK)],
                 warmup=False)  # the plain command: radix cache on
    try:
        srv.wait_healthy()
        for donor in (rows[0], rows[8]):  # cache each shared prefix first
            srv.generate(donor["id"], donor["input_ids"])
        # the writer indexes a step after the response (off the critical path): send skips
        # what is indexed when it starts, so wait for both donors (a CI run once raced it)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                Captured([dump], allow_empty=True).judge(d["id"], len(d["input_ids"]))[0] for d in (rows[0], rows[8])):
            time.sleep(0.2)
        rc, summary = hscap_send(write_jsonl(tmp_path / "d.jsonl", rows), "--url", srv.url, "-c", "8",
                                 "--dump-dir", dump, "--failures", str(tmp_path / "f.jsonl"))
    finally:
        srv.stop()
    assert rc == 0 and summary["skipped_already_captured"] == 2
    assert "[HS_DUMP] WARNING: the radix cache is on and captured requests share it" in srv.log()
    cap = Captured([dump])
    judged = {r["id"]: cap.judge(r["id"], len(r["input_ids"])) for r in rows}
    incomplete = [rid for rid, (chain, _, _) in judged.items() if chain is None]
    assert len(incomplete) >= 8  # every request after its donor hit the cache
    (run,) = open_runs(dump)
    samples = stitch(run)
    for r in rows:
        s = samples[r["id"]]
        chain, reason, _ = judged[r["id"]]
        assert s.complete == (chain is not None)
        if chain is None:  # a hit: a hole from position 0, and what was captured is still right
            assert reason.startswith("positions 0..") and "prefix-cache" in reason
            first = int(reason.split("..")[1].split()[0])
            assert not s.covered[: first + 1].any()
            assert_equal_to_transformers(s, r["input_ids"], tiny_model, positions=s.covered)
        else:
            assert_equal_to_transformers(s, r["input_ids"], tiny_model)
