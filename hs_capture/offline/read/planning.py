"""Which pieces (run, rank, step, rows) make every request whole, from index lines only:
no tensor is read and no torch is imported, so merge and verify plan (and hand work to their
worker processes) before anything heavy loads. assemble.py then cuts the samples out.

The one completeness rule: a sample is whole when a chain of its pieces covers it
(coverage.whole_chain) and every file of every step in that chain is sound. A file is judged
sound here by its size (there, and as its index line recorded it: a stat, no read); a file
that is whole but corrupt (a flipped bit) is found only by decoding it, against the crc32s
its header holds. Who decodes: merge, every step it writes from (a sample it cannot decode is
listed incomplete, never written); verify, every step (or --sample of them); send's resume
with --check-data, every step (Captured.check_contents); DumpDataset when it reads the sample
(a one-line DumpError). In each, a damaged step makes all its samples not whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from hs_capture.dump import hst, quant
from hs_capture.offline.workers import procs
from hs_capture.offline.read.attribution import warmups
from hs_capture.offline.read.coverage import Span, whole_chain
from hs_capture.dump.hst import ITEMSIZE
from hs_capture.dump.paths import step_parts
from hs_capture.dump.schema import IndexLine, SeqEntry
from hs_capture.offline.read.reader import DumpError, Run, open_runs


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
    dtype: str = ""  # its index line's: what the server stored (quant.STORED_DTYPE: the compact tier)
    src: Optional[str] = None  # the request whose capture holds positions [0, prefix) (a borrowed prefix)
    src_hash: Optional[str] = None  # the digest of this request's tokens there

    @property
    def lender(self) -> Optional[str]:
        """The request whose capture holds this piece's positions [0, prefix), where it borrowed them."""
        return self.src if self.src is not None and self.prefix > 0 else None

    @classmethod
    def of(cls, run: int, rank: str, line: IndexLine, seq: SeqEntry, files: Tuple[Tuple[str, str], ...]) -> "Piece":
        """One sequence entry of a written index line as a piece."""
        return cls(run, rank, line.step, files, seq.offset, seq.len, seq.prefix, line.dtype, seq.src, seq.src_hash)


