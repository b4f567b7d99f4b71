"""hs_capture's own format (`--format hscap`): packed .hst shards, shards/part-<i>of<N>-<k>.hst
(~1 GB of states each, cut between samples), one tensor per sample and kind ("<row>/aux",
"<row>/final", "<row>/input_ids", "<row>/loss_mask", "<row>/prenorm"), plus index.json
listing (rid, row, shard, tokens). The header's offsets give random access (HsCaptureDataset);
its metadata lists the shard's samples, so the index can be rebuilt from headers alone."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

from hs_capture.dump import hst as fmt
from hs_capture.dump.files import atomic_write
from hs_capture.dump.paths import NATIVE_INDEX, TEMP_MARK, TENSOR_SUFFIX
from hs_capture.offline.formats.common import aux_of, dtype_name
from hs_capture.offline.formats.merged_sample import MergedSample

SHARD_DIR = "shards"
KINDS = ("aux", "final", "input_ids", "loss_mask", "prenorm")  # the tensors of one sample


def shard_name(part: int, parts: int, k: int) -> str:
    return os.path.join(SHARD_DIR, f"part-{part}of{parts}-{k:06d}{TENSOR_SUFFIX}")


def write_shard(path: str, items, codec: str = "bytegroup", level: int = 1) -> int:
    """One shard holding many samples. items: (row, AssembledSample, loss_mask) triples."""
    import torch

    def raw(name: str, t) -> "fmt.RawTensor":
        t = t.contiguous()
        data = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        return fmt.RawTensor(name, dtype_name(t), list(t.shape), data)

    tensors, listing = [], []
    for row, s, mask in items:
        tensors += [raw(f"{row}/aux", aux_of(s)), raw(f"{row}/final", s.final),
                    raw(f"{row}/input_ids", s.input_ids), raw(f"{row}/loss_mask", mask.to(torch.int64))]
        if s.prenorm is not None:
            tensors.append(raw(f"{row}/prenorm", s.prenorm))
        listing.append([s.rid, row, len(s.input_ids)])
    chunks = fmt.encode_file(tensors, {"samples": json.dumps(listing)}, codec, level)
    return atomic_write(path, chunks, fsync=False)


def write_index(out_dir: str, layers: List[int], hidden_size: int, prenorm: bool) -> None:
    """index.json from the shard headers alone (every --shard run rebuilds it from all shards)."""
    samples = []
    shard_dir = os.path.join(out_dir, SHARD_DIR)
    for name in sorted(os.listdir(shard_dir)):
        if name.endswith(TENSOR_SUFFIX) and TEMP_MARK not in name:
            with open(os.path.join(shard_dir, name), "rb") as f:
                header = fmt.read_header(f, os.fstat(f.fileno()).st_size)
            samples += [[rid, row, os.path.join(SHARD_DIR, name), n]
                        for rid, row, n in json.loads(header.metadata["samples"])]
    samples.sort(key=lambda x: x[1])
    index = {"format": "hscap-dataset", "version": 1, "layers": layers, "hidden_size": hidden_size,
             "prenorm": prenorm, "samples": samples}
    atomic_write(os.path.join(out_dir, NATIVE_INDEX), [json.dumps(index).encode()], fsync=False)


def read_row(f, header: "fmt.Header", key: str) -> Dict[str, Tuple[bytes, "fmt.TensorEntry"]]:
    """One sample's tensors of an open shard: kind -> (raw bytes, header entry)."""
    out = {}
    for kind in KINDS:
        e = header.tensors.get(f"{key}/{kind}")
        if e is not None:
            out[kind] = (fmt.read_tensor_bytes(f, header, e.name), e)
    return out


def load(path: str, key: str, headers: Dict[str, "fmt.Header"]) -> MergedSample:
    with open(path, "rb") as f:
        header = headers.get(path)
        if header is None:
            header = headers[path] = fmt.read_header(f, os.fstat(f.fileno()).st_size)
        got = {kind: fmt.to_numpy(raw, e.dtype, e.shape) for kind, (raw, e) in read_row(f, header, key).items()}
        dtype = header.tensors[f"{key}/final"].dtype if f"{key}/final" in header.tensors else "float32"
    fin = got["final"]
    return MergedSample(None, got["input_ids"], got["loss_mask"], got["aux"], fin, got.get("prenorm"), fin.shape[-1], dtype)


def _format():
    from hs_capture.offline.formats import TrainingFormat

    return TrainingFormat("hscap", "hs_capture's packed .hst shards + index.json (HsCaptureDataset reads it)",
                          None, lambda name: None, write_shard, load, owns_path=_owns)


def _owns(rel: str) -> bool:
    """index.json, and the shards under shards/."""
    if rel in (NATIVE_INDEX, SHARD_DIR):
        return True
    d, name = os.path.split(rel)
    return d == SHARD_DIR and name.startswith("part-") and name.endswith(TENSOR_SUFFIX)


FORMAT = _format()
