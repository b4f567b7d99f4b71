"""Steps cut from back-to-back samples of random length, as chunked prefill packs them (a
sample may continue in the next step): the index entries of synthetic dumps written by the
real writer, for tests and benchmarks."""

from __future__ import annotations

import random
from typing import List, Tuple

import torch

from hs_capture.dump.schema import SeqEntry


def chained_steps(rng: random.Random, steps: int, step_tokens: int, lo: int, hi: int
                  ) -> Tuple[List[List[SeqEntry]], int]:
    """(each step's sequence entries, how many samples end within them: rids s0..s<n-1>).
    Sample lengths are rng.randrange(lo, hi); every step holds exactly step_tokens rows."""
    out = []
    rid, left, pos = 0, rng.randrange(lo, hi), 0
    for _ in range(steps):
        seqs, t = [], 0
        while t < step_tokens:
            n = min(left, step_tokens - t)
            seqs.append(SeqEntry(f"s{rid}", n, pos, t))
            t, left, pos = t + n, left - n, pos + n
            if left == 0:
                rid, left, pos = rid + 1, rng.randrange(lo, hi), 0
        out.append(seqs)
    return out, rid


def positions(seqs: List[SeqEntry]) -> torch.Tensor:
    """The step's stored positions: each entry's prefix .. prefix+len."""
    return torch.cat([torch.arange(s.prefix, s.prefix + s.len) for s in seqs])
