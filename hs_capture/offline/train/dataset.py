"""Read `hscap merge --format hscap` output: a torch Dataset with random access.

Opening reads only index.json, through the format's own reader (the one verify uses: an
unknown version, or a shard path leaving the directory, is refused in one line); each item
decodes just its own tensors from its shard (headers cached per shard; no file handle is
kept, so DataLoader workers are fine).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from hs_capture.offline.formats import FORMATS, NATIVE, NATIVE_ITEM_KEYS, SampleRef


def _ignore(message: str, path: str) -> None:
    """Files beside the listed samples are verify's concern, not a reader's."""


class HsCaptureDataset(torch.utils.data.Dataset):
    """Items are dicts: input_ids (T,), loss_mask (T,), aux_hidden_state (T, K*H),
    hidden_state (T, H) post-norm, and prenorm_hidden_state (T, H) when captured.
    ListingError: index.json cannot be used (the message says why)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.format = FORMATS[NATIVE]
        if not self.format.marks(path):
            raise FileNotFoundError(f"{path}: no {self.format.pattern}: not `hscap merge --format {NATIVE}` output")
        # only what the listing names: [] files, no walk of the directory
        self.samples: List[SampleRef] = self.format.discover(path, [], _ignore, None)
        self._by_id = {s.rid: i for i, s in enumerate(self.samples)}
        self._headers: Dict = {}  # the format's memo across loads (shard headers)

    def __len__(self) -> int:
        return len(self.samples)

    def ids(self) -> List[str]:
        return [s.rid for s in self.samples]

    def by_id(self, rid: str) -> Dict[str, torch.Tensor]:
        return self[self._by_id[rid]]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.format.load(self.samples[i], self._headers, as_torch=True)
        # clone: the tensors share read-only bytes, and training code may write in place
        return {key: getattr(s, field).clone() for field, key in NATIVE_ITEM_KEYS if getattr(s, field) is not None}
