"""Which positions of which request a dump holds, from the index lines alone (no tensor is
read): what `hscap send` skips on resume and what tells a complete sample from one with
holes (a missing chunk, a radix-cache prefix hit)."""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Tuple

Interval = Tuple[int, int]  # [start, end)


def _merge(intervals: List[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def index_files(dump_dirs: Iterable[str]) -> List[str]:
    """Every index/*.jsonl under the given dump dirs (a dump dir, a run dir, or several)."""
    found = []
    for top in dump_dirs:
        for root, dirs, names in os.walk(top):
            dirs.sort()
            if os.path.basename(root) == "index":
                found += [os.path.join(root, n) for n in sorted(names) if n.endswith(".jsonl")]
    return found


def coverage(dump_dirs: Iterable[str]) -> Dict[str, List[Interval]]:
    """rid -> merged [start, end) position intervals captured, over every run and rank."""
    raw: Dict[str, List[Interval]] = {}
    for path in index_files(dump_dirs):
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a torn last line (crash): its step is not committed
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if "files" not in entry:
                    continue  # a dropped step holds nothing
                for s in entry.get("seqs", []):
                    if s.get("rid") is not None:
                        raw.setdefault(s["rid"], []).append((int(s["prefix"]), int(s["prefix"]) + int(s["len"])))
    return {rid: _merge(iv) for rid, iv in raw.items()}


def is_complete(intervals: List[Interval], length: int) -> bool:
    """True when [0, length) is covered (positions past it, e.g. a decode token, are ignored)."""
    return bool(intervals) and intervals[0][0] == 0 and intervals[0][1] >= length


def holes(intervals: List[Interval], length: int) -> List[Interval]:
    """The uncovered parts of [0, length)."""
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
