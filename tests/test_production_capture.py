"""Capture from production-like traffic with SGLang's radix (prefix) cache ON: the REAL CPU
server, the plain launch command plus the hook capturing a quarter of the requests
(HSCAP_CAPTURE_FRACTION=0.25), a multi-turn chat workload whose conversations share a
system prompt, sent twice.

- Sent marked (extra_key=hscap): every request is captured, each in a cache namespace of its
  own, so every sample is whole and equal to transformers, though the cache is on.
- Sent unmarked, as production traffic: the captured set is the rid hash's choice, each
  captured sample whole; the uncaptured requests hit the cache (SGLang's own cached-token
  counts say so); a captured rid sent again is captured whole again; `hscap send` (which
  marks its requests) captures every sample it sends.
"""

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from hs_capture.dump.capture_policy import MARK, rid_fraction
from hs_capture.offline.read.planning import Captured
from hs_capture.offline.read.reader import open_runs
from tests.sglang_cpu.harness import Server, hscap_send, server_env, write_jsonl
from tests.sglang_cpu.stitch import stitch
from tests.test_e2e import LAYERS, assert_equal_to_transformers

CHUNK = 128
CONVERSATIONS, TURNS = 8, 3


def workload(seed: int = 5):
    """(rid, input_ids) per turn, conversation by conversation: turn k's prompt is the system
    prompt, then every earlier user and assistant message, then its own user message."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, 1000) for _ in range(n)]  # noqa: E731
    system = tok(96)
    convs = []
    for c in range(CONVERSATIONS):
        history, turns = list(system), []
        for t in range(TURNS):
            history += tok(rng.randrange(10, 60))  # the user's message
            turns.append((f"c{c}-t{t}", list(history)))
            history += tok(rng.randrange(10, 40))  # the assistant's answer
        convs.append(turns)
    return convs


def post(url: str, rid: str, ids, extra_key=None) -> dict:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if extra_key is not None:
        body["extra_key"] = extra_key
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def send_conversations(url: str, convs, suffix: str, extra_key=None) -> dict:
    """Each conversation's turns in order (a turn waits for the one before, as chat does),
    conversations side by side; rid -> SGLang's cached-token count for that request."""
    def one(turns):
        return {rid + suffix: post(url, rid + suffix, ids, extra_key)["meta_info"].get("cached_tokens", 0)
                for rid, ids in turns}

    cached = {}
    with ThreadPoolExecutor(4) as pool:
        for part in pool.map(one, convs):
            cached.update(part)
    return cached


QUARTER = 0.25
SENDS = ("", "/again")


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("production")
    dump = str(root / "dump")
    data = write_jsonl(root / "d.jsonl", [{"id": f"send-{i}", "input_ids": ids}
                                          for i, ids in enumerate([[5, 6, 7] * 20, [9, 8] * 70, list(range(2, 90))])])
    convs = workload()
    ids = {rid + s: t for turns in convs for rid, t in turns for s in SENDS}
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS=",".join(map(str, LAYERS)),
                                        HSCAP_CAPTURE_FRACTION=str(QUARTER)),
                 str(root / "server.log"), ["--chunked-prefill-size", str(CHUNK)], warmup=False)  # radix cache on
    try:
        srv.wait_healthy()
        marked = {**send_conversations(srv.url, convs, "/marked", MARK),
                  **send_conversations(srv.url, convs, "/marked-again", MARK)}
        cached = {**send_conversations(srv.url, convs, SENDS[0]), **send_conversations(srv.url, convs, SENDS[1])}
        picked = next(rid for rid in sorted(ids) if rid_fraction(rid) < QUARTER)
        again = post(srv.url, picked, ids[picked])  # the same rid sent again (a retry)
        send = hscap_send(data, "--url", srv.url, "-c", "2", "--failures", str(root / "f.jsonl"))
    finally:
        srv.stop()
    marked_ids = {rid + s: t for turns in convs for rid, t in turns for s in ("/marked", "/marked-again")}
    return {"dump": dump, "ids": ids, "cached": cached, "marked": marked, "marked_ids": marked_ids,
            "resent": picked, "resent_cached": again["meta_info"].get("cached_tokens", 0), "send": send,
            "log": srv.log()}


def test_marked_requests_are_each_captured_whole_and_right_though_the_cache_is_on(served, tiny_model):
    (run,) = open_runs(served["dump"])
    meta = run.ranks["dp0-tp0-pp0"]
    assert meta.extra["server_flags"]["disable_radix_cache"] is False
    assert meta.extra["capture_policy"] == {"fraction": QUARTER, "mark": "extra_key starts with 'hscap'",
                                            "radix_cache": True, "own_namespace": True}
    assert "WARNING: the radix cache is on" not in served["log"]
    cap = Captured([served["dump"]])
    samples = stitch(run, only=set(served["marked_ids"]))
    for rid, ids in served["marked_ids"].items():
        chain, reason, _ = cap.judge(rid, len(ids))
        assert chain is not None, (rid, reason)
        s = samples[rid]
        assert s.complete and s.input_ids.tolist() == ids
        assert_equal_to_transformers(s, ids, tiny_model)
    assert all(n == 0 for n in served["marked"].values())  # captured: never served from the cache


def test_of_unmarked_traffic_the_hash_picks_a_quarter_whole_and_the_rest_keep_the_cache(served):
    ids = served["ids"]
    want = {rid for rid in ids if rid_fraction(rid) < QUARTER}
    assert 0 < len(want) < len(ids)  # the workload has both kinds
    cap = Captured([served["dump"]])
    got = {rid for rid in cap.pieces if rid in ids}
    assert got == want
    for rid in want:
        chain, reason, _ = cap.judge(rid, len(ids[rid]))
        assert chain is not None, (rid, reason)
    cached = served["cached"]
    assert all(cached[rid] == 0 for rid in want)
    rest = [rid for rid in cached if rid not in want]
    # the system prompt (96 tokens) and the earlier turns came from the cache
    assert all(cached[rid] >= 64 for rid in rest if rid.endswith("/again") or not rid.endswith("-t0")), cached
    assert sum(cached[rid] for rid in rest) > 0.5 * sum(len(ids[rid]) for rid in rest)
    assert f"[HS_DUMP] capture policy: {QUARTER:g} of requests by rid hash and requests marked extra_key=hscap*; " \
           "radix cache on: each captured request gets a cache namespace of its own" in served["log"]


def test_a_captured_rid_sent_again_is_prefilled_whole_again(served):
    rid = served["resent"]
    assert served["resent_cached"] == 0
    (run,) = open_runs(served["dump"])
    starts = [s.prefix for line in run.index("dp0-tp0-pp0") if line.written for s in line.seqs
              if s.rid == rid and s.prefix == 0]
    assert len(starts) == 2  # both captures begin at position 0


def test_hscap_send_to_a_server_capturing_a_fraction_still_captures_every_sample_it_sends(served):
    rc, summary = served["send"]
    assert rc == 0 and summary["sent"] == 3
    cap = Captured([served["dump"]])
    for rid, n in (("send-0", 60), ("send-1", 140), ("send-2", 88)):
        chain, reason, _ = cap.judge(rid, n)
        assert chain is not None, (rid, reason)
