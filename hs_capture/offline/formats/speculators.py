"""vLLM speculators: hs_{row}.safetensors, hidden_states [T, 4, H] = the 3 aux layers + the
PRE-norm final state, token_ids [T]. Rows follow the dataset's order (speculators reads
DATA/hidden_states/hs_<row>.safetensors). The safetensors layout is written and read here
(u64 header length, JSON header, raw little-endian bytes): no dependency on that package,
and a reader that checks every rule with the format's own error classes."""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Optional, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.dump.files import atomic_file
from hs_capture.offline.formats.merged_sample import MergedSample

_ST_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


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


def write(path: str, s, loss_mask) -> int:
    import torch

    hs = torch.stack([*(s.layers[k] for k in sorted(s.layers)), s.prenorm], dim=1).contiguous()
    return atomic_file(path, lambda p: save_safetensors({"hidden_states": hs, "token_ids": s.input_ids.contiguous()},
                                                       p, {"rid": s.rid}))


_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def load_safetensors(path: str, dtypes: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """A safetensors file as float32/int64 numpy arrays (bf16 widened), checked rule by rule.
    `dtypes`, when given, receives each tensor's stored safetensors dtype."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise fmt.HeaderTooSmall(f"{size} bytes: no safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size or n > fmt.MAX_HEADER_BYTES:
            raise (fmt.HeaderTooLarge if n > fmt.MAX_HEADER_BYTES else fmt.Truncated)(
                f"header length {n} runs past the end of the {size}-byte file")
        try:
            header = json.loads(f.read(n))
            meta = header.pop("__metadata__", {}) or {}
        except (ValueError, AttributeError) as e:
            raise fmt.InvalidHeader(f"header is not a JSON object: {e}") from None
        out, end = {}, 0
        for name, e in header.items():
            try:
                a, b = e["data_offsets"]
                shape, dt = [int(x) for x in e["shape"]], e["dtype"]
            except (TypeError, KeyError, ValueError):
                raise fmt.TensorInvalidInfo(f"{name}: incomplete entry") from None
            count = int(np.prod(shape)) if shape else 1
            item = 2 if dt == "BF16" else np.dtype(_NP_DTYPES.get(dt, np.uint8)).itemsize
            if dt not in _NP_DTYPES and dt != "BF16":
                raise fmt.TensorInvalidInfo(f"{name}: dtype {dt} not expected here")
            if b - a != count * item or a < 0:
                raise fmt.InvalidOffset(f"{name}: offsets [{a}, {b}) disagree with shape {shape} of {dt}")
            if 8 + n + b > size:
                raise fmt.Truncated(f"{name}: data ends at {8 + n + b}, past the end of the {size}-byte file")
            f.seek(8 + n + a)
            raw = f.read(b - a)
            if dtypes is not None:
                dtypes[name] = dt
            out[name] = fmt.to_numpy(raw, "bfloat16", shape) if dt == "BF16" else \
                np.frombuffer(raw, dtype=np.dtype(_NP_DTYPES[dt]).newbyteorder("<")).reshape(shape).astype(
                    np.float32 if dt.startswith("F") else np.int64)
            end = max(end, b)
        if 8 + n + end != size:
            raise (fmt.Truncated if 8 + n + end > size else fmt.TrailingBytes)(
                f"payload ends at {8 + n + end} but the file has {size} bytes")
    return out, meta


def load(path: str, key, headers) -> MergedSample:
    dtypes: Dict[str, str] = {}
    arrays, meta = load_safetensors(path, dtypes)
    hs, ids = arrays["hidden_states"], arrays["token_ids"]
    if hs.ndim != 3 or hs.shape[1] != 4:
        raise ValueError(f"hidden_states is {list(hs.shape)}, not [T, 4, H]")
    t, _, h = hs.shape
    return MergedSample(meta.get("rid"), ids, None, hs[:, :3].reshape(t, 3 * h), None, hs[:, 3], h,
                  _ST_NAMES.get(dtypes.get("hidden_states", ""), "float32"))


def _identify(name: str):
    if not (name.startswith("hs_") and name.endswith(".safetensors")):
        return None
    try:
        return None, int(name[3:-len(".safetensors")])
    except ValueError:
        return None, None


def settings(ids, real_mask: bool) -> dict:
    # speculators stores these as the drafter's eagle_aux_hidden_state_layer_ids; vLLM, which
    # serves it, collects the state ENTERING each layer named
    return {"target_layer_ids": ids}


def _format():
    from hs_capture.offline.formats import TrainingFormat

    return TrainingFormat("speculators", "speculators: hs_<row>.safetensors, 3 aux + the pre-norm final state",
                          lambda rid, row: f"hs_{row}.safetensors", _identify, write, load,
                          needs_prenorm=True, aux_layers=3, served_by="vllm", settings=settings)


FORMAT = _format()
