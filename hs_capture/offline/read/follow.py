"""Follow a dump while a server writes it: read each rank's index as it grows and say which
requests have just become whole (index lines only: no tensor is read, no torch imported).
The dump dataset's live mode (dump_dataset.FollowingDumpDataset) decodes what this names.

When is a request whole while the run is still being written?
  - with the dataset's lengths: when a chain of one capture's pieces covers [0, length)
    (coverage.whole_chain, the one completeness rule merge and verify judge by);
  - without: when the rank has committed the step after the request's last piece and that step
    does not continue it (SGLang runs a chunked request's next chunk in the very next prefill
    forward, and only prefill forwards are steps), or when the run has closed.
A capture is one request's pieces on one rank of one run. It ends by the same rule, and one
that ended short of whole (a dropped step held part of it, a prefix-cache hit, a server
stopped mid-request) is let go: a later capture can still make the request whole, on its own
(merge may also join pieces of both; a live reader keeps only what is still being written).

A capture whose first positions came from the radix cache (HSCAP_REUSE_CAPTURED) names the
request whose capture holds them; that request was captured by the same scheduler, so its
pieces are on the same rank, earlier. The prefix is joined (planning.joined_prefix, as merge
does) from the source's open capture where that is whole as far as it lent, else from the
source's whole: such a rank keeps its latest SOURCES_KEPT. A capture whose source is still open,
or whose source's lines may still come (LATE_STEPS), is judged again when its source gets a
piece, and is let go with its source.

Without a dataset, a request a dropped step touched is never whole here (merge would keep its
captured prefix; a live reader must never hand out part of a sample). Each request is named
once: the first time it is whole.

Memory is bounded by the requests in flight, not by the run: the pieces of open captures, a
few runs of step numbers per rank, and what settles a request for good (with a dataset, its
entry leaves the follower's copy of the lengths; without one, a 16-byte digest a request,
so that a request captured again is still named once).

Each whole has a position: (run, rank, the line of that rank's index it became whole at).
Positions grow in the order a rank's lines are read, so a reader that settles wholes in the
order they come keeps its whole record (Progress) as one line a rank plus the ids settled at
it; a follower started from it reads every rank up to there first and names only the rest.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Set, Tuple

import numpy as np

from hs_capture.dump.paths import index_path, rank_meta_path, rank_tags, run_dirs, step_parts
from hs_capture.dump.schema import IndexLine, RankMeta, SchemaError
from hs_capture.offline.read.attribution import generated_by_sglang
from hs_capture.offline.read.coverage import Judgement, Span, whole_chain
from hs_capture.offline.read.planning import Borrow, Piece, joined_prefix, unjoined
from hs_capture.offline.read.reader import DumpError, Run

RankKey = Tuple[int, str]  # (index into Follower.runs, rank tag)
Position = Tuple[str, str, int]  # (run id, rank tag, line of its index; the close is one past the last)
GIVEN_UP_KEPT = 1024  # the most recent captures let go, kept to say why (Follower.pending)
# wholes a rank keeps to join the prefixes later captures borrow from them: a source is lent
# by the server for as long as its prefix stays in its index, most often to the next few turns
SOURCES_KEPT = 1 << 14
# a source's pieces come in steps before the first piece of what borrows from it; a line may be
# read up to this many steps late (writer threads commit out of step order)
LATE_STEPS = 256


@dataclass(frozen=True)
class Whole:
    """A request that has just become whole: its pieces in position order, and where."""

    rid: str
    pieces: List[Piece]
    at: Position = ("", "", 0)
    borrows: List[Borrow] = field(default_factory=list)  # what its joined prefixes require of its tokens

    @property
    def end(self) -> Tuple[int, str, int]:
        """The step that ends it: (run, rank, step)."""
        p = self.pieces[-1]
        return p.run, p.rank, p.step


class Progress:
    """The wholes a reader has settled (handed out, or left to another reader): for each (run,
    rank), the line of the last one and the ids settled at that line. A follower names a rank's
    wholes in line order and the reader settles them in the order they come, so this is the
    whole record: a watermark a rank plus the few ids of one line, however long the run."""

    def __init__(self, last: Optional[Mapping[Tuple[str, str], Tuple[int, Iterable[str]]]] = None) -> None:
        self.last: Dict[Tuple[str, str], Tuple[int, Set[str]]] = {
            k: (line, set(rids)) for k, (line, rids) in (last or {}).items()}

    def settle(self, w: Whole) -> None:
        run, rank, line = w.at
        have = self.last.get((run, rank))
        if have is None or line > have[0]:
            self.last[(run, rank)] = (line, {w.rid})
        elif line == have[0]:
            have[1].add(w.rid)

    def covers(self, w: Whole) -> bool:
        """Settled before: an earlier line of its rank, or an id settled at any rank's last line
        (a request whole on two ranks is settled once, at whichever came first)."""
        run, rank, line = w.at
        have = self.last.get((run, rank))
        return (have is not None and line < have[0]) or any(w.rid in rids for _, rids in self.last.values())

    def to_json(self) -> Dict[str, Dict[str, List[Any]]]:
        out: Dict[str, Dict[str, List[Any]]] = {}
        for (run, rank), (line, rids) in sorted(self.last.items()):
            out.setdefault(run, {})[rank] = [line, sorted(rids)]
        return out

    @classmethod
    def from_json(cls, d: Any) -> "Progress":
        """ValueError: not what to_json wrote."""
        try:
            return cls({(run, rank): (int(line), [str(r) for r in rids])
                        for run, ranks in d.items() for rank, (line, rids) in ranks.items()})
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"not a follower's progress ({e})") from None


class _Settled:
    """Request ids settled for good, without a dataset: 16-byte digests (blake2b; two ids share
    one with odds of 2^-128 a pair), kept sorted in one array with the newest in a small set:
    ~16 bytes a request, against ~100 for a set of the ids."""

    BATCH = 4096

    def __init__(self) -> None:
        self._old = np.empty(0, dtype="S16")
        self._new: Set[bytes] = set()

    @staticmethod
    def _key(rid: str) -> bytes:
        return hashlib.blake2b(rid.encode(), digest_size=16).digest()

    def add(self, rid: str) -> None:
        self._new.add(self._key(rid))
        if len(self._new) >= self.BATCH:
            self._old = np.union1d(self._old, np.array(sorted(self._new), dtype="S16"))
            self._new.clear()

    def __contains__(self, rid: str) -> bool:
        k = self._key(rid)
        if k in self._new:
            return True
        i = int(np.searchsorted(self._old, k))
        return i < len(self._old) and self._old[i:i + 1].tobytes() == k  # bytes: numpy drops trailing NULs

    def __len__(self) -> int:
        return len(self._old) + len(self._new)


class _Steps:
    """The step numbers a rank has indexed, as sorted [start, end) runs: a few however long the
    run (lines come nearly in step order; a step whose write failed leaves one gap)."""

    def __init__(self) -> None:
        self.runs: List[List[int]] = []

    def add(self, step: int) -> None:
        i = bisect.bisect_right(self.runs, step, key=lambda r: r[0]) - 1
        if i >= 0 and step < self.runs[i][1]:
            return
        after = i + 1 < len(self.runs) and self.runs[i + 1][0] == step + 1
        if i >= 0 and self.runs[i][1] == step:
            self.runs[i][1] = step + 1
            if after:
                self.runs[i][1] = self.runs.pop(i + 1)[1]
        elif after:
            self.runs[i + 1][0] = step
        else:
            self.runs.insert(i + 1, [step, step + 1])

    def __contains__(self, step: int) -> bool:
        return self.spans(step, step)

    def spans(self, first: int, last: int) -> bool:
        """Every step of first..last indexed."""
        i = bisect.bisect_right(self.runs, first, key=lambda r: r[0]) - 1
        return i >= 0 and last < self.runs[i][1]


@dataclass
class _Capture:
    pieces: Dict[int, Piece] = field(default_factory=dict)  # step -> the request's piece there
    last: int = -1  # its latest step


@dataclass
class _Rank:
    run_id: str
    tag: str
    offset: int = 0  # bytes of index.jsonl consumed (whole lines only)
    lines: int = 0  # lines consumed
    steps: _Steps = field(default_factory=_Steps)
    captures: Dict[str, _Capture] = field(default_factory=dict)  # rid -> its open capture here
    by_last: Dict[int, Set[str]] = field(default_factory=dict)  # step -> rids whose capture's latest piece is there
    short: Set[str] = field(default_factory=set)  # rids whose capture is over and not whole
    lends: bool = False  # its captured requests borrow prefixes from earlier captures (HSCAP_REUSE_CAPTURED)
    closed: bool = False  # its metadata says the run is over
    over: bool = False  # ... and what the close ends has been judged
    # rid -> (pieces, joins) of its latest SOURCES_KEPT wholes here: what later captures borrow from
    wholes: "OrderedDict[str, Tuple[List[Piece], List[Borrow]]]" = field(default_factory=OrderedDict)
    waiting: Dict[str, Set[str]] = field(default_factory=dict)  # source rid (not whole here yet) -> captures borrowing from it

    def add(self, rid: str, piece: Piece) -> None:
        cap = self.captures.setdefault(rid, _Capture())
        cap.pieces.setdefault(piece.step, piece)
        if piece.step > cap.last:
            self._unlist(rid, cap.last)
            cap.last = piece.step
            self.by_last.setdefault(piece.step, set()).add(rid)

    def drop(self, rid: str) -> None:
        cap = self.captures.pop(rid, None)
        if cap is not None:
            self._unlist(rid, cap.last)

    def _unlist(self, rid: str, step: int) -> None:
        rids = self.by_last.get(step)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self.by_last[step]


def _borrows(cap: _Capture) -> bool:
    return any(p.lender is not None for p in cap.pieces.values())


def _source_may_come(st: _Rank, cap: _Capture) -> bool:
    """Some step within LATE_STEPS before the capture's first piece is not read yet, and none
    LATE_STEPS after it is (a step whose write failed is never read): the lines of a source it
    borrowed from may still come."""
    first = min(cap.pieces)
    lo = max(first - LATE_STEPS, 0)  # a rank's steps count from 0
    if st.steps.runs and st.steps.runs[-1][1] > first + LATE_STEPS:
        return False
    return lo < first and not st.steps.spans(lo, first - 1)


class Follower:
    """The live view of one or more dump dirs (which need not exist yet)."""

    def __init__(self, dump_dirs: Iterable[str], lengths: Optional[Mapping[str, int]] = None,
                 progress: Optional[Progress] = None, exclude_prefix: str = "HEALTH_CHECK_") -> None:
        """lengths: the dataset's (only its ids count); progress: what a reader already settled
        (those wholes are not named again; the reader may go on settling into it)."""
        self.dump_dirs = list(dump_dirs)
        self.exclude_prefix = exclude_prefix
        self.progress = progress
        self.runs: List[Run] = []
        self.layers: List[int] = []
        self.hidden_size = 0
        self.prenorm = False
        self._ranks: Dict[RankKey, _Rank] = {}
        self._todo: Optional[Dict[str, int]] = dict(lengths) if lengths is not None else None
        self._settled: Optional[_Settled] = _Settled() if lengths is None else None
        self._given_up: "OrderedDict[str, str]" = OrderedDict()
        # what the reader had settled before: every rank is first read up to its last line
        # there, then those lines, then on: a request whole on two ranks is settled as it was
        self._replay: Dict[Tuple[str, str], int] = {k: line for k, (line, _) in
                                                    (progress.last if progress else {}).items()}

    # ------------------------------------------------------------ discovery
    def _discover(self) -> None:
        known = {os.path.realpath(r.path) for r in self.runs}
        for d in self.dump_dirs:
            for path in run_dirs(d) if os.path.isdir(d) else []:
                if os.path.realpath(path) in known:
                    continue
                self.runs.append(Run(path, {}))
                known.add(os.path.realpath(path))
        followed = {(st.run_id, st.tag) for st in self._ranks.values()}
        for i, run in enumerate(self.runs):
            run_id = os.path.basename(run.path)
            for tag in rank_tags(run.path):
                if tag not in run.ranks and (run_id, tag) not in followed:  # a copy of a rank already followed: skipped
                    meta = self._meta(run, tag)
                    if meta is not None:
                        self._admit(meta)
                        run.ranks[tag] = meta
                        policy = meta.extra.get("capture_policy") if isinstance(meta.extra, dict) else None
                        lends = isinstance(policy, dict) and policy.get("reuse_captured") is True
                        self._ranks[(i, tag)] = _Rank(run_id, tag, lends=lends)
                        followed.add((run_id, tag))

    def _meta(self, run: Run, tag: str) -> Optional[RankMeta]:
        path = rank_meta_path(run.path, tag)
        try:
            with open(path, "rb") as f:
                return RankMeta.from_json(json.load(f))
        except OSError:
            return None
        except ValueError as e:  # SchemaError too: a newer schema is refused, not guessed at
            if isinstance(e, SchemaError) or os.path.getsize(path):
                raise DumpError(f"{path}: unreadable run metadata ({e})") from None
            return None  # being written

    def _admit(self, meta: RankMeta) -> None:
        """The first rank fixes layers, hidden size and pre-norm; every later one must agree."""
        key = (list(meta.layers), meta.hidden_size, meta.prenorm)
        first = (self.layers, self.hidden_size, self.prenorm)
        if not self.layers:
            self.layers, self.hidden_size, self.prenorm = key
        elif key != first:
            raise DumpError(f"run {meta.run_id}: layers/hidden size/pre-norm {key} differ from the first run's {first}")

    @property
    def parts(self) -> List[str]:
        return step_parts(self.layers, self.prenorm)

    # ------------------------------------------------------------ reading
    def _new_lines(self, key: RankKey) -> Iterator[IndexLine]:
        """The rank's lines committed since the last read, one at a time (consumed as taken)."""
        i, tag = key
        state = self._ranks[key]
        path = index_path(self.runs[i].path, tag)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return
        with f:
            f.seek(state.offset)
            for raw in f:
                if not raw.endswith(b"\n"):  # a line still being appended waits for its newline
                    return
                try:
                    line = IndexLine.from_json(json.loads(raw))
                except (SchemaError, ValueError) as e:
                    raise DumpError(f"{path}: a line after byte {state.offset} is not a valid index line ({e}): "
                                    "hscap verify names it") from None
                state.offset += len(raw)
                yield line

    def _counts(self, rid: Optional[str]) -> bool:
        if rid is None or rid.startswith(self.exclude_prefix):
            return False
        return rid in self._todo if self._todo is not None else rid not in self._settled

    def _settle(self, rid: str) -> None:
        """Named, or never to be: its captures go and later ones are not collected."""
        if self._todo is not None:
            self._todo.pop(rid, None)
        else:
            self._settled.add(rid)
        for st in self._ranks.values():
            st.drop(rid)

    def _give_up(self, st: _Rank, rid: str, why: str, for_good: bool) -> None:
        if for_good:
            self._settle(rid)
        else:
            st.drop(rid)
        self._given_up.pop(rid, None)
        self._given_up[rid] = why
        if len(self._given_up) > GIVEN_UP_KEPT:
            self._given_up.popitem(last=False)

    def _apply(self, key: RankKey, st: _Rank, line: IndexLine) -> List[Whole]:
        at = st.lines
        st.lines += 1
        st.steps.add(line.step)
        files = tuple(sorted((part, f.path) for part, f in line.files.items())) if line.written else ()
        lacking = sorted(set(self.parts) - {part for part, _ in files})
        touched = []
        for s in line.seqs:
            if not self._counts(s.rid):
                continue
            if lacking:  # this capture cannot be whole; without a dataset its end is unknown for good
                why = ("a dropped step (writer full) held part of it" if not line.written
                       else f"step {line.step} of {st.tag} lacks {', '.join(lacking)}")
                self._give_up(st, s.rid, why, for_good=self._todo is None)
                continue
            piece = Piece.of(key[0], st.tag, line, s, files)
            st.add(s.rid, piece)
            touched.append(s.rid)
            if st.lends and piece.lender is not None and piece.lender not in st.wholes:
                st.waiting.setdefault(piece.lender, set()).add(s.rid)  # judged again when its source gets a piece
        ended = st.by_last.get(line.step - 1, ())  # this step does not continue them
        return self._judge(st, sorted(set(touched).union(ended)), at, touched=set(touched))

    def _judge(self, st: _Rank, rids: Iterable[str], at: int, closing: bool = False,
               touched: Set[str] = frozenset()) -> List[Whole]:
        """touched: those with a new piece (the others were judged with the pieces they have).
        closing: the rank's close, judged once its last line is read (never on a line, so that
        a restarted follower finds every whole at the same position). What borrows from a
        capture judged here is judged again after it, at this line (a worklist: a conversation
        of many turns, each waiting on the one before, never recurses)."""
        out = []
        todo, touched, queued = deque(rids), set(touched), set()
        while todo:
            rid = todo.popleft()
            cap = st.captures.get(rid)
            if cap is None:
                continue
            whole = self._judge_one(st, rid, cap, at, closing, touched, out)
            waiters = st.waiting.get(rid)
            # what borrows from it may be whole now (once a line unless it is whole: a circle ends)
            if waiters and (whole or (rid in touched and rid not in queued)):
                queued.add(rid)
                again = sorted(x for x in waiters if x in st.captures)
                if whole or not again:
                    st.waiting.pop(rid, None)
                else:
                    st.waiting[rid] = set(again)
                touched.update(again)
                todo.extend(again)
        self._let_go(st, closing)  # once the line's every capture is judged: one may still be made whole by it
        return out

    def _judge_one(self, st: _Rank, rid: str, cap: _Capture, at: int, closing: bool, touched: Set[str],
                   out: List[Whole]) -> bool:
        """Judge one capture; a whole goes to `out`. Whether it is whole."""
        ended = closing or cap.last + 1 in st.steps
        length = self._todo[rid] if self._todo is not None else None
        if length is None and not ended:
            return False  # without a dataset, whole only once over
        if length is not None and rid not in touched and not (ended and _borrows(cap)):
            if ended:  # no new piece (nor a source since): not whole
                self._ended_short(st, rid, cap)
            return False
        j = self._chain(st, cap, length)
        if not j.whole:
            if ended:
                self._ended_short(st, rid, cap)
            return False
        chain, borrows = unjoined(j.chain)
        self._settle(rid)
        self._given_up.pop(rid, None)  # an earlier capture's fate no longer matters
        if st.lends:
            st.wholes[rid] = (chain, borrows)
            if len(st.wholes) > SOURCES_KEPT:
                st.wholes.popitem(last=False)
        if not (length is None and chain[0].step == 0 and generated_by_sglang(rid)):  # SGLang's startup warmup
            w = Whole(rid, chain, (st.run_id, st.tag, at), borrows)
            if self.progress is None or not self.progress.covers(w):
                out.append(w)
        return True

    @classmethod
    def _chain(cls, st: _Rank, cap: _Capture, length: Optional[int], open_sources: bool = True) -> Judgement:
        """The capture's pieces, and each prefix one of them borrowed joined from its source on
        this rank (its whole, or its open capture where that is whole as far as it lent, as
        merge judges a source, one level deep: a source waiting in turn is joined once whole),
        judged by the one completeness rule."""
        pieces = [cap.pieces[k] for k in sorted(cap.pieces)]
        spans = [Span(p.prefix, p.prefix + p.length, (p.run, p.step, p.rank), p) for p in pieces]
        for p in pieces:
            if p.lender is None:
                continue
            source = st.wholes.get(p.lender)
            if source is None and open_sources and p.lender in st.captures:
                j = cls._chain(st, st.captures[p.lender], p.prefix, open_sources=False)
                source = unjoined(j.chain) if j.whole else None
            if source is not None and sum(c.length for c in source[0]) >= p.prefix:
                spans.append(Span(0, p.prefix, (p.run, p.step, p.rank), joined_prefix(p, *source)))
        return whole_chain(spans, length)

    @staticmethod
    def _ended_short(st: _Rank, rid: str, cap: _Capture) -> None:
        """A capture ended and is not whole: it waits for the request whose capture holds a
        prefix it borrowed, while that capture is open on this rank or its lines may still
        come; else it is let go once its steps are read."""
        late = _source_may_come(st, cap)
        source = next((p.lender for p in cap.pieces.values() if p.lender is not None
                       and p.lender not in st.wholes and (late or p.lender in st.captures)), None)
        if source is None:
            st.short.add(rid)
        else:
            st.waiting.setdefault(source, set()).add(rid)

    def _let_go(self, st: _Rank, closing: bool) -> None:
        """Let go of the captures that ended short of whole once every step around them is read
        (lines come out of step order: one of its chunks may still be on its way)."""
        while True:
            # the source was let go short of whole, or is not read yet; at the close, every
            # capture was judged for the last time
            for source in [x for x in st.waiting if closing or x not in st.captures]:
                keep = set()
                for rid in st.waiting.pop(source):
                    cap = st.captures.get(rid)
                    if cap is None:
                        continue
                    if not closing and _source_may_come(st, cap):
                        keep.add(rid)
                    elif closing or cap.last + 1 in st.steps:
                        st.short.add(rid)  # else judged again when it ends
                if keep:
                    st.waiting[source] = keep
            gone = False
            for rid in list(st.short):
                cap = st.captures.get(rid)
                if cap is None:
                    st.short.discard(rid)
                elif closing or st.steps.spans(max(min(cap.pieces) - 1, 0), cap.last + 1):
                    st.short.discard(rid)
                    why = self._chain(st, cap, self._todo[rid] if self._todo is not None else None).reason
                    joined = next((p for p in cap.pieces.values() if p.lender is not None
                                   and p.lender not in st.wholes), None)
                    if joined is not None:  # HSCAP_REUSE_CAPTURED: its prefix is in another request's capture
                        why = (f"positions 0-{joined.prefix} are joined from request {joined.src!r}'s capture, "
                               f"which is not whole on {st.tag} (or was whole more than {SOURCES_KEPT} samples "
                               "before): merge the dump")
                    self._give_up(st, rid, f"its capture on {st.tag} of run {st.run_id} ended short of whole "
                                           f"({why})", for_good=False)
                    gone = True
            if not (gone and any(x not in st.captures for x in st.waiting)):
                return

    def poll(self) -> List[Whole]:
        """Read what was committed since the last poll; the requests that became whole, each
        rank's in the order of its lines."""
        self._discover()
        out: List[Whole] = []
        for also in (0, 1) if self._replay else ():  # every rank's lines before its last, then those
            for key, st in list(self._ranks.items()):
                upto = self._replay.get((st.run_id, st.tag), -1) + also
                for line in self._new_lines(key) if st.lines < upto else ():
                    out += self._apply(key, st, line)
                    if st.lines >= upto:
                        break
        self._replay = {}
        for key, st in list(self._ranks.items()):
            for line in self._new_lines(key):
                out += self._apply(key, st, line)
            if st.closed and not st.over:  # the close check saw it; this read took its last lines
                out += self._judge(st, sorted(st.captures), st.lines, closing=True)
                st.over = True
                st.wholes.clear()  # a rank's captures borrow only from its own
        return out

    def close_check(self) -> bool:
        """Re-read every rank's metadata: whether every run found so far has closed (a rank
        still running, or no run at all yet, is not closed)."""
        self._discover()
        if not self._ranks:
            return False
        for (i, tag), state in self._ranks.items():
            if not state.closed:
                meta = self._meta(self.runs[i], tag)
                state.closed = meta is not None and meta.status != "running"
        return all(s.closed for s in self._ranks.values())

    @property
    def pending(self) -> Dict[str, str]:
        """Requests seen but not (yet) whole: rid -> why (of those let go, the latest
        GIVEN_UP_KEPT)."""
        out = dict(self._given_up)
        for st in self._ranks.values():
            for rid in st.captures:
                out[rid] = "not whole yet"
            for source, rids in st.waiting.items():
                out.update((rid, f"waits for request {source!r}, whose capture holds the prefix it borrowed")
                           for rid in rids if rid in st.captures)
        return out

    def held(self) -> Dict[str, int]:
        """What the follower holds, entry counts: bounded by the requests in flight and the
        ranks, not by the run; `dataset_left` (the lengths copy) only shrinks; `settled_bytes`
        (no dataset) grows 16 bytes a request."""
        ranks = self._ranks.values()
        return {"captures": sum(len(st.captures) for st in ranks),
                "pieces": sum(len(c.pieces) for st in ranks for c in st.captures.values()),
                "step_runs": sum(len(st.steps.runs) for st in ranks),
                "by_last": sum(len(v) for st in ranks for v in st.by_last.values()),
                "short": sum(len(st.short) for st in ranks),
                "given_up": len(self._given_up),
                "sources": sum(len(st.wholes) for st in ranks),
                "waiting": sum(len(v) for st in ranks for v in st.waiting.values()),
                "dataset_left": len(self._todo) if self._todo is not None else 0,
                "settled_bytes": 16 * len(self._settled) if self._settled is not None else 0}
