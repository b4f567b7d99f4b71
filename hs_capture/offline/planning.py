"""Which pieces (run, rank, step, rows) make every request whole, from index lines only:
no tensor is read and no torch is imported, so merge and verify plan (and hand work to their
worker processes) before anything heavy loads. assemble.py then cuts the samples out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from hs_capture.offline.attribution import warmups
from hs_capture.offline.coverage import Span, whole_chain
from hs_capture.dump.hst import ITEMSIZE
from hs_capture.dump.paths import step_parts
from hs_capture.offline.reader import DumpError, Run, open_runs


class MixedRuns(DumpError):
    """Runs in one merge disagree on layers, hidden size, dtype or pre-norm capture."""


@dataclass(frozen=True)
class Piece:
    run: int  # index into Plan.runs
    rank: str
    step: int
    files: Tuple[Tuple[str, str], ...]  # (part, relative path)
    offset: int
    length: int
    prefix: int


@dataclass
class Plan:
    runs: List[Run]
    layers: List[int]
    hidden_size: int
    prenorm: bool
    samples: Dict[str, List[Piece]] = field(default_factory=dict)  # rid -> pieces, by position
    incomplete: Dict[str, str] = field(default_factory=dict)  # rid -> reason
    extras: Dict[str, List[Piece]] = field(default_factory=dict)  # rid -> pieces captured again, not used
    # without a dataset: rid -> why it is not a user's sample (SGLang's warmup; attribution.py)
    left_out: Dict[str, str] = field(default_factory=dict)
    itemsize: int = 2  # bytes of one stored state value (the widest dtype the index lines name)


def _check_same(runs: List[Run]) -> Tuple[List[int], int, bool]:
    keys = set()
    for run in runs:
        for tag, meta in run.ranks.items():
            keys.add((tuple(meta.layers), meta.hidden_size, meta.prenorm))
    if len(keys) != 1:
        raise MixedRuns(f"the runs disagree on (layers, hidden size, pre-norm): {sorted(keys)}")
    layers, hidden, prenorm = keys.pop()
    return list(layers), hidden, prenorm


class Captured:
    """Every request's pieces in some dumps (index lines only: no tensor is read), and the one
    completeness rule (coverage.whole_chain) applied to them: what `hscap send` skips on
    resume, and what merge and verify plan from."""

    def __init__(self, dump_dirs: Iterable[str], strict: bool = True, exclude_prefix: str = "HEALTH_CHECK_",
                 allow_empty: bool = False) -> None:
        """Not strict: unreadable metadata and index lines are skipped (verify reports them).
        allow_empty: a dir with no run yet holds nothing (send's first run), not an error."""
        runs: List[Run] = []
        for d in dump_dirs:
            if not allow_empty and not os.path.isdir(d):
                raise DumpError(f"{d}: {'not a directory' if os.path.exists(d) else 'no such directory'}")
            found = open_runs(d, errors=None if strict else []) if os.path.isdir(d) or not allow_empty else []
            if not found and not allow_empty:
                raise DumpError(f"{d}: no hs_capture run found")
            runs += [r for r in found if all(os.path.realpath(r.path) != os.path.realpath(x.path) for x in runs)]
        runs.sort(key=lambda r: os.path.basename(r.path))  # run ids start with their UTC start time
        self.runs = runs
        self.layers, self.hidden_size, self.prenorm = _check_same(runs) if runs else ([], 0, False)
        self.parts = step_parts(self.layers, self.prenorm)
        # A run's pieces are keyed by run id and rank, not by directory: one run copied or split
        # across dump dirs (one per node) is still one run; the same step seen twice counts once.
        self.pieces: Dict[str, Dict[Tuple[str, str, int], Piece]] = {}
        self.dropped: Dict[str, int] = {}  # rid -> a dropped step that held part of it
        # (run, rank, step) -> what is wrong with a file the index line lists: a missing or
        # truncated file makes its part absent, for every tool that judges by this class
        self.damage: Dict[Tuple[int, str, int], str] = {}
        self.itemsize = 0
        for i, run in enumerate(runs):
            for tag in run.ranks:
                for line in run.index(tag, strict):
                    if not line.written:  # a dropped step holds nothing
                        for s in line.seqs:
                            if s.rid is not None:
                                self.dropped.setdefault(s.rid, line.step)
                        continue
                    files = self._intact(i, run, tag, line)
                    self.itemsize = max(self.itemsize, ITEMSIZE.get(line.dtype, 0))
                    for s in line.seqs:
                        rid = s.rid
                        if rid is None or rid.startswith(exclude_prefix):
                            continue
                        piece = Piece(i, tag, line.step, files, s.offset, s.len, s.prefix)
                        self.pieces.setdefault(rid, {}).setdefault((os.path.basename(run.path), tag, piece.step),
                                                                   piece)

    def _intact(self, i: int, run: Run, tag: str, line) -> Tuple[Tuple[str, str], ...]:
        """The step's (part, path) whose file is there with the size its index line says (a
        stat each, no read); the first file that is not is noted in `damage`."""
        out = []
        for part, f in sorted(line.files.items()):
            try:
                size = os.stat(os.path.join(run.path, f.path)).st_size
            except OSError:
                size = None
            if size == f.bytes:
                out.append((part, f.path))
            else:
                self.damage.setdefault((i, tag, line.step), f"its {part} file is " + (
                    "missing" if size is None else f"{size} bytes, not the {f.bytes} its index line says"))
        return tuple(out)

    def judge(self, rid: str, length: Optional[int] = None) -> Tuple[Optional[List[Piece]], Optional[str], List[Piece]]:
        """(the pieces that make `rid` whole, or None; why not; pieces captured again, not used).
        length: the dataset's (None: as far as it was captured)."""
        if length is None and rid in self.dropped:  # its end may be what was dropped
            return None, (f"step {self.dropped[rid]} that held part of it was dropped (writer full): without "
                          "the dataset's length its end is unknown"), []
        pieces = list(self.pieces.get(rid, {}).values())
        usable = [p for p in pieces if not set(self.parts) - {part for part, _ in p.files}]
        j = whole_chain([Span(p.prefix, p.prefix + p.length, (p.run, p.step, p.rank), p) for p in usable], length)
        if j.whole:
            return [s.ref for s in j.chain], None, [s.ref for s in j.extras]
        broken = [p for p in pieces if p not in usable]
        if broken:  # the true cause of the hole: a step that lacks a part
            b = broken[0]
            damage = self.damage.get((b.run, b.rank, b.step))
            if damage:
                return None, f"step {b.step} of {b.rank}: {damage}", []
            lacking = sorted(set(self.parts) - {x for x, _ in b.files})
            return None, f"step {b.step} of {b.rank} lacks {', '.join(lacking)}", []
        return None, j.reason, []


def plan(dump_dirs: Iterable[str], lengths: Optional[Dict[str, int]] = None,
         exclude_prefix: str = "HEALTH_CHECK_", strict: bool = True) -> Plan:
    """Decide every sample's pieces. With `lengths` (from the dataset), only those ids count
    and each must reach its full length; else every captured rid, as far as it was captured,
    but SGLang's startup warmup (left_out).
    Not strict: unreadable metadata and index lines are skipped (verify reports them)."""
    cap = Captured(dump_dirs, strict, exclude_prefix)
    result = Plan(cap.runs, cap.layers, cap.hidden_size, cap.prenorm, itemsize=cap.itemsize or 2)
    for rid in (lengths.keys() if lengths is not None else cap.pieces.keys()):
        chain, reason, extras = cap.judge(rid, lengths.get(rid) if lengths is not None else None)
        if chain is None:
            result.incomplete[rid] = reason or "never captured"
            continue
        result.samples[rid] = chain
        if extras:
            result.extras[rid] = extras
    if lengths is None:  # every captured rid counts, but SGLang's warmup is no user's sample
        result.left_out = warmups(result.samples)
        for rid in result.left_out:
            del result.samples[rid]
            result.extras.pop(rid, None)
    return result
