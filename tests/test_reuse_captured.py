"""Captured requests that keep the radix cache (HSCAP_REUSE_CAPTURED=1, HSCAP_FOLLOW=1): the
REAL CPU server with its prefix cache ON, multi-turn conversations sharing a system prompt.

- Marked requests (every one captured): each reuses what earlier captured requests computed
  (SGLang's own cached-token counts say so) and records whose capture holds that prefix;
  merge's reader joins them, and every sample is whole and equal to transformers.
- Unmarked traffic at a quarter by rid hash: the captured set is the hash's choice plus every
  request that continues a captured prompt (the later turns of a captured conversation),
  each whole; the others keep the cache as before.
- The gate: a joined prefix whose token ids are not the ones the server matched is refused by
  verify and left out by merge's reader.
"""

import json
import os
import shutil
import types

import pytest

from hs_capture.dump.capture_policy import MARK, rid_fraction
from hs_capture.offline.read.assemble import Assembler, TokensDiffer
from hs_capture.offline.read.planning import plan
from hs_capture.offline.read.reader import open_runs
from hs_capture.offline.verify import verify
from tests.sglang_cpu.harness import REPO, Server, server_env, write_jsonl
from tests.test_e2e import LAYERS, assert_equal_to_transformers
from tests.test_production_capture import CHUNK, send_conversations, workload

QUARTER = 0.25
SENDS = ("", "/again")


def captured_by_rule(convs, picked) -> set:
    """What the policy should capture of traffic sent conversation by conversation, the sends
    one after the other (repeating the same prompts): the hash's choice, and every turn whose
    prompt continues a captured one (a later turn than one captured, in this send or before)."""
    out = set()
    for turns in convs:
        first = None  # the earliest turn of this conversation captured so far
        for send in SENDS:
            for t, (rid, _) in enumerate(turns):
                if picked(rid + send) or (first is not None and first < t):
                    out.add(rid + send)
                    first = t if first is None else min(first, t)
    return out


@pytest.fixture(scope="module", params=["0.5.23", "0.5.15"])
def served(request, tiny_model, tmp_path_factory):
    """The suite's release, and 0.5.15 (where the cap is first there) where its venv was made."""
    python = None
    if request.param != "0.5.23":
        python = os.path.join(REPO, ".venvs", f"sglang-{request.param}", "bin", "python")
        if not os.path.exists(python):
            pytest.skip(f"no venv for sglang {request.param}: bash bin/setup_sglang_venv.sh {request.param}")
    root = tmp_path_factory.mktemp("reuse")
    dump = str(root / "dump")
    marked_convs, convs = workload(7), workload(5)
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS=",".join(map(str, LAYERS)),
                                        HSCAP_CAPTURE_FRACTION=str(QUARTER), HSCAP_REUSE_CAPTURED="1",
                                        HSCAP_FOLLOW="1"),
                 str(root / "server.log"), ["--chunked-prefill-size", str(CHUNK)], warmup=False,
                 python=python)  # radix cache on
    try:
        srv.wait_healthy()
        marked = {**send_conversations(srv.url, marked_convs, "/m", MARK),
                  **send_conversations(srv.url, marked_convs, "/m-again", MARK)}
        cached = {**send_conversations(srv.url, convs, SENDS[0]), **send_conversations(srv.url, convs, SENDS[1])}
    finally:
        srv.stop()
    ids = {rid + s: t for turns in convs for rid, t in turns for s in SENDS}
    marked_ids = {rid + s: t for turns in marked_convs for rid, t in turns for s in ("/m", "/m-again")}
    return {"release": request.param, "root": root, "dump": dump, "convs": convs, "ids": ids, "cached": cached, "marked": marked,
            "marked_ids": marked_ids, "log": srv.log()}


def as_arrays(s):
    return types.SimpleNamespace(rid=s.rid, layers={k: v.float().numpy() for k, v in s.layers.items()},
                                 final=s.final.float().numpy())


