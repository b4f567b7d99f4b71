"""The one completeness rule: when a request's captured pieces make it whole, and which pieces
are used. `hscap send` (what to skip on resume), `hscap merge` and `hscap verify` (through
planning.plan) all judge by `whole_chain`, so they never disagree about a sample.

A piece is one step's rows of one request: positions [start, end), from one run and rank.
A request is whole when a chain of pieces, each starting where the previous one ended,
covers [0, length) (length: the dataset's, or the furthest position captured). Where
several chains exist (a retry or re-send captured it again, in the same run or a later
one), the latest piece at each point wins. Every piece not on the chain is an extra,
reported as a warning, never a reason to reject a whole capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

Interval = Tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    order: Tuple = ()  # recency: a larger order is a later capture (run id, step, ...)
    ref: Any = None  # the caller's piece


@dataclass
class Judgement:
    chain: Optional[List[Span]]  # None: not whole
    reason: Optional[str]  # why not whole
    extras: List[Span]  # pieces not on the chain

    @property
    def whole(self) -> bool:
        return self.chain is not None


def merged(intervals: Iterable[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def holes(intervals: List[Interval], length: int) -> List[Interval]:
    """The uncovered parts of [0, length) (intervals merged and sorted)."""
    out, at = [], 0
    for a, b in intervals:
        if a > at:
            out.append((at, min(a, length)))
        at = max(at, b)
        if at >= length:
            break
    if at < length:
        out.append((at, length))
    return [h for h in out if h[0] < h[1]]


def whole_chain(spans: List[Span], length: Optional[int] = None) -> Judgement:
    """Judge one request's pieces (see the module doc)."""
    spans = [s for s in spans if s.end > s.start]
    if not spans:
        return Judgement(None, "never captured", [])
    end = length if length is not None else max(s.end for s in spans)
    by_start: Dict[int, List[Span]] = {}
    for s in spans:
        by_start.setdefault(s.start, []).append(s)
    for group in by_start.values():
        group.sort(key=lambda s: s.order, reverse=True)
    # reaches[p]: a chain from position p reaches `end` (positions past it, e.g. a decode
    # token of a MIXED step, are allowed)
    reaches: Dict[int, bool] = {}
    for p in sorted({s.start for s in spans} | {s.end for s in spans}, reverse=True):
        reaches[p] = p >= end or any(reaches[s.end] for s in by_start.get(p, ()))
    if not reaches.get(0, False):
        return Judgement(None, _why_not(spans, end), spans)
    chain, at = [], 0
    while at < end:
        s = next(s for s in by_start[at] if reaches[s.end])  # the latest piece that still leads on
        chain.append(s)
        at = s.end
    used = {id(s) for s in chain}
    return Judgement(chain, None, [s for s in spans if id(s) not in used])


def _why_not(spans: List[Span], end: int) -> str:
    gaps = holes(merged((s.start, s.end) for s in spans), end)
    if gaps:
        a, b = gaps[0]
        return f"positions {a}..{b - 1} missing" + (" (a prefix-cache hit?)" if a == 0 else "")
    # every position is captured, but no chain of pieces meets end to start
    return "positions captured in overlapping pieces that never line up end to start (no whole capture)"


def describe_extra(s: Span, where: str) -> str:
    return f"positions {s.start}..{s.end - 1} captured again ({where}): not used; the sample is whole without it"