@dataclass(frozen=True)
class Borrow:
    """Positions [0, length) of a sample joined from request `src`'s capture: its token ids
    there must have the digest `src_hash` (checked when the sample is assembled)."""
    length: int
    src: str
    src_hash: str


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
    itemsize: int = 2  # bytes of one state value as read (the widest dtype the index lines name, fp8 read as bf16)
    borrows: Dict[str, List[Borrow]] = field(default_factory=dict)  # rid -> prefixes joined from other captures


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
        self.borrows: Dict[str, List[Borrow]] = {}  # rid -> what its judged chain joins from other captures
        self._judging: set = set()
        # (src, prefix) -> its pieces to that prefix (or None), why not, the joins within them
        self._sources: Dict[Tuple[str, int], Tuple[Optional[List[Piece]], Optional[str], List[Borrow]]] = {}
        self._filled = False
        for i, run in enumerate(runs):
            for tag in run.ranks:
                for line in run.index(tag, strict):
                    if not line.written:  # a dropped step holds nothing
                        for s in line.seqs:
                            if s.rid is not None:
                                self.dropped.setdefault(s.rid, line.step)
                        continue
                    files = self._intact(i, run, tag, line)
                    self.itemsize = max(self.itemsize, ITEMSIZE.get(quant.read_dtype(line.dtype), 0))
                    for s in line.seqs:
                        rid = s.rid
                        if rid is None or rid.startswith(exclude_prefix):
                            continue
                        piece = Piece.of(i, tag, line, s, files)
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

    def check_contents(self, jobs: int = 1, progress: Optional[Callable[[int, int], None]] = None) -> int:
        """Decode every file of every step that holds a piece and check it against its crc32s
        (reads the whole dump, in `jobs` processes). A file that fails makes its step damaged,
        as a missing one does. Returns the number of damaged steps found."""
        steps: Dict[Tuple[int, str, int], Tuple[Tuple[str, str], ...]] = {}
        for pieces in self.pieces.values():
            for pc in pieces.values():
                if pc.files:
                    steps.setdefault((pc.run, pc.rank, pc.step), pc.files)
        keys = sorted(steps)
        work = [tuple((part, os.path.join(self.runs[k[0]].path, rel)) for part, rel in steps[k]) for k in keys]
        if jobs <= 1 or len(work) <= 1:
            bad = _unsound(keys, map(_first_unsound, work), progress)
        else:
            with procs.pool(min(jobs, len(work)), [__name__], _no_init, ()) as ex:
                chunk = max(1, len(work) // (16 * jobs))  # few round trips, still an even spread
                bad = _unsound(keys, ex.map(_first_unsound, work, chunksize=chunk), progress)
        self._sources.clear()
        self._filled = False
        for key, (part, why) in bad.items():
            self.damage.setdefault(key, f"its {part} file {why}")
        for pieces in self.pieces.values():
            for k, pc in pieces.items():
                if (pc.run, pc.rank, pc.step) in bad:
                    part = bad[(pc.run, pc.rank, pc.step)][0]
                    pieces[k] = replace(pc, files=tuple(f for f in pc.files if f[0] != part))
        return len(bad)

    def judge(self, rid: str, length: Optional[int] = None) -> Tuple[Optional[List[Piece]], Optional[str], List[Piece]]:
        """(the pieces that make `rid` whole, or None; why not; pieces captured again, not used).
        length: the dataset's (None: as far as it was captured).
        A piece that borrowed its prefix (`src`) covers [0, prefix) too, with the pieces of
        `src`'s capture that make it whole to that prefix (`borrows[rid]` then says what to
        check of the tokens joined)."""
        self._fill_sources()
        chain, why, extras, borrows = self._judge(rid, length)
        if borrows:
            self.borrows[rid] = borrows
        else:
            self.borrows.pop(rid, None)
        return chain, why, extras

    def _judge(self, rid: str, length: Optional[int]
               ) -> Tuple[Optional[List[Piece]], Optional[str], List[Piece], List[Borrow]]:
        if length is None and rid in self.dropped:  # its end may be what was dropped
            return None, (f"step {self.dropped[rid]} that held part of it was dropped (writer full): without "
                          "the dataset's length its end is unknown"), [], []
        pieces = list(self.pieces.get(rid, {}).values())
        usable = [p for p in pieces if not set(self.parts) - {part for part, _ in p.files}]
        spans = [Span(p.prefix, p.prefix + p.length, (p.run, p.step, p.rank), p) for p in usable]
        borrowed_why = None
        for p in usable:
            if p.lender is not None:
                got, why = self._borrowed(p)
                if got is not None:
                    spans.append(Span(0, p.prefix, (p.run, p.step, p.rank), got))
                elif borrowed_why is None:
                    borrowed_why = why
        j = whole_chain(spans, length)
        if j.whole:
            chain, borrows = unjoined(j.chain)
            return chain, None, [s.ref for s in j.extras if isinstance(s.ref, Piece)], borrows
        if borrowed_why is not None:
            return None, borrowed_why, [], []
        broken = [p for p in pieces if p not in usable]
        if broken:  # the true cause of the hole: a step that lacks a part
            b = broken[0]
            damage = self.damage.get((b.run, b.rank, b.step))
            if damage:
                return None, f"step {b.step} of {b.rank}: {damage}", [], []
            lacking = sorted(set(self.parts) - {x for x, _ in b.files})
            return None, f"step {b.step} of {b.rank} lacks {', '.join(lacking)}", [], []
        return None, j.reason, [], []

    def _fill_sources(self) -> None:
        """Judge every borrowed prefix once, in the order the borrowing pieces were captured: a
        source is judged before what borrows from it, so a conversation of many turns, each
        borrowing from the one before, never recurses deeper than one turn."""
        if self._filled:
            return
        self._filled = True
        borrowing = [p for pieces in self.pieces.values() for p in pieces.values() if p.lender is not None]
        for p in sorted(borrowing, key=lambda p: (p.run, p.step, p.rank)):
            self._borrowed(p)

    def _borrowed(self, p: Piece) -> Tuple[Optional["Joined"], Optional[str]]:
        """The pieces of `p.src`'s capture that make it whole to `p.prefix`, or None and why not."""
        key = (p.src, p.prefix)
        if key not in self._sources:
            if p.src in self._judging:
                return None, f"its prefix is borrowed in a circle through request {p.src!r}"
            self._judging.add(p.src)
            try:
                chain, why, _, inner = self._judge(p.src, p.prefix)
            finally:
                self._judging.discard(p.src)
            self._sources[key] = (chain, why, inner)
        chain, why, inner = self._sources[key]
        if chain is None:
            return None, (f"positions 0-{p.prefix} are borrowed from request {p.src!r}, whose capture is not whole "
                          f"there ({why})")
        return joined_prefix(p, chain, inner), None


@dataclass(eq=False)
class Joined:
    """A borrowed prefix as one span of whole_chain: the pieces it stands for, and what to
    check of their tokens."""
    pieces: List[Piece]
    borrows: List[Borrow]


def joined_prefix(p: Piece, chain: List[Piece], inner: List[Borrow]) -> Joined:
    """Positions [0, p.prefix) of the request whose piece `p` borrowed them, from `chain`, the
    pieces that make p.src whole at least that far (`inner`: what that chain joins in turn)."""
    # the source's own joins within the prefix are this sample's too: each is checked again
    nested = [b for b in inner if b.length <= p.prefix]
    cut = [c if c.prefix + c.length <= p.prefix else replace(c, length=p.prefix - c.prefix)
           for c in chain if c.prefix < p.prefix]
    return Joined(cut, [Borrow(p.prefix, p.src or "", p.src_hash or ""), *nested])


def unjoined(chain: Iterable[Span]) -> Tuple[List[Piece], List[Borrow]]:
    """A whole chain's pieces, each joined prefix replaced by the pieces it stands for, and
    what the joins require of the tokens."""
    pieces: List[Piece] = []
    borrows: List[Borrow] = []
    for s in chain:
        if isinstance(s.ref, Joined):
            pieces += s.ref.pieces
            borrows += s.ref.borrows
        else:
            pieces.append(s.ref)
    return pieces, borrows


def plan(dump_dirs: Iterable[str], lengths: Optional[Dict[str, int]] = None,
         exclude_prefix: str = "HEALTH_CHECK_", strict: bool = True, check_jobs: int = 0) -> Plan:
    """Decide every sample's pieces. With `lengths` (from the dataset), only those ids count
    and each must reach its full length; else every captured rid, as far as it was captured,
    but SGLang's startup warmup (left_out).
    Not strict: unreadable metadata and index lines are skipped (verify reports them).
    check_jobs > 0: decode every step first, in that many processes (Captured.check_contents),
    so a corrupt file leaves its samples out of the plan; 0 judges files by their size."""
    cap = Captured(dump_dirs, strict, exclude_prefix)
    if check_jobs > 0:
        cap.check_contents(check_jobs)
    result = Plan(cap.runs, cap.layers, cap.hidden_size, cap.prenorm, itemsize=cap.itemsize or 2)
    for rid in (lengths.keys() if lengths is not None else cap.pieces.keys()):
        chain, reason, extras = cap.judge(rid, lengths.get(rid) if lengths is not None else None)
        if chain is None:
            result.incomplete[rid] = reason or "never captured"
            continue
        result.samples[rid] = chain
        if rid in cap.borrows:
            result.borrows[rid] = cap.borrows[rid]
        if extras:
            result.extras[rid] = extras
    if lengths is None:  # every captured rid counts, but SGLang's warmup is no user's sample
        result.left_out = warmups(result.samples)
        for rid in result.left_out:
            del result.samples[rid]
            result.extras.pop(rid, None)
    return result


def _first_unsound(files: Tuple[Tuple[str, str], ...]) -> Optional[Tuple[str, str]]:
    """(part, what is wrong) for the first of a step's files that does not decode to the crc32s
    its header holds, or None (in a worker process: nothing but the file is read)."""
    for part, path in files:
        try:
            with hst.opened(path) as (f, header):
                for name in header.tensors:
                    hst.read_tensor_bytes(f, header, name)
        except OSError as e:
            return part, f"is unreadable ({e.strerror or e})"
        except hst.FormatError as e:
            return part, f"fails when decoded ({type(e).__name__}: {e})"
    return None


def _unsound(keys: List[Tuple[int, str, int]], results: Iterator[Optional[Tuple[str, str]]],
             progress: Optional[Callable[[int, int], None]]) -> Dict[Tuple[int, str, int], Tuple[str, str]]:
    bad = {}
    for n, (key, found) in enumerate(zip(keys, results), 1):
        if found is not None:
            bad[key] = found
        if progress:
            progress(n, len(keys))
    return bad


def _no_init() -> None:
    pass
