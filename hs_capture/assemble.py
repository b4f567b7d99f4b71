"""Stitch requests back together from one or more dumps (offline; never imports sglang).

`plan()` reads index lines only and decides, for every rid, which pieces (run, rank, step,
rows) make it whole, or why it is not whole. `Assembler` then decodes step files through a
byte-bounded LRU cache and returns each sample's tensors in the stored dtype.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from . import format as fmt
from .coverage import Span, whole_chain
from .layout import FINAL, PRENORM, part_name, step_parts
from .reader import DumpError, Run, open_runs


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


def _check_same(runs: List[Run]) -> Tuple[List[int], int, bool]:
    keys = set()
    for run in runs:
        for tag, meta in run.ranks.items():
            keys.add((tuple(meta["layers"]), int(meta["hidden_size"]), bool(meta.get("prenorm", False))))
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
        for i, run in enumerate(runs):
            for tag in run.ranks:
                for line in run.index(tag, strict):
                    if "files" not in line:
                        continue  # a dropped step holds nothing
                    files = tuple(sorted((part, f["path"]) for part, f in line["files"].items()))
                    for s in line["seqs"]:
                        rid = s["rid"]
                        if rid is None or rid.startswith(exclude_prefix):
                            continue
                        piece = Piece(i, tag, int(line["step"]), files, int(s["offset"]), int(s["len"]),
                                      int(s["prefix"]))
                        self.pieces.setdefault(rid, {}).setdefault((os.path.basename(run.path), tag, piece.step),
                                                                   piece)

    def judge(self, rid: str, length: Optional[int] = None) -> Tuple[Optional[List[Piece]], Optional[str], List[Piece]]:
        """(the pieces that make `rid` whole, or None; why not; pieces captured again, not used).
        length: the dataset's (None: as far as it was captured)."""
        pieces = list(self.pieces.get(rid, {}).values())
        usable = [p for p in pieces if not set(self.parts) - {part for part, _ in p.files}]
        j = whole_chain([Span(p.prefix, p.prefix + p.length, (p.run, p.step, p.rank), p) for p in usable], length)
        if j.whole:
            return [s.ref for s in j.chain], None, [s.ref for s in j.extras]
        broken = [p for p in pieces if p not in usable]
        if broken:  # the true cause of the hole: a step that lacks a part
            lacking = sorted(set(self.parts) - {x for x, _ in broken[0].files})
            return None, f"step {broken[0].step} of {broken[0].rank} lacks {', '.join(lacking)}", []
        return None, j.reason, []


def plan(dump_dirs: Iterable[str], lengths: Optional[Dict[str, int]] = None,
         exclude_prefix: str = "HEALTH_CHECK_", strict: bool = True) -> Plan:
    """Decide every sample's pieces. With `lengths` (from the dataset), only those ids count
    and each must reach its full length; else every captured rid, as far as it was captured.
    Not strict: unreadable metadata and index lines are skipped (verify reports them)."""
    cap = Captured(dump_dirs, strict, exclude_prefix)
    result = Plan(cap.runs, cap.layers, cap.hidden_size, cap.prenorm)
    for rid in (lengths.keys() if lengths is not None else cap.pieces.keys()):
        chain, reason, extras = cap.judge(rid, lengths.get(rid) if lengths is not None else None)
        if chain is None:
            result.incomplete[rid] = reason or "never captured"
            continue
        result.samples[rid] = chain
        if extras:
            result.extras[rid] = extras
    return result


@dataclass
class AssembledSample:
    """One sample cut from a dump's steps and stitched in position order (what merge writes)."""

    rid: str
    input_ids: torch.Tensor  # (T,) int64
    layers: Dict[int, torch.Tensor]  # layer -> (T, H), stored dtype
    final: torch.Tensor  # (T, H) post-norm
    prenorm: Optional[torch.Tensor]  # (T, H) or None

    @property
    def raw_bytes(self) -> int:
        ts = [self.final, *self.layers.values()] + ([self.prenorm] if self.prenorm is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)


class Assembler:
    """Decodes step files once and serves every sample inside them (LRU, bounded in bytes)."""

    def __init__(self, plan: Plan, cache_bytes: int = 2 << 30) -> None:
        self.plan = plan
        self.cache_bytes = cache_bytes
        self._cache: "OrderedDict[tuple, Dict[str, Dict[str, torch.Tensor]]]" = OrderedDict()
        self._cached = 0
        self.bytes_read = 0

    def _load(self, piece: Piece) -> Dict[str, Dict[str, torch.Tensor]]:
        run = self.plan.runs[piece.run]
        key = (piece.run, piece.rank, piece.step)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        parts: Dict[str, Dict[str, torch.Tensor]] = {}
        size = 0
        for part, rel in piece.files:
            path = os.path.join(run.path, rel)
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno()).st_size
                    header = fmt.read_header(f, st)
                    parts[part] = {n: fmt.to_torch(fmt.read_tensor_bytes(f, header, n), e.dtype, e.shape)
                                   for n, e in header.tensors.items()}
            except (OSError, fmt.FormatError) as e:
                raise DumpError(f"{rel}: {e}") from None
            self.bytes_read += st
            size += sum(t.numel() * t.element_size() for t in parts[part].values())
        self._cache[key] = parts
        self._cached += size
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= sum(t.numel() * t.element_size() for p in old.values() for t in p.values())
        return parts

    def sample(self, rid: str) -> AssembledSample:
        pieces = self.plan.samples[rid]
        ids, final, pre = [], [], []
        layers: Dict[int, list] = {layer: [] for layer in self.plan.layers}
        for p in pieces:
            parts = self._load(p)
            rows = slice(p.offset, p.offset + p.length)
            try:
                ids.append(parts[FINAL]["input_ids"][rows])
                final.append(parts[FINAL]["hidden"][rows])
                for layer in layers:
                    layers[layer].append(parts[part_name(layer)]["hidden"][rows])
                if self.plan.prenorm:
                    pre.append(parts[PRENORM]["hidden"][rows])
            except KeyError as e:
                raise DumpError(f"rid {rid!r}: step {p.step} of {p.rank} lacks part {e}") from None
        return AssembledSample(rid, torch.cat(ids).to(torch.int64), {k: torch.cat(v) for k, v in layers.items()},
                             torch.cat(final), torch.cat(pre) if pre else None)
