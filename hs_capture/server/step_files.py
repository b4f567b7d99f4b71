"""One captured step on disk: a .hst file per part (each captured layer, the final state with
the batch's token ids and positions beside it, the pre-norm state), each written atomically,
then the directories synced. Nothing is indexed here: the writer commits the step after.

Torch-free: a step arrives as one host buffer and the place of each tensor in it (`Placed`),
so the same code writes in the server's process and in the writer process.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Dict, List, Mapping, NamedTuple, Sequence, Tuple

import numpy as np

from hs_capture.dump import files
from hs_capture.dump import hst as fmt
from hs_capture.dump.files import fsync_dir, remove_quietly
from hs_capture.dump.quant import SCALE_TENSOR
from hs_capture.dump.paths import FINAL, RankId, part_name, step_file
from hs_capture.dump.schema import FileRef

# The batch's own inputs, stored beside the final state. SGLang refills their buffers for the
# next batch while this step is still being copied: staging owns them first (staging.py).
INPUT_PARTS = ("tokens", "positions")
SCALE = "#scale"  # a quantized state's scale (step.compact): stored in its part's file


class Placed(NamedTuple):
    """Where one tensor of a step lies in its host buffer."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


def tensor_bytes(memory: np.ndarray, p: Placed) -> np.ndarray:
    """The tensor's bytes in the buffer, without a copy (uint8)."""
    return memory[p.offset:p.offset + p.nbytes]


def split_parts(memory: np.ndarray, layout: Sequence[Placed], aux_layers: List[int]) -> Dict[str, fmt.RawTensor]:
    """Each part's tensor as the .hst encoder takes it; SGLang's packed aux [T, K*H] cut into one
    column block per layer (L02, L30, ...), on the host, without a copy."""
    parts: Dict[str, fmt.RawTensor] = {}
    for p in layout:
        data = tensor_bytes(memory, p)
        if p.name == "aux" and aux_layers and len(p.shape) == 2:
            rows, cols = p.shape
            width = cols // len(aux_layers)
            blocks = data.reshape(rows, -1) if rows else None
            wb = blocks.shape[1] // len(aux_layers) if rows else 0
            for j, layer in enumerate(aux_layers):  # a column block: rows contiguous, not adjacent
                block = blocks[:, j * wb:(j + 1) * wb] if rows else memoryview(b"")
                parts[part_name(layer)] = fmt.RawTensor("hidden", p.dtype, [rows, width], block)
        elif p.name.endswith(SCALE):
            parts[p.name] = fmt.RawTensor(SCALE_TENSOR, p.dtype, list(p.shape), memoryview(data))
        else:
            parts[p.name] = fmt.RawTensor("hidden", p.dtype, list(p.shape), memoryview(data))
    for name in [n for n in parts if n.endswith(SCALE)]:
        part = name[:-len(SCALE)]
        if part not in parts:
            raise ValueError(f"a scale for {part!r}, which the step does not hold")
        parts[part] = replace(parts[part], scale=SCALE_TENSOR)
    return parts


def write_step_files(run_dir: str, rank: RankId, step: int, header: Dict[str, str], memory: np.ndarray,
                     layout: Sequence[Placed], aux_layers: List[int], codec: str, level: int,
                     fsync: bool) -> Tuple[Dict[str, FileRef], int, int]:
    """Every part's file, or none (a failure removes those already written). Returns the
    index line's `files` ({part: FileRef}), the raw bytes and the bytes on disk."""
    written: Dict[str, FileRef] = {}
    raw_total = file_total = 0
    dirs = set()
    parts = split_parts(memory, layout, aux_layers)
    for part, t in parts.items():
        if part in INPUT_PARTS or part.endswith(SCALE):
            continue  # stored beside the final state, or beside its state, below
        rel = step_file(rank, step, part)
        raws = [t] + ([parts[part + SCALE]] if part + SCALE in parts else [])
        if part == FINAL:
            raws += [replace(parts["tokens"], name="input_ids"), replace(parts["positions"], name="positions")]
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
        raw_total += sum(_nbytes(x.data) for x in raws)
        file_total += size
    if fsync:
        for d in dirs:
            fsync_dir(d)
    return written, raw_total, file_total


def _nbytes(data) -> int:
    return data.size if isinstance(data, np.ndarray) else memoryview(data).nbytes


def remove_step_files(run_dir: str, written: Mapping[str, FileRef]) -> None:
    remove_quietly(os.path.join(run_dir, f.path) for f in written.values())
