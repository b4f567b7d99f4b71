"""Capture from production-like traffic with SGLang's radix (prefix) cache ON: the REAL CPU
server, the plain launch command plus the hook, a multi-turn chat workload whose
conversations share a system prompt, sent twice by a client that marks nothing.

- Every request captured (the default policy): each captured request gets a cache namespace
  of its own, so every sample is whole and equal to transformers, though the cache is on.
- A quarter captured (HSCAP_CAPTURE_FRACTION=0.25): the captured set is the rid hash's
  choice, each captured sample whole; the uncaptured requests hit the cache (SGLang's own
  cached-token counts say so); a captured rid sent again is captured whole again; `hscap
  send` (which marks its requests) still captures every sample it sends.
"""

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from hs_capture.dump.capture_policy import rid_fraction
from hs_capture.offline.planning import Captured
from hs_capture.offline.reader import open_runs
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


def send_conversations(url: str, convs, suffix: str) -> dict:
    """Each conversation's turns in order (a turn waits for the one before, as chat does),
    conversations side by side; rid -> SGLang's cached-token count for that request."""
    def one(turns):
        return {rid + suffix: post(url, rid + suffix, ids)["meta_info"].get("cached_tokens", 0) for rid, ids in turns}

    cached = {}
    with ThreadPoolExecutor(4) as pool:
        for part in pool.map(one, convs):
            cached.update(part)
    return cached


def serve_traffic(model, root, dump, then=None, **settings):
    srv = Server(model, server_env(dump, HSCAP_LAYERS=",".join(map(str, LAYERS)), **settings),
                 str(root / "server.log"), ["--chunked-prefill-size", str(CHUNK)])  # radix cache on
    convs = workload()
    try:
        srv.wait_healthy()
        cached = {**send_conversations(srv.url, convs, ""), **send_conversations(srv.url, convs, "/again")}
        extra = then(srv) if then is not None else None
    finally:
        srv.stop()
    lengths = {rid + s: len(ids) for turns in convs for rid, ids in turns for s in ("", "/again")}
    ids = {rid + s: ids for turns in convs for rid, ids in turns for s in ("", "/again")}
    return {"dump": dump, "cached": cached, "lengths": lengths, "ids": ids, "log": srv.log(), "extra": extra}


@pytest.fixture(scope="module")
def everything(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("prod-all")
    return serve_traffic(tiny_model, root, str(root / "dump"))


QUARTER = 0.25


@pytest.fixture(scope="module")
def quarter(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("prod-quarter")
    data = write_jsonl(root / "d.jsonl", [{"id": f"send-{i}", "input_ids": ids}
                                          for i, ids in enumerate([[5, 6, 7] * 20, [9, 8] * 70, list(range(2, 90))])])

    def then(srv):
        picked = next(rid for rid in sorted(srv_lengths) if rid_fraction(rid) < QUARTER)
        again = post(srv.url, picked, srv_ids[picked])  # the same rid sent again (a retry)
        rc, summary = hscap_send(data, "--url", srv.url, "-c", "2", "--failures", str(root / "f.jsonl"))
        return {"resent": picked, "resent_cached": again["meta_info"].get("cached_tokens", 0), "send": (rc, summary)}

    convs = workload()
    srv_ids = {rid + s: ids for turns in convs for rid, ids in turns for s in ("", "/again")}
    srv_lengths = {rid: len(ids) for rid, ids in srv_ids.items()}
    return serve_traffic(tiny_model, root, str(root / "dump"), then, HSCAP_CAPTURE_FRACTION=str(QUARTER))


def test_with_every_request_captured_each_sample_is_whole_and_right_though_the_cache_is_on(everything, tiny_model):
    (run,) = open_runs(everything["dump"])
    meta = run.ranks["dp0-tp0-pp0"]
    assert meta.extra["server_flags"]["disable_radix_cache"] is False
    assert meta.extra["capture_policy"] == {"fraction": 1.0, "mark": "extra_key starts with 'hscap'",
                                            "radix_cache": True, "own_namespace": True}
    assert "[HS_DUMP] capture policy: every request; radix cache on: each captured request gets a cache " \
           "namespace of its own" in everything["log"]
    assert "WARNING: the radix cache is on" not in everything["log"]
    cap = Captured([everything["dump"]])
    samples = stitch(run)
    for rid, length in everything["lengths"].items():
        chain, reason, _ = cap.judge(rid, length)
        assert chain is not None, (rid, reason)
        s = samples[rid]
        assert s.complete and s.input_ids.tolist() == everything["ids"][rid]
        assert_equal_to_transformers(s, everything["ids"][rid], tiny_model)
    assert all(n == 0 for n in everything["cached"].values())  # captured: never served from the cache


def test_with_a_quarter_captured_the_hash_picks_them_whole_and_the_rest_keep_the_cache(quarter):
    want = {rid for rid in quarter["lengths"] if rid_fraction(rid) < QUARTER}
    assert 0 < len(want) < len(quarter["lengths"])  # the workload has both kinds
    cap = Captured([quarter["dump"]])
    got = {rid for rid in cap.pieces if not rid.startswith(("send-", "HEALTH_CHECK_"))}
    assert got == want
    for rid in want:
        chain, reason, _ = cap.judge(rid, quarter["lengths"][rid])
        assert chain is not None, (rid, reason)
    cached = quarter["cached"]
    assert all(cached[rid] == 0 for rid in want)
    rest = [rid for rid in cached if rid not in want]
    # the system prompt (96 tokens) and the earlier turns came from the cache
    assert all(cached[rid] >= 64 for rid in rest if rid.endswith("/again") or not rid.endswith("-t0")), cached
    assert sum(cached[rid] for rid in rest) > 0.5 * sum(quarter["lengths"][rid] for rid in rest)
    (run,) = open_runs(quarter["dump"])
    assert run.ranks["dp0-tp0-pp0"].extra["capture_policy"]["fraction"] == QUARTER
    assert f"[HS_DUMP] capture policy: {QUARTER:g} of requests by rid hash and requests marked extra_key=hscap*" \
        in quarter["log"]


def test_a_captured_rid_sent_again_is_prefilled_whole_again(quarter):
    rid = quarter["extra"]["resent"]
    assert quarter["extra"]["resent_cached"] == 0
    (run,) = open_runs(quarter["dump"])
    starts = [s.prefix for line in run.index("dp0-tp0-pp0") if line.written for s in line.seqs
              if s.rid == rid and s.prefix == 0]
    assert len(starts) == 2  # both captures begin at position 0


def test_hscap_send_to_a_server_capturing_a_fraction_still_captures_every_sample_it_sends(quarter):
    rc, summary = quarter["extra"]["send"]
    assert rc == 0 and summary["sent"] == 3
    cap = Captured([quarter["dump"]])
    for rid, n in (("send-0", 60), ("send-1", 140), ("send-2", 88)):
        chain, reason, _ = cap.judge(rid, n)
        assert chain is not None, (rid, reason)
