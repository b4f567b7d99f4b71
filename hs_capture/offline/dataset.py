"""Read `hscap merge --format hscap` output: a torch Dataset with random access.

Opening reads only index.json; each item decodes just its own tensors from its shard
(headers are cached per shard, file handles per process, so DataLoader workers are fine).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch

from hs_capture.dump import hst as fmt
from hs_capture.offline.formats import native
from hs_capture.dump.paths import NATIVE_INDEX


# the native format's tensor kinds -> the item keys (SpecForge's names, and the pre-norm state)
_KEYS = {"aux": "aux_hidden_state", "final": "hidden_state", "input_ids": "input_ids", "loss_mask": "loss_mask",
         "prenorm": "prenorm_hidden_state"}


class HsCaptureDataset(torch.utils.data.Dataset):
    """Items are dicts: input_ids (T,), loss_mask (T,), aux_hidden_state (T, K*H),
    hidden_state (T, H) post-norm, and prenorm_hidden_state (T, H) when captured."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(os.path.join(path, NATIVE_INDEX)) as f:
            self.index = json.load(f)
        self.samples: List[Tuple[str, int, str, int]] = [tuple(x) for x in self.index["samples"]]
        self._by_id = {rid: i for i, (rid, _, _, _) in enumerate(self.samples)}
        self._headers: Dict[str, fmt.Header] = {}
        self._files: Dict[str, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.samples)

    def ids(self) -> List[str]:
        return [s[0] for s in self.samples]

    def by_id(self, rid: str) -> Dict[str, torch.Tensor]:
        return self[self._by_id[rid]]

    def _open(self, shard: str):
        if self._pid != os.getpid():  # a DataLoader worker: handles do not cross fork
            self._files, self._pid = {}, os.getpid()
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(os.path.join(self.path, shard), "rb")
            if shard not in self._headers:
                self._headers[shard] = fmt.read_header(f, os.fstat(f.fileno()).st_size)
        return f, self._headers[shard]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        rid, row, shard, _ = self.samples[i]
        f, header = self._open(shard)
        # clone: to_torch shares read-only bytes, and training code may write in place
        return {_KEYS[kind]: fmt.to_torch(raw, e.dtype, e.shape).clone()
                for kind, (raw, e) in native.read_row(f, header, str(row)).items()}
