"""Follow a dump while a server writes it: read each rank's index as it grows and say which
requests have just become whole (index lines only: no tensor is read, no torch imported).
The dump dataset's live mode (dump_dataset.FollowingDumpDataset) decodes what this names.

When is a request whole while the run is still being written?
  - with the dataset's lengths: when a chain of pieces covers [0, length) (coverage.whole_chain,
    the one completeness rule merge and verify judge by);
  - without: when the rank has committed the step after the request's last piece and that step
    does not continue it (SGLang runs a chunked request's next chunk in the very next prefill
    forward, and only prefill forwards are steps), or when the run has closed.
Without a dataset, a request a dropped step touched is never whole here (merge would keep its
captured prefix; a live reader must never hand out part of a sample). Each request is named
once: the first time it is whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from hs_capture.dump.paths import index_path, rank_meta_path, rank_tags, run_dirs, step_parts
from hs_capture.dump.schema import IndexLine, RankMeta, SchemaError
from hs_capture.offline.attribution import generated_by_sglang
from hs_capture.offline.coverage import Span, whole_chain
from hs_capture.offline.planning import Piece
from hs_capture.offline.reader import DumpError, Run

RankKey = Tuple[int, str]  # (index into Follower.runs, rank tag)


@dataclass
class _Rank:
    offset: int = 0  # bytes of index.jsonl consumed (whole lines only)
    steps: Dict[int, Set[str]] = field(default_factory=dict)  # step -> the rids it holds
    closed: bool = False


@dataclass(frozen=True)
class Whole:
    """A request that has just become whole: its pieces in position order."""

    rid: str
    pieces: List[Piece]

    @property
    def end(self) -> Tuple[int, str, int]:
        """The step that ends it: (run, rank, step)."""
        p = self.pieces[-1]
        return p.run, p.rank, p.step


class Follower:
    """The live view of one or more dump dirs (which need not exist yet)."""

    def __init__(self, dump_dirs: Iterable[str], lengths: Optional[Dict[str, int]] = None,
                 skip: Iterable[str] = (), exclude_prefix: str = "HEALTH_CHECK_") -> None:
        """lengths: the dataset's (only its ids count); skip: requests already handed out."""
        self.dump_dirs = list(dump_dirs)
        self.lengths = lengths
        self.exclude_prefix = exclude_prefix
        self.runs: List[Run] = []
        self.layers: List[int] = []
        self.hidden_size = 0
        self.prenorm = False
        self._ranks: Dict[RankKey, _Rank] = {}
        self._pieces: Dict[str, Dict[Tuple[str, str, int], Piece]] = {}
        self._broken: Set[str] = set()  # touched by a dropped step
        self._done: Set[str] = set(skip)

    # ------------------------------------------------------------ discovery
    def _discover(self) -> None:
        known = {os.path.realpath(r.path) for r in self.runs}
        for d in self.dump_dirs:
            for path in run_dirs(d) if os.path.isdir(d) else []:
                if os.path.realpath(path) in known:
                    continue
                self.runs.append(Run(path, {}))
                known.add(os.path.realpath(path))
        for i, run in enumerate(self.runs):
            for tag in rank_tags(run.path):
                if tag not in run.ranks:
                    meta = self._meta(run, tag)
                    if meta is not None:
                        self._admit(meta)
                        run.ranks[tag] = meta
                        self._ranks[(i, tag)] = _Rank()

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
    def _new_lines(self, key: RankKey) -> List[IndexLine]:
        i, tag = key
        state = self._ranks[key]
        path = index_path(self.runs[i].path, tag)
        try:
            with open(path, "rb") as f:
                f.seek(state.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being appended waits for its newline
        out = []
        for n, raw in enumerate(data[:end].splitlines(), 1):
            try:
                out.append(IndexLine.from_json(json.loads(raw)))
            except (SchemaError, ValueError) as e:
                raise DumpError(f"{path}: a line after byte {state.offset} is not a valid index line ({e}): "
                                "hscap verify names it") from None
        state.offset += end
        return out

    def _counts(self, rid: Optional[str]) -> bool:
        if rid is None or rid in self._done or rid.startswith(self.exclude_prefix):
            return False
        return self.lengths is None or rid in self.lengths

    def _apply(self, key: RankKey, line: IndexLine, touched: Set[str]) -> None:
        i, tag = key
        if self.lengths is None:  # without lengths, whether a request ended is read off the next step
            self._ranks[key].steps[line.step] = {s.rid for s in line.seqs if s.rid is not None}
        files = tuple(sorted((part, f.path) for part, f in line.files.items())) if line.written else ()
        run_id = os.path.basename(self.runs[i].path)
        for s in line.seqs:
            if not self._counts(s.rid) or s.rid in self._broken:
                continue
            touched.add(s.rid)
            if not line.written or set(self.parts) - {part for part, _ in files}:
                if self.lengths is None:  # with lengths a hole is seen as one (a re-send may fill it)
                    self._broken.add(s.rid)
                    self._pieces.pop(s.rid, None)  # never whole here: its pieces are not kept
                continue
            piece = Piece(i, tag, line.step, files, s.offset, s.len, s.prefix)
            self._pieces.setdefault(s.rid, {}).setdefault((run_id, tag, line.step), piece)

    def poll(self) -> List[Whole]:
        """Read what was committed since the last poll; the requests that became whole, in step order."""
        self._discover()
        touched: Set[str] = set()
        for key in list(self._ranks):
            for line in self._new_lines(key):
                self._apply(key, line, touched)
        out = self._judge(touched if self.lengths is not None else set(self._pieces))
        self._prune_steps()
        return out

    def _prune_steps(self) -> None:
        """Keep only the steps a pending request's end is read off (the one after its last
        piece) and each rank's newest: the rest would grow with the run."""
        if self.lengths is not None:
            return
        keep: Dict[RankKey, int] = {}
        for pieces in self._pieces.values():
            for p in pieces.values():
                k = (p.run, p.rank)
                keep[k] = min(keep.get(k, p.step + 1), p.step + 1)
        for k, state in self._ranks.items():
            if not state.steps:
                continue
            low = min(keep.get(k, max(state.steps)), max(state.steps))
            for step in [x for x in state.steps if x < low]:
                del state.steps[step]

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

    def _judge(self, rids: Iterable[str]) -> List[Whole]:
        out = []
        for rid in rids:
            if rid in self._done or rid in self._broken or rid not in self._pieces:
                continue
            pieces = list(self._pieces[rid].values())
            length = self.lengths[rid] if self.lengths is not None else None
            j = whole_chain([Span(p.prefix, p.prefix + p.length, (p.run, p.step, p.rank), p) for p in pieces], length)
            if not j.whole:
                continue
            chain = [s.ref for s in j.chain]
            if length is None:
                if chain[0].step == 0 and generated_by_sglang(rid):  # SGLang's startup warmup
                    self._forget(rid)
                    continue
                if not self._ended(rid, chain):
                    continue
            self._forget(rid)
            out.append(Whole(rid, chain))
        out.sort(key=lambda w: (w.end, w.rid))
        return out

    def _ended(self, rid: str, chain: List[Piece]) -> bool:
        last = chain[-1]
        state = self._ranks[(last.run, last.rank)]
        after = state.steps.get(last.step + 1)
        return state.closed or (after is not None and rid not in after)

    def _forget(self, rid: str) -> None:
        self._done.add(rid)
        self._pieces.pop(rid, None)

    @property
    def pending(self) -> Dict[str, str]:
        """Requests seen but not (yet) whole: rid -> why."""
        out = {rid: "a dropped step (writer full) held part of it" for rid in self._broken if rid not in self._done}
        for rid in self._pieces:
            out.setdefault(rid, "not whole yet")
        return out
