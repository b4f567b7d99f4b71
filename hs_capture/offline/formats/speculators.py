"""vLLM speculators: hs_{row}.safetensors, hidden_states [T, 4, H] = the 3 aux layers + the
PRE-norm final state, token_ids [T]. Rows follow the dataset's order (speculators reads
DATA/hidden_states/hs_<row>.safetensors). The safetensors layout is written and read here
(u64 header length, JSON header, raw little-endian bytes): no dependency on that package,
and a reader that checks every rule with the format's own error classes (hst's)."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.offline.formats.base import PerSampleFormat, SampleRef
from hs_capture.offline.formats.merged_sample import MergedSample

# safetensors dtype -> hs_capture's name; the states are floats, the token ids integers
_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32"}
_FLOATS = ("BF16", "F16", "F32")
_INTS = ("I64", "I32")


def _st_dtype(t) -> str:
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
            "int32": "I32"}[str(t.dtype).replace("torch.", "")]


def save_safetensors(tensors: Dict[str, Any], path: str, metadata: Dict[str, str]) -> None:
    """The safetensors layout (u64 header length, JSON header, raw little-endian bytes),
    written here so hs_capture does not depend on the safetensors package."""
    import torch

    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _st_dtype(t), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
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


RawEntry = Tuple[bytes, str, List[int]]  # (bytes, safetensors dtype, shape)


def read_safetensors(path: str) -> Tuple[Dict[str, RawEntry], Dict[str, str]]:
    """A safetensors file's tensors as raw bytes, and its metadata, checked rule by rule in
    safetensors' order; every broken rule raises its hst.FormatError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise fmt.HeaderTooSmall(f"{size} bytes: no safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size or n > fmt.MAX_HEADER_BYTES:
            raise (fmt.HeaderTooLarge if n > fmt.MAX_HEADER_BYTES else fmt.Truncated)(
                f"header length {n} runs past the end of the {size}-byte file")
        try:
            header = json.loads(f.read(n), object_pairs_hook=fmt.no_duplicate_keys)
            meta = header.pop("__metadata__", {}) or {}
        except (ValueError, AttributeError, RecursionError) as e:
            raise fmt.InvalidHeader(f"header is not a JSON object: {e}") from None
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise fmt.InvalidHeader("__metadata__ must map strings to strings")
        entries = []
        for name, e in header.items():
            try:
                a, b = e["data_offsets"]
                shape, dt = e["shape"], e["dtype"]
            except (TypeError, KeyError, ValueError):
                raise fmt.TensorInvalidInfo(f"{name}: incomplete entry") from None
            if dt not in _NAMES:
                raise fmt.TensorInvalidInfo(f"{name}: dtype {dt} not expected here")
            if not isinstance(shape, list) or not all(fmt.is_count(x) for x in shape):
                raise fmt.TensorInvalidInfo(f"{name}: bad shape {shape!r}")
            if not (fmt.is_count(a) and fmt.is_count(b)) or b - a != math.prod(shape) * fmt.ITEMSIZE[_NAMES[dt]]:
                raise fmt.InvalidOffset(f"{name}: offsets [{a}, {b}) disagree with shape {shape} of {dt}")
            entries.append((a, b, name, dt, shape))
        end = 0
        for a, b, name, _, _ in sorted(entries, key=lambda x: (x[0], x[1])):
            if a != end:  # the buffer is the tensors back to back: no gap, no overlap
                raise fmt.InvalidOffset(f"{name}: offsets [{a}, {b}) leave a gap or overlap")
            end = b
        if 8 + n + end != size:
            raise (fmt.Truncated if 8 + n + end > size else fmt.TrailingBytes)(
                f"payload ends at {8 + n + end} but the file has {size} bytes")
        out = {}
        for a, b, name, dt, shape in entries:
            f.seek(8 + n + a)
            out[name] = (f.read(b - a), dt, shape)
    return out, meta


