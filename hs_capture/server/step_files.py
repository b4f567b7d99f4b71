"""One captured step on disk: a .hst file per part (each captured layer, the final state with
the batch's token ids and positions beside it, the pre-norm state), each written atomically,
then the directories synced. Nothing is indexed here: the writer commits the step after."""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Tuple

import torch

from hs_capture.dump import files
from hs_capture.dump import hst as fmt
from hs_capture.dump.files import fsync_dir, remove_quietly
from hs_capture.dump.paths import FINAL, RankId, part_name, step_file
from hs_capture.dump.schema import FileRef

# The batch's own inputs, stored beside the final state. SGLang refills their buffers for the
# next batch while this step is still being copied: staging owns them first (staging.py).
INPUT_PARTS = ("tokens", "positions")
def split_parts(tensors: Mapping[str, torch.Tensor], aux_layers: List[int]) -> Dict[str, torch.Tensor]:
    """SGLang's packed aux [T, K*H] cut into one view per layer (L02, L30, ...), on the host."""
    parts = {}
    for name, t in tensors.items():
        if name == "aux":
            width = t.shape[-1] // max(1, len(aux_layers))
            for j, layer in enumerate(aux_layers):
                parts[part_name(layer)] = t[..., j * width:(j + 1) * width]  # a view: encoded in place
        else:
            parts[name] = t
    return parts


def _raw(name: str, t: torch.Tensor) -> fmt.RawTensor:
    return fmt.RawTensor(name, fmt.dtype_name(t.dtype), list(t.shape), _bytes_of(t))


def write_step_files(run_dir: str, rank: RankId, step: int, header: Dict[str, str], tensors: Mapping[str, torch.Tensor],
                     aux_layers: List[int], codec: str, level: int, fsync: bool) -> Tuple[Dict[str, FileRef], int, int]:
    """Every part's file, or none (a failure removes those already written). Returns the
    index line's `files` ({part: FileRef}), the raw bytes and the bytes on disk."""
    written: Dict[str, FileRef] = {}
    raw_total = file_total = 0
    dirs = set()
    for part, t in split_parts(tensors, aux_layers).items():
        if part in INPUT_PARTS:
            continue  # stored beside the final state, below
        rel = step_file(rank, step, part)
        raws = [_raw("hidden", t)]
        if part == FINAL:
            raws += [_raw("input_ids", tensors["tokens"]), _raw("positions", tensors["positions"])]
        path = os.path.join(run_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dirs.add(os.path.dirname(path))
        chunks = fmt.encode_file(raws, {**header, "part": part}, codec, level)
        try:
            size = files.atomic_write(path, chunks, fsync)
        except BaseException:
            remove_step_files(run_dir, written)
            raise
        written[part] = FileRef(rel, size)
        raw_total += sum(x.data.nbytes for x in raws)
        file_total += size
    if fsync:
        for d in dirs:
            fsync_dir(d)
    return written, raw_total, file_total


def remove_step_files(run_dir: str, written: Mapping[str, FileRef]) -> None:
    remove_quietly(os.path.join(run_dir, f.path) for f in written.values())


def _bytes_of(t: torch.Tensor):
    """The tensor's bytes without a copy: a buffer, or for a column block of a 2-D tensor
    (rows contiguous, not adjacent) a 2-D uint8 array that format.encode_file reads row-wise."""
    if not t.numel():
        return memoryview(b"")
    if t.is_contiguous():
        return memoryview(t.view(torch.uint8).numpy())
    if t.dim() == 2 and t.stride(-1) == 1:
        return t.view(torch.uint8).numpy()
    return memoryview(t.contiguous().view(torch.uint8).numpy())
