"""The training formats `hscap merge` writes, one function each (DESIGN.md section 5).

The per-sample writers get one assembled sample and write one file; the native writer
packs many samples into one shard. Every file is written atomically (hidden temp name, then
rename), so a killed merge never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Callable, Dict

import torch

from .assemble import SampleTensors
from .layout import NATIVE_INDEX, safe_component, temp_name

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
              torch.int32: "I32"}


def sample_file_stem(rid: str) -> str:
    """A path-safe, collision-free file stem for a sample id."""
    digest = hashlib.sha1(rid.encode()).hexdigest()[:10]
    return f"{safe_component(rid, 80)}-{digest}"


def _atomic(path: str, write: Callable[[str], None]) -> int:
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return os.path.getsize(path)


def _aux(s: SampleTensors) -> torch.Tensor:
    return torch.cat([s.layers[k] for k in sorted(s.layers)], dim=-1)


def write_specforge(path: str, s: SampleTensors, loss_mask: torch.Tensor) -> int:
    """SpecForge offline EAGLE-3: one torch.save dict per sample, *.ckpt (globbed recursively)."""
    data = {"input_ids": s.input_ids.clone(), "loss_mask": loss_mask.to(torch.int64),
            "aux_hidden_state": _aux(s).unsqueeze(0).contiguous(), "hidden_state": s.final.unsqueeze(0).clone()}
    return _atomic(path, lambda p: torch.save(data, p))


def write_modelopt(path: str, s: SampleTensors, loss_mask: torch.Tensor) -> int:
    """NVIDIA ModelOpt: {conversation_id}.pt, loadable with weights_only=True."""
    data = {"conversation_id": s.rid, "input_ids": s.input_ids.clone(), "hidden_states": s.final.clone(),
            "aux_hidden_states": _aux(s).contiguous(), "loss_mask": loss_mask.to(torch.int64),
            "hidden_states_prenorm": False}
    return _atomic(path, lambda p: torch.save(data, p))


def write_speculators(path: str, s: SampleTensors, loss_mask: torch.Tensor) -> int:
    """vLLM speculators: hs_{row}.safetensors, hidden_states [T, 4, H] = 3 aux + PRE-norm final."""
    if s.prenorm is None:
        raise ValueError("speculators needs the pre-norm final state: capture with HSCAP_PRENORM=1")
    if len(s.layers) != 3:
        raise ValueError(f"speculators takes exactly 3 aux layers, the dump has {sorted(s.layers)}")
    hs = torch.stack([*(s.layers[k] for k in sorted(s.layers)), s.prenorm], dim=1).contiguous()
    return _atomic(path, lambda p: save_safetensors({"hidden_states": hs, "token_ids": s.input_ids.contiguous()},
                                                    p, {"rid": s.rid}))


def save_safetensors(tensors: Dict[str, torch.Tensor], path: str, metadata: Dict[str, str]) -> None:
    """The safetensors layout (u64 header length, JSON header, raw little-endian bytes),
    written here so hs_capture does not depend on the safetensors package."""
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            if t.numel():
                f.write(t.view(torch.uint8).numpy().tobytes())


# format -> (file name for (rid, row), writer)
FORMATS = {
    "specforge": (lambda rid, row: sample_file_stem(rid) + ".ckpt", write_specforge),
    "modelopt": (lambda rid, row: sample_file_stem(rid) + ".pt", write_modelopt),
    "speculators": (lambda rid, row: f"hs_{row}.safetensors", write_speculators),
}


# ---------------------------------------------------------------- native packed shards
HSCAP_INDEX = NATIVE_INDEX


def write_hscap_shard(path: str, items, codec: str = "bytegroup", level: int = 1) -> int:
    """One .hst file holding many samples: tensors "<row>/aux", "<row>/final", "<row>/input_ids",
    "<row>/loss_mask" (and "<row>/prenorm"); the header's offsets give random access, and
    its metadata lists the samples, so the index can be rebuilt from headers alone.
    items: (row, SampleTensors, loss_mask) triples."""
    from . import format as fmt

    def raw(name: str, t: torch.Tensor) -> "fmt.RawTensor":
        t = t.contiguous()
        data = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        return fmt.RawTensor(name, str(t.dtype).replace("torch.", ""), list(t.shape), data)

    tensors, listing = [], []
    for row, s, mask in items:
        tensors += [raw(f"{row}/aux", _aux(s)), raw(f"{row}/final", s.final),
                    raw(f"{row}/input_ids", s.input_ids), raw(f"{row}/loss_mask", mask.to(torch.int64))]
        if s.prenorm is not None:
            tensors.append(raw(f"{row}/prenorm", s.prenorm))
        listing.append([s.rid, row, len(s.input_ids)])
    chunks = fmt.encode_file(tensors, {"samples": json.dumps(listing)}, codec, level)
    return _atomic(path, lambda p: _write_chunks(p, chunks))


def _write_chunks(path: str, chunks) -> None:
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
