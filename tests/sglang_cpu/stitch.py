"""Every captured position of every request of one writing rank, in memory, with a mask of
what was covered: the tests' view of a dump (small dumps only). Whether a sample is whole is
decided by the one rule send, merge and verify use (planning.Captured, coverage.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Set

import numpy as np

from hs_capture.dump.paths import FINAL, PRENORM, part_name
from hs_capture.offline.read.planning import Captured
from hs_capture.offline.read.reader import DumpError, Run


@dataclass
class Sample:
    """One request stitched across chunks and steps: arrays indexed by position."""

    rid: str
    input_ids: np.ndarray
    layers: Dict[int, np.ndarray]
    final: np.ndarray
    covered: np.ndarray = field(repr=False)  # bool per position
    complete: bool = False  # whole by the one completeness rule
    prenorm: Optional[np.ndarray] = field(default=None, repr=False)  # the final norm's input, if captured


def stitch(run: Run, rank: Optional[str] = None, only: Optional[Set[str]] = None) -> Dict[str, Sample]:
    """Reassemble every request (or those in `only`) of one writing rank; positions captured
    twice raise."""
    rank = rank or next(iter(run.ranks))
    layer_of = {part_name(k): k for k in run.ranks[rank].layers}
    pieces: Dict[str, list] = {}
    for line in run.index(rank):
        if not line.written:
            continue
        parts = {p: run.read_part(line, p) for p in line.files}
        final = parts[FINAL]
        for seq in line.seqs:
            if only is not None and seq.rid not in only:
                continue
            rows = slice(seq.offset, seq.offset + seq.len)
            pieces.setdefault(seq.rid, []).append((
                final["positions"][rows],
                final["input_ids"][rows],
                final["hidden"][rows],
                {layer_of[p]: parts[p]["hidden"][rows] for p in parts if p in layer_of},
                parts[PRENORM]["hidden"][rows] if PRENORM in parts else None,
            ))
    judge = Captured([run.path], exclude_prefix="\0").judge
    out = {}
    for rid, chunks in pieces.items():
        length = int(max(int(c[0].max()) for c in chunks if len(c[0])) + 1)
        h = chunks[0][2].shape[-1]
        ids = np.zeros(length, dtype=np.int64)
        final = np.zeros((length, h), dtype=np.float32)
        layers = {k: np.zeros((length, h), dtype=np.float32) for k in chunks[0][3]}
        covered = np.zeros(length, dtype=bool)
        pre = np.zeros((length, h), dtype=np.float32) if chunks[0][4] is not None else None
        for pos, tok, fin, lay, pre_rows in chunks:
            if covered[pos].any():
                raise DumpError(f"rid {rid!r}: positions captured twice")
            covered[pos] = True
            ids[pos] = tok
            final[pos] = fin
            for k, v in lay.items():
                layers[k][pos] = v
            if pre is not None and pre_rows is not None:
                pre[pos] = pre_rows
        out[rid] = Sample(rid, ids, layers, final, covered, judge(rid)[0] is not None, pre)
    return out