def test_marked_requests_reuse_captured_prefixes_and_are_joined_whole_and_right(served, tiny_model):
    (run,) = open_runs(served["dump"])
    assert run.ranks["dp0-tp0-pp0"].sglang_version == served["release"]
    policy = run.ranks["dp0-tp0-pp0"].extra["capture_policy"]
    assert policy["reuse_captured"] is True and policy["follow"] is True and policy["own_namespace"] is False
    assert "radix cache on: captured requests reuse only prefixes that captured requests computed" in served["log"]
    ids = served["marked_ids"]
    p = plan([served["dump"]], {rid: len(t) for rid, t in ids.items()})
    assert not p.incomplete, p.incomplete
    # every turn after the first, and every prompt sent again, came from the cache in part,
    # and its sample joins that part from another capture
    reused = [rid for rid in ids if not rid.endswith(("-t0/m",))]
    assert all(served["marked"][rid] >= 32 for rid in reused), served["marked"]
    assert all(rid in p.borrows for rid in reused)
    computed = sum(s.len for line in run.index("dp0-tp0-pp0") for s in line.seqs if s.rid in ids)
    assert computed < 0.6 * sum(map(len, ids.values()))  # most of the prompts were not prefilled again
    asm = Assembler(p)
    for rid, want in ids.items():
        s = asm.sample(rid)
        assert s.input_ids.tolist() == want
        assert_equal_to_transformers(as_arrays(s), want, tiny_model)


def test_the_scheduler_time_of_request_bookkeeping_is_reported(served):
    (run,) = open_runs(served["dump"])
    cost = run.ranks["dp0-tp0-pp0"].stats["scheduler_cost"]
    assert cost["requests"] >= len(served["ids"]) + len(served["marked_ids"])
    assert min(cost["pick_s"], cost["cap_s"], cost["match_s"], cost["batch_s"]) > 0
    line = next(x for x in served["log"].splitlines() if "[HS_DUMP]" in x and "closed:" in x)
    assert f"capture's request bookkeeping over {cost['requests']} requests (picking new requests {cost['pick_s']:.3f} s" in line


def test_unmarked_traffic_captures_the_hash_choice_and_the_turns_that_follow_it(served):
    ids = served["ids"]
    want = captured_by_rule(served["convs"], lambda rid: rid_fraction(rid) < QUARTER)
    assert 0 < len(want) < len(ids)
    assert want != {rid for rid in ids if rid_fraction(rid) < QUARTER}  # following added some
    p = plan([served["dump"]])
    got = {rid for rid in p.samples if rid in ids} | {rid for rid in p.incomplete if rid in ids}
    assert got == want
    p = plan([served["dump"]], {rid: len(ids[rid]) for rid in want})
    assert not p.incomplete, p.incomplete
    asm = Assembler(p)
    assert all(asm.sample(rid).input_ids.tolist() == ids[rid] for rid in want)
    rest = [rid for rid in ids if rid not in want]
    cached = served["cached"]
    assert sum(cached[rid] for rid in rest) > 0.5 * sum(len(ids[rid]) for rid in rest)


