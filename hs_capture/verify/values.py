"""Sanity of hidden-state values, for any array-like of shape [T, H] (numpy, float32 view).

Real residual-stream states are never NaN/Inf, never an all-zero row, never constant, and
no two layers (nor the final state and a layer) are ever bit-identical: each of these is
the signature of a capture bug (a buffer not filled, the same tensor written twice)."""

from __future__ import annotations

import hashlib
from typing import Dict, List, Tuple

import numpy as np


def as_array(raw: bytes, dtype: str, shape) -> np.ndarray:
    """The stored bytes as an array without a copy; bfloat16 stays as its uint16 bit patterns
    (value_problems reads them directly: no float32 copy of a 470 MB step)."""
    if dtype == "bfloat16":
        return np.frombuffer(raw, dtype="<u2").reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def value_problems(a: np.ndarray, bf16_bits: bool = False) -> List[Tuple[str, str]]:
    """(check, message) pairs for one [T, H] tensor; empty when it looks like real states.
    bf16_bits: `a` holds bfloat16 bit patterns (uint16), as as_array returns them."""
    out: List[Tuple[str, str]] = []
    if a.size == 0:
        return out
    a2 = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    if bf16_bits:
        special = (a2 & 0x7F80) == 0x7F80  # exponent all ones: Inf or NaN
        finite = ~special
        nan_mask = special & ((a2 & 0x7F) != 0)
    else:
        finite = np.isfinite(a2)
        nan_mask = np.isnan(a2)
    if not finite.all():
        bad = int((~finite).sum())
        nan = int(nan_mask.sum())
        row = int(np.argwhere(~finite)[0][0])
        out.append(("nonfinite", f"{nan} NaN and {bad - nan} Inf values (first in row {row})"))
    zero_rows = ~((a2 & 0x7FFF) != 0).any(axis=1) if bf16_bits else ~a2.any(axis=1)
    if zero_rows.all():
        out.append(("degenerate", "the tensor is all zeros"))
    else:
        if zero_rows.any():
            out.append(("degenerate", f"{int(zero_rows.sum())} of {a2.shape[0]} rows are all zeros "
                                      f"(first: row {int(np.argmax(zero_rows))})"))
        if a2.size > 1 and finite.all() and (a2 == a2.flat[0]).all():
            out.append(("degenerate", "the tensor is constant"))
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
