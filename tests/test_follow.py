"""The live follower's completeness rule (hs_capture/offline/follow.py) on index lines written
by hand through the dump's own records: lines appended out of step order (several writer
threads), a line still being appended, a dropped step, a sample re-sent in a later run, a run
that closes. No tensor is read: the follower judges from the index alone."""

import json
import os

from hs_capture.dump.paths import FINAL, index_path, rank_meta_path, step_parts
from hs_capture.dump.schema import FileRef, RankMeta, SeqEntry, step_line
from hs_capture.offline.follow import Follower
from hs_capture.offline.planning import Captured

TAG = "dp0-tp0-pp0"
LAYERS = [1, 2]


class Run:
    def __init__(self, dump, name):
        self.dir = os.path.join(dump, name)
        os.makedirs(os.path.dirname(rank_meta_path(self.dir, TAG)), exist_ok=True)
        os.makedirs(os.path.dirname(index_path(self.dir, TAG)), exist_ok=True)
        self.meta("running")

    def meta(self, status):
        meta = RankMeta(layers=LAYERS, hidden_size=8, num_layers=4, run_id=os.path.basename(self.dir), status=status)
        with open(rank_meta_path(self.dir, TAG), "w") as f:
            json.dump(meta.to_json(), f)

    def line(self, step, seqs, dropped=False, torn=False):
        """seqs: (rid, prefix, len) in row order."""
        entries, at = [], 0
        for rid, prefix, n in seqs:
            entries.append(SeqEntry(rid, n, prefix, at))
            at += n
        line = step_line("EXTEND", at, at, "bfloat16", entries)
        line = line.dropped_as(step, "writer_full", 0.0) if dropped else line.committed(
            step, {p: FileRef(f"data/{step}.{p}.hst", 1) for p in step_parts(LAYERS, False)}, 0.0)
        text = json.dumps(line.to_json()) + "\n"
        with open(index_path(self.dir, TAG), "a") as f:
            f.write(text[:len(text) // 2] if torn else text)
        return text[len(text) // 2:]


def names(wholes):
    return [w.rid for w in wholes]


def test_without_a_dataset_a_request_is_whole_once_the_next_step_does_not_continue_it(tmp_path):
    dump = str(tmp_path / "dump")
    f = Follower([dump])
    assert f.poll() == [] and not f.close_check()  # the dump dir is not there yet
    run = Run(dump, "run-1")
    run.line(0, [("a", 0, 5), ("b", 0, 3)])  # b continues in step 1
    assert names(f.poll()) == []  # step 1 not seen: neither is known to be over
    # step 2 is committed before step 1 (another writer thread was faster)
    run.line(2, [("c", 0, 4)])
    assert names(f.poll()) == []
    rest = run.line(1, [("b", 3, 2), ("c2", 0, 1)], torn=True)  # half a line: not committed yet
    assert names(f.poll()) == []
    with open(index_path(run.dir, TAG), "a") as fh:
        fh.write(rest)
    got = f.poll()
    assert names(got) == ["a", "b", "c2"]  # step 1 ends a; step 2 (seen) does not continue b or c2
    assert [(p.step, p.prefix, p.length) for p in got[1].pieces] == [(0, 0, 3), (1, 3, 2)]
    run.line(3, [("d", 0, 2)])
    assert names(f.poll()) == ["c"]
    run.meta("closed")
    assert f.close_check()
    assert names(f.poll()) == ["d"]  # the close ends the last one
    assert f.poll() == []  # each once


def test_a_dropped_step_keeps_its_requests_out_and_the_dataset_lengths_decide(tmp_path):
    dump = str(tmp_path / "dump")
    run = Run(dump, "run-1")
    run.line(0, [("a", 0, 4), ("b", 0, 2)])
    run.line(1, [("a", 4, 4)], dropped=True)  # a's end was lost
    run.line(2, [("b2", 0, 2)])
    run.meta("closed")
    no_dataset = Follower([dump])
    no_dataset.close_check()
    assert names(no_dataset.poll()) == ["b", "b2"]
    assert "dropped" in no_dataset.pending["a"]
    # merge without a dataset judges it the same way now
    assert Captured([dump]).judge("a")[0] is None
    with_lengths = Follower([dump], {"a": 8, "b": 2})
    assert names(with_lengths.poll()) == ["b"]  # b2 is not the dataset's; a has a hole


def test_a_resend_in_a_later_run_makes_a_request_whole_once_and_skip_leaves_out_what_was_handed_out(tmp_path):
    dump = str(tmp_path / "dump")
    first = Run(dump, "run-1")
    first.line(0, [("a", 0, 3)])  # a needs 6 tokens: the first run was stopped
    first.meta("closed")
    f = Follower([dump], {"a": 6, "b": 1})
    assert names(f.poll()) == []
    second = Run(dump, "run-2")
    second.line(0, [("a", 0, 6), ("b", 0, 1)])
    got = f.poll()
    assert names(got) == ["a", "b"] and got[0].pieces[0].run == 1
    second.line(1, [("a", 0, 6)])  # sent again: not handed out twice
    assert f.poll() == []
    again = Follower([dump], {"a": 6, "b": 1}, skip=["a"])  # a restarted reader's state
    assert names(again.poll()) == ["b"]


def test_sglangs_warmup_and_health_checks_are_no_ones_samples(tmp_path):
    dump = str(tmp_path / "dump")
    run = Run(dump, "run-1")
    run.line(0, [("0123456789abcdef0123456789abcdef", 0, 3)])  # the startup warmup: a generated id, step 0
    run.line(1, [("HEALTH_CHECK_1", 0, 1), ("x", 0, 2)])
    run.meta("closed")
    f = Follower([dump])
    f.close_check()
    assert names(f.poll()) == ["x"]
    assert FINAL in step_parts(LAYERS, False)


def test_the_follower_keeps_no_step_and_no_piece_it_no_longer_needs(tmp_path):
    """Without a dataset it reads a request's end off the next step: it keeps that step and the
    pieces of requests still pending, not every step of the run, nor the pieces of a request a
    dropped step broke (it is never whole here)."""
    dump = str(tmp_path / "dump")
    run = Run(dump, "run-1")
    f = Follower([dump])
    seen, held = 0, []
    for step in range(0, 3000, 3):
        run.line(step, [(f"r{step}", 0, 4), (f"long{step}", 0, 2)])  # long continues in the next step
        run.line(step + 1, [(f"long{step}", 2, 2), (f"x{step}", 0, 1)], dropped=step % 30 == 0)
        run.line(step + 2, [(f"y{step}", 0, 3)])
        if step % 300 == 0:
            seen += len(f.poll())
            held.append((sum(len(st.steps) for st in f._ranks.values()), len(f._pieces)))
    run.meta("closed")  # the last request is over once its run has closed
    assert f.close_check()
    seen += len(f.poll())
    assert seen == 1000 * 4 - 100 * 2  # every request whole but the two a dropped step held
    assert max(h for h, _ in held) <= 2 and max(p for _, p in held) <= 3, held