def _to_numpy(raw: bytes, dt: str, shape: Sequence[int]) -> np.ndarray:
    """Floats as float32 (bf16 widened), integers as int64."""
    if dt == "BF16":
        return fmt.to_numpy(raw, "bfloat16", shape)
    return fmt.to_numpy(raw, _NAMES[dt], shape).astype(np.float32 if dt in _FLOATS else np.int64)


def load_safetensors(path: str, dtypes: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """A safetensors file as float32/int64 numpy arrays (bf16 widened), checked rule by rule.
    `dtypes`, when given, receives each tensor's stored safetensors dtype."""
    entries, meta = read_safetensors(path)
    if dtypes is not None:
        dtypes.update({name: dt for name, (_, dt, _) in entries.items()})
    return {name: _to_numpy(*e) for name, e in entries.items()}, meta


def _identify(name: str):
    if not (name.startswith("hs_") and name.endswith(".safetensors")):
        return None
    try:
        return None, int(name[3:-len(".safetensors")])
    except ValueError:
        return None, None


class Speculators(PerSampleFormat):
    name = "speculators"
    what = "speculators: hs_<row>.safetensors, 3 aux + the pre-norm final state"
    pattern = "hs_*.safetensors"
    needs_prenorm = True
    aux_layers = 3
    served_by = "vllm"

    def file_name(self, rid: str, row: int) -> str:
        return f"hs_{row}.safetensors"

    def identify(self, name: str):
        return _identify(name)

    def record(self, s, loss_mask) -> Dict[str, object]:
        import torch

        return {"hidden_states": torch.stack([*(s.layers[k] for k in sorted(s.layers)), s.prenorm], dim=1).contiguous(),
                "token_ids": s.input_ids.clone()}

    def save(self, path: str, record: Dict[str, object], rid: str) -> None:
        save_safetensors(record, path, {"rid": rid})  # the id rides in the metadata

    def load(self, ref: SampleRef, cache: Dict, as_torch: bool = False) -> MergedSample:
        entries, meta = read_safetensors(ref.path)
        hs_raw, hs_dt, hs_shape = entries["hidden_states"]
        ids_raw, ids_dt, ids_shape = entries["token_ids"]
        if hs_dt not in _FLOATS or ids_dt not in _INTS:
            raise fmt.TensorInvalidInfo(f"hidden_states is {hs_dt} and token_ids {ids_dt}: "
                                        f"the format takes {'/'.join(_FLOATS)} states and {'/'.join(_INTS)} ids")
        if len(ids_shape) != 1:
            raise fmt.TensorInvalidInfo(f"token_ids is {ids_shape}, not [T]")
        t, k = ids_shape[0], self.aux_layers + 1
        # H: the hidden size the merge recorded, else the file's own (all verify can know then)
        h = ref.hidden_size if ref.hidden_size is not None else hs_shape[-1] if hs_shape else 0
        if hs_shape != [t, k, h]:
            raise fmt.TensorInvalidInfo(f"hidden_states is {hs_shape}, not [T, {k}, H] = {[t, k, h]}")
        if as_torch:
            hs, ids = fmt.to_torch(hs_raw, _NAMES[hs_dt], hs_shape), fmt.to_torch(ids_raw, _NAMES[ids_dt], ids_shape)
        else:
            hs, ids = _to_numpy(hs_raw, hs_dt, hs_shape), _to_numpy(ids_raw, ids_dt, ids_shape)
        return MergedSample(meta.get("rid"), ids, None, hs[:, :k - 1].reshape(t, (k - 1) * h), None, hs[:, k - 1], h,
                            _NAMES[hs_dt])

    def settings(self, ids: Optional[Sequence[int]], real_mask: bool) -> Dict[str, object]:
        # speculators stores these as the drafter's eagle_aux_hidden_state_layer_ids; vLLM, which
        # serves it, collects the state ENTERING each layer named
        return {"target_layer_ids": ids}


FORMAT = Speculators()
