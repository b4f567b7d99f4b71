"""Sanity of hidden-state values, for any array-like of shape [T, H] (numpy, float32 view).

Real residual-stream states are never NaN/Inf, never an all-zero row, never constant, and
no two layers (nor the final state and a layer) are ever bit-identical: each of these is
the signature of a capture bug (a buffer not filled, the same tensor written twice)."""

from __future__ import annotations

import hashlib
from typing import Dict, List, Tuple

import numpy as np


def value_problems(a: np.ndarray) -> List[Tuple[str, str]]:
    """(check, message) pairs for one [T, H] tensor; empty when it looks like real states."""
    out: List[Tuple[str, str]] = []
    if a.size == 0:
        return out
    a2 = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    finite = np.isfinite(a2)
    if not finite.all():
        bad = int((~finite).sum())
        nan = int(np.isnan(a2).sum())
        row = int(np.argwhere(~finite)[0][0])
        out.append(("nonfinite", f"{nan} NaN and {bad - nan} Inf values (first in row {row})"))
    zero_rows = ~a2.any(axis=1)
    if zero_rows.all():
        out.append(("degenerate", "the tensor is all zeros"))
    else:
        if zero_rows.any():
            out.append(("degenerate", f"{int(zero_rows.sum())} of {a2.shape[0]} rows are all zeros "
                                      f"(first: row {int(np.argmax(zero_rows))})"))
        if a2.size > 1 and finite.all() and float(a2.max()) == float(a2.min()):
            out.append(("degenerate", f"the tensor is constant ({float(a2.flat[0])!r})"))
    return out


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).data, digest_size=16).hexdigest()


def identical_pairs(named: Dict[str, np.ndarray]) -> List[Tuple[str, str]]:
    """Pairs of names whose tensors are bit-identical (empty tensors ignored)."""
    seen: Dict[str, str] = {}
    pairs = []
    for name in sorted(named):
        a = named[name]
        if a.size == 0:
            continue
        d = digest(a)
        if d in seen:
            pairs.append((seen[d], name))
        else:
            seen[d] = name
    return pairs