def edited_copy(served, tmp_path, edit):
    """A copy of the served dump whose index lines `edit(lines)` changed in place; (its dir,
    what edit returned)."""
    dump = str(tmp_path / "dump")
    shutil.copytree(served["dump"], dump)
    (run,) = open_runs(dump)
    index = os.path.join(run.path, "index", "dp0-tp0-pp0.jsonl")
    lines = [json.loads(x) for x in open(index)]
    got = edit(lines)
    with open(index, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    return dump, got


def first_joined(lines) -> dict:
    return next(s for line in lines for s in line.get("seqs", []) if s.get("src") and s["rid"].endswith("/m"))


def test_a_joined_prefix_with_other_token_ids_is_refused(served, tmp_path):
    def tamper(lines):
        seq = first_joined(lines)
        seq["src_hash"] = "0" * 32
        return seq["rid"]

    dump, victim = edited_copy(served, tmp_path, tamper)
    ids = served["marked_ids"]
    p = plan([dump], {rid: len(t) for rid, t in ids.items()})
    with pytest.raises(TokensDiffer, match="joined from request"):
        Assembler(p).sample(victim)
    report = verify([dump], dataset=ids, jobs=1)
    assert any(f.rid == victim and "joined from request" in f.message for f in report.findings), report.findings
    assert report.stats["samples_incomplete"] >= 1


def test_a_sample_whose_prefix_source_is_not_whole_is_incomplete_and_says_why(served, tmp_path):
    def lose_source(lines):
        src = first_joined(lines)["src"]
        for line in lines:
            line["seqs"] = [s for s in line.get("seqs", []) if s["rid"] != src]
        return src

    dump, src = edited_copy(served, tmp_path, lose_source)
    ids = served["marked_ids"]
    p = plan([dump], {rid: len(t) for rid, t in ids.items()})
    hit = {rid: why for rid, why in p.incomplete.items() if rid != src}
    # those that borrowed from it, and those that borrowed from them in turn
    assert hit and all("are borrowed from request" in why for why in hit.values())
    assert any(f"borrowed from request {src!r}" in why for why in hit.values())
    assert src in p.incomplete


def test_the_live_reader_joins_borrowed_prefixes_as_merge_does(served, tmp_path):
    """The live DumpDataset (as the README's recipe makes it) hands out every marked sample,
    each joined from the captures it borrowed from, equal to merge's; a joined prefix whose
    token ids are not the ones the server matched is left out, saying so."""
    import torch

    from hs_capture import DumpDataset

    ids = served["marked_ids"]
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": rid, "input_ids": t} for rid, t in ids.items()])
    asm = Assembler(plan([served["dump"]], {rid: len(t) for rid, t in ids.items()}))
    want = {}
    for rid, t in ids.items():  # both sends of a prompt: the same tokens
        want.setdefault(tuple(t), []).append(asm.sample(rid))
    ds = DumpDataset(served["dump"], data, keys="hscap", follow=True)
    got = list(ds)
    assert not ds.skipped, ds.skipped
    assert sorted(tuple(x["input_ids"].tolist()) for x in got) == sorted(tuple(t) for t in ids.values())
    for x in got:
        assert any(torch.equal(x["hidden_state"], s.final) and torch.equal(x["aux_hidden_state"], torch.cat(
            [s.layers[k] for k in sorted(s.layers)], dim=-1)) for s in want[tuple(x["input_ids"].tolist())])

    def tamper(lines):
        seq = first_joined(lines)
        seq["src_hash"] = "0" * 32
        return seq["rid"]

    dump, victim = edited_copy(served, tmp_path, tamper)
    ds = DumpDataset(dump, data, keys="hscap", follow=True)
    assert len(list(ds)) < len(ids)
    assert victim in ds.skipped and "joined from request" in ds.skipped[victim]


def test_a_conversation_of_1500_turns_each_borrowing_from_the_last_is_planned(tmp_path):
    """Index lines only (the planner reads no tensor): turn t borrows all of turn t-1's prompt;
    the planner joins each from the one before without recursing turn by turn, whatever order
    the dataset lists them in."""
    run = tmp_path / "dump" / "run-20260101T000000Z-h-1"
    for d in ("ranks", "index", "data"):
        (run / d).mkdir(parents=True)
    (run / "ranks" / "dp0-tp0-pp0.json").write_text(json.dumps(
        {"layers": [], "hidden_size": 8, "run_id": run.name, "status": "closed", "schema": 1}))
    turns, first, more = 1500, 100, 10  # beyond Python's recursion limit (1000)
    lines = []
    for t in range(turns):
        f = run / "data" / f"s{t}.hst"
        f.write_bytes(b"x" * 16)
        seq = {"rid": f"t{t}", "len": first if t == 0 else more, "prefix": 0 if t == 0 else first + more * (t - 1),
               "offset": 0}
        if t:
            seq.update(src=f"t{t - 1}", src_hash="0" * 32)
        lines.append({"step": t, "mode": "EXTEND", "num_tokens": seq["len"], "rows": seq["len"], "dtype": "bfloat16",
                      "seqs": [seq], "files": {"final": {"path": f"data/s{t}.hst", "bytes": 16}}})
    (run / "index" / "dp0-tp0-pp0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    lengths = {f"t{t}": first + more * t for t in reversed(range(turns))}  # the last turn judged first
    p = plan([str(tmp_path / "dump")], lengths)
    assert not p.incomplete
    last = p.samples[f"t{turns - 1}"]
    assert len(last) == turns and sum(pc.length for pc in last) == lengths[f"t{turns - 1}"]
    assert [pc.step for pc in last] == list(range(turns))
    assert len(p.borrows[f"t{turns - 1}"]) == turns - 1  # every join on the way is checked
