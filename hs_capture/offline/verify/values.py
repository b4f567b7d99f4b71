"""Sanity of hidden-state values, for any array-like of shape [T, H] (numpy, float32 view).

Real residual-stream states are never NaN/Inf, never an all-zero row, never constant, and
no two layers (nor the final state and a layer) are ever bit-identical: each of these is
the signature of a capture bug (a buffer not filled, the same tensor written twice)."""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Tuple

import numpy as np


def as_array(raw: bytes, dtype: str, shape) -> np.ndarray:
    """The stored bytes as an array without a copy; bfloat16 stays as its uint16 bit patterns
    (value_problems reads them directly: no float32 copy of a 470 MB step)."""
    if dtype == "bfloat16":
        return np.frombuffer(raw, dtype="<u2").reshape(shape)
    if dtype == "float8_e4m3fn":  # numpy has no fp8: its bit patterns, read as they are
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def value_problems(a: np.ndarray, bf16_bits: bool = False, fp8_bits: bool = False) -> List[Tuple[str, str]]:
    """(check, message) pairs for one [T, H] tensor; empty when it looks like real states.
    bf16_bits / fp8_bits: `a` holds bfloat16 (uint16) or float8_e4m3fn (uint8) bit patterns,
    as as_array returns them. e4m3fn has no Inf: a value that was not finite is stored NaN."""
    out: List[Tuple[str, str]] = []
    if a.size == 0:
        return out
    a2 = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    if bf16_bits or fp8_bits:
        # the bits without the sign: one pass serves every check below
        mag = a2 & (0x7FFF if bf16_bits else 0x7F)
        special_at = 0x7F80 if bf16_bits else 0x7F  # bf16: exponent all ones (Inf, NaN); e4m3fn: NaN
        special_any = int(mag.max()) >= special_at
        nonzero = mag != 0
    else:
        special_any = not np.isfinite(a2.max()) or not np.isfinite(a2.min())  # NaN/Inf propagate
        nonzero = a2 != 0
    if special_any:
        if bf16_bits or fp8_bits:
            special = mag >= special_at
            nan = int((mag > 0x7F80).sum()) if bf16_bits else int(special.sum())
        else:
            special = ~np.isfinite(a2)
            nan = int(np.isnan(a2).sum())
        bad = int(special.sum())
        row = int(np.argwhere(special)[0][0])
        out.append(("nonfinite", f"{nan} NaN and {bad - nan} Inf values (first in row {row})"))
    zero_rows = ~nonzero.any(axis=1)
    if zero_rows.all():
        out.append(("degenerate", "the tensor is all zeros"))
    else:
        if zero_rows.any():
            out.append(("degenerate", f"{int(zero_rows.sum())} of {a2.shape[0]} rows are all zeros "
                                      f"(first: row {int(np.argmax(zero_rows))})"))
        first = a2.flat[0]
        # a full comparison only when the first row is constant: real states never get that far
        if a2.size > 1 and not special_any and (a2[0] == first).all() and (a2 == first).all():
            out.append(("degenerate", "the tensor is constant"))
    return out


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).data, digest_size=16).hexdigest()


def identical_pairs(named: Dict[str, np.ndarray], keys: Optional[Dict[str, object]] = None) -> List[Tuple[str, str]]:
    """Pairs of names whose tensors are bit-identical (empty tensors ignored). `keys`: a cheap
    fingerprint per name (e.g. the header's crc32): only equal fingerprints are compared."""
    seen: Dict[object, List[str]] = {}
    pairs = []
    for name in sorted(named):
        a = named[name]
        if a.size == 0:
            continue
        key = (a.shape, keys[name]) if keys is not None else digest(a)
        for other in seen.get(key, []):
            if keys is None or np.array_equal(named[other], a):
                pairs.append((other, name))
                break
        else:
            seen.setdefault(key, []).append(name)
    return pairs
