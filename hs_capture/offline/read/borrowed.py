"""The gate on joined prefixes: a sample whose first positions were served from the radix
cache borrows them from an earlier captured request (planning.Borrow); the token ids joined
there must be the ones the server matched, by the digest its index line recorded. Merge and
the dataset readers check the tokens they assemble (`mismatch`); verify reads only the token
ids of the borrowed pieces (`read_tokens`), so it checks every joined sample cheaply."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from hs_capture.dump import hst
from hs_capture.dump.paths import FINAL
from hs_capture.dump.token_hash import prefix_hashes
from hs_capture.offline.read.planning import Borrow, Piece, Plan


def mismatch(borrows: Sequence[Borrow], tokens: Sequence[int]) -> Optional[str]:
    """Why the joined prefixes of a sample with these token ids are wrong, or None."""
    got = prefix_hashes(tokens, [b.length for b in borrows])
    for b in sorted(borrows, key=lambda b: b.length):
        if not b.src_hash or got[b.length] != b.src_hash:  # tokens too short, or no digest to hold them to
            return (f"positions 0-{b.length} joined from request {b.src!r} hold other token ids than the server "
                    "matched there (their digest differs): not the same prefix")
    return None


def read_tokens(plan: Plan, pieces: List[Piece], upto: int, cache: Optional[Dict[str, np.ndarray]] = None
                ) -> List[int]:
    """The token ids of a sample's positions [0, upto), read from its pieces' final-state files
    (the token tensor alone; `cache`: path -> ids, shared by the calls of one check).
    OSError or hst.FormatError when a file cannot be read."""
    cache = {} if cache is None else cache
    out: List[int] = []
    for pc in pieces:
        if pc.prefix >= upto:
            break
        path = os.path.join(plan.runs[pc.run].path, dict(pc.files)[FINAL])
        ids = cache.get(path)
        if ids is None:
            with hst.opened(path) as (f, header):
                e = header.tensors["input_ids"]
                ids = cache[path] = hst.to_numpy(hst.read_tensor_bytes(f, header, "input_ids"), e.dtype, e.shape)
        n = min(pc.length, upto - pc.prefix)
        out += np.asarray(ids[pc.offset:pc.offset + n], dtype=np.int64).tolist()
    return out
