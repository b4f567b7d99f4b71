"""Stitch requests back together from one or more dumps (offline; never imports sglang):
`Assembler` decodes step files through a byte-bounded LRU cache and returns each planned
sample's tensors (planning.py) in the stored dtype (the compact tier's dequantized to bfloat16).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from hs_capture.dump import hst as fmt
from hs_capture.dump.paths import FINAL, PRENORM, part_name
from hs_capture.offline.read.borrowed import mismatch
from hs_capture.offline.read.inputs import Inputs
from hs_capture.offline.read.planning import Piece, Plan
from hs_capture.offline.read.reader import DumpError, first_mismatch


class TokensDiffer(DumpError):
    """A sample's captured token ids are not the dataset's."""


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
        self.bytes_read = 0  # file bytes read
        self.bytes_decoded = 0  # raw state bytes decoded from them

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
                with fmt.opened(path) as (f, header):
                    parts[part] = fmt.read_tensors(f, header)  # the compact tier comes back bfloat16
                    self.bytes_read += os.fstat(f.fileno()).st_size
            except (OSError, fmt.FormatError) as e:
                raise DumpError(f"{rel}: {e}") from None
            size += sum(t.numel() * t.element_size() for t in parts[part].values())
        self._cache[key] = parts
        self._cached += size
        self.bytes_decoded += size
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= sum(t.numel() * t.element_size() for p in old.values() for t in p.values())
        return parts

    def sample(self, rid: str, views: bool = False) -> AssembledSample:
        """views: a one-piece sample's tensors are views of the cached step (no copy), for a
        caller that copies what it keeps at once (a view keeps the whole decoded step alive)."""
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
        cat = (lambda ts: ts[0]) if views and len(pieces) == 1 else torch.cat
        input_ids = cat(ids).to(torch.int64)
        if rid in self.plan.borrows:
            why = mismatch(self.plan.borrows[rid], input_ids.tolist())
            if why:
                raise TokensDiffer(why)
        return AssembledSample(rid, input_ids, {k: cat(v) for k, v in layers.items()},
                             cat(final), cat(pre) if pre else None)


def with_loss_mask(asm: Assembler, rid: str, ds: Optional[Inputs],
                   views: bool = False) -> Tuple[AssembledSample, torch.Tensor]:
    """A planned sample and its loss mask (the dataset's, else all ones): what merge writes and
    DumpDataset hands out (views: Assembler.sample's). DumpError: a file is gone or corrupt;
    TokensDiffer: its captured tokens are not the dataset's."""
    s = asm.sample(rid, views)
    if ds is not None:
        k = first_mismatch(s.input_ids.tolist(), ds.ids[rid])
        if k is not None:
            raise TokensDiffer(f"token ids differ from the dataset at position {k}")
    mask = ds.masks.get(rid) if ds is not None else None
    if mask is None:
        return s, torch.ones(len(s.input_ids), dtype=torch.int64)
    return s, torch.tensor(mask, dtype=torch.int64)
