"""hs_capture's own format (`--format hscap`): packed .hst shards, shards/part-<i>of<N>-<k>.hst
(~1 GB of states each, cut between samples), one tensor per sample and kind ("<row>/aux",
"<row>/final", "<row>/input_ids", "<row>/loss_mask", "<row>/prenorm"), plus index.json
listing (rid, row, shard, tokens). The header's offsets give random access (HsCaptureDataset);
its metadata lists the shard's samples, so the index can be rebuilt from headers alone.
read_index is the one reader of index.json (verify and HsCaptureDataset both go through it)."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from hs_capture.dump import hst as fmt
from hs_capture.dump.files import atomic_write
from hs_capture.dump.paths import NATIVE_INDEX, TEMP_MARK, TENSOR_SUFFIX, inside
from hs_capture.offline.formats.base import Cut, ListingError, Output, Problem, Row, SampleRef, TrainingFormat, \
    stored_width
from hs_capture.offline.formats.common import aux_of, dtype_name
from hs_capture.offline.formats.merged_sample import MergedSample

NATIVE = "hscap"
SHARD_DIR = "shards"
SHARD_RAW_BYTES = 1 << 30  # ~1 GB of raw states per shard (merge memory follows)
KINDS = ("aux", "final", "input_ids", "loss_mask", "prenorm")  # the tensors of one sample
# a sample's tensor kinds -> the keys a reader's items carry (SpecForge's names, and the pre-norm state)
ITEM_KEYS = (("aux", "aux_hidden_state"), ("final", "hidden_state"), ("input_ids", "input_ids"),
             ("loss_mask", "loss_mask"), ("prenorm", "prenorm_hidden_state"))


def record(s, loss_mask) -> Dict[str, object]:
    """One sample as HsCaptureDataset's items hold it (and a shard stores it, by kind)."""
    import torch

    rec = {"aux_hidden_state": aux_of(s).contiguous(), "hidden_state": s.final.clone(),
           "input_ids": s.input_ids.clone(), "loss_mask": loss_mask.to(torch.int64)}
    if s.prenorm is not None:
        rec["prenorm_hidden_state"] = s.prenorm.clone()
    return rec
INDEX_FORMAT = "hscap-dataset"
INDEX_VERSION = 1  # FORMAT.md: a reader refuses any other with one line


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
        rec = record(s, mask)
        tensors += [raw(f"{row}/{kind}", rec[key]) for kind, key in ITEM_KEYS if key in rec]
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
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "layers": layers, "hidden_size": hidden_size,
             "prenorm": prenorm, "samples": samples}
    atomic_write(os.path.join(out_dir, NATIVE_INDEX), [json.dumps(index).encode()], fsync=False)


def read_index(root: str) -> List[SampleRef]:
    """Every sample index.json lists, in its order (by row). ListingError, in one line: the file
    is unreadable, of another version, or names a shard outside root."""
    path = os.path.join(root, NATIVE_INDEX)
    try:
        with open(path) as f:
            idx = json.load(f)
        version = idx.get("version")
    except (OSError, ValueError, AttributeError) as e:
        raise ListingError(f"native index unreadable: {e}", path) from None
    if version != INDEX_VERSION:
        raise ListingError(f"native index version {version!r}: this hs_capture reads version {INDEX_VERSION} "
                           "(a newer hs_capture wrote it?)", path)
    hidden = idx.get("hidden_size")
    hidden = hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None
    refs = []
    try:
        for rid, row, shard, _n in idx["samples"]:
            # a shard outside the output dir: the index would have readers open any file
            if not inside(shard):
                raise ValueError(f"shard path {shard!r} leaves the dataset dir")
            refs.append(SampleRef(NATIVE, os.path.join(root, shard), str(rid), int(row), str(row), hidden))
    except (ValueError, KeyError, TypeError) as e:
        raise ListingError(f"native index unreadable: {e}", path) from None
    return refs


def read_row(f, header: "fmt.Header", key: str) -> Dict[str, Tuple[bytes, "fmt.TensorEntry"]]:
    """One sample's tensors of an open shard: kind -> (raw bytes, header entry)."""
    out = {}
    for kind in KINDS:
        e = header.tensors.get(f"{key}/{kind}")
        if e is not None:
            out[kind] = (fmt.read_tensor_bytes(f, header, e.name), e)
    return out


def _owns(rel: str) -> bool:
    """index.json, and the shards under shards/."""
    if rel in (NATIVE_INDEX, SHARD_DIR):
        return True
    d, name = os.path.split(rel)
    return d == SHARD_DIR and name.startswith("part-") and name.endswith(TENSOR_SUFFIX)



class Native(TrainingFormat):
    name = NATIVE
    what = "hs_capture's packed .hst shards + index.json (HsCaptureDataset reads it)"
    pattern = NATIVE_INDEX
    data_dir = SHARD_DIR
    listings = (NATIVE_INDEX,)

    def plan_outputs(self, rows: Sequence[Row], shard: Tuple[int, int], cut: Cut) -> List[Output]:
        # shards are cut from the step order by size alone (never by -j): a re-run with any -j
        # finds the same shards, and skips those that exist
        return [Output(shard_name(*shard, k), run) for k, run in enumerate(cut(rows, SHARD_RAW_BYTES))]

    def record(self, s, loss_mask) -> Dict[str, object]:
        return record(s, loss_mask)

    def write(self, path: str, samples: Sequence[tuple]) -> int:
        return write_shard(path, sorted(samples, key=lambda x: x[0]))

    def finish(self, out_dir: str, layers: List[int], hidden_size: int, prenorm: bool) -> None:
        write_index(out_dir, layers, hidden_size, prenorm)

    def owns(self, rel: str) -> bool:
        return _owns(rel)

    def marks(self, root: str) -> bool:
        return os.path.isfile(os.path.join(root, NATIVE_INDEX))

    def discover(self, root: str, files: Sequence[str], problem: Problem,
                 order: Optional[Sequence[str]]) -> List[SampleRef]:
        if not self.marks(root):
            return []
        refs = read_index(root)
        named = {os.path.normpath(r.path) for r in refs}
        shard_dir = os.path.normpath(os.path.join(root, SHARD_DIR))
        for path in files:  # shards index.json does not name are extra
            full = os.path.normpath(path)
            if os.path.dirname(full) == shard_dir and full.endswith(TENSOR_SUFFIX) and full not in named:
                problem("shard not listed in index.json", full)
        return refs

    def load(self, ref: SampleRef, cache: Dict, as_torch: bool = False) -> MergedSample:
        convert = fmt.to_torch if as_torch else fmt.to_numpy
        with open(ref.path, "rb") as f:
            header = cache.get(ref.path)
            if header is None:
                header = cache[ref.path] = fmt.read_header(f, os.fstat(f.fileno()).st_size)
            got = {kind: convert(raw, e.dtype, e.shape) for kind, (raw, e) in read_row(f, header, ref.key).items()}
            final = header.tensors.get(f"{ref.key}/final")
        dtype = final.dtype if final is not None else "float32"
        fin = got["final"]
        stored_width(ref, fin.shape[-1])
        return MergedSample(None, got["input_ids"], got["loss_mask"], got["aux"], fin, got.get("prenorm"),
                            fin.shape[-1], dtype)


FORMAT = Native()
