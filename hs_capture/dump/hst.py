"""The .hst tensor file: one captured part of one step (part of the dump contract).

Layout (modelled on safetensors, FORMAT.md has the full rules):

    8 bytes   magic b"HSCAPT\\x00\\x01"
    8 bytes   N, little-endian u64: header length
    N bytes   UTF-8 JSON header, space-padded so the payload starts 8-byte aligned
    ...       payload: each tensor's bytes, coded by the codec its entry names

Header: {"__format__": {"version": 1 or 2}, "__metadata__": {str: str},
         name: {"dtype", "shape", "codec", "offsets": [begin, end), "nbytes", "crc32"[, "quant"]}}
``crc32`` is of the raw (decoded) bytes, so a file is checked whatever its codec. Version 2
adds "quant" ({"scheme": "fp8_e4m3", "scale": <name>}: a state stored in the compact tier,
quant.py); a file without it is written as version 1, which every reader reads.
Values are not checked (NaN/Inf allowed); that is verify's job.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from hs_capture.dump import codec as _codec
from hs_capture.dump import quant as _quant
from hs_capture.dump.codec import CODECS, CodecError, FormatError, SizeMismatch  # noqa: F401 (re-exported)

MAGIC = b"HSCAPT\x00\x01"
FORMAT_VERSION = 2  # the newest this code reads and writes; 1 is written where it suffices
READ_VERSIONS = (1, 2)
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: shapes beyond it are corrupt, whatever they claim
_PREFIX = len(MAGIC) + 8

# name -> bytes per element. bfloat16 has no numpy dtype: readers view it through torch.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "float8_e4m3fn": 1}


def is_count(x: object) -> bool:
    """A size, offset or index: a non-negative int (JSON true/false are not)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def dtype_name(dtype: object) -> str:
    """The one spelling of a dtype, for a torch or numpy dtype: "torch.bfloat16" -> "bfloat16"."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in ITEMSIZE:
        raise TensorInvalidInfo(f"dtype {dtype} is not one a .hst file stores ({', '.join(ITEMSIZE)})")
    return name


class HeaderTooSmall(FormatError):
    pass


class BadMagic(FormatError):
    pass


class HeaderTooLarge(FormatError):
    """The header declares more than MAX_HEADER_BYTES."""


class Truncated(FormatError):
    """The file ends before what its header describes (the header itself, or the payload)."""


class TrailingBytes(FormatError):
    """The file holds bytes past what its header describes."""


class InvalidHeader(FormatError):
    pass


class UnsupportedVersion(FormatError):
    pass


class TensorInvalidInfo(FormatError):
    pass


class InvalidOffset(FormatError):
    """Tensors' byte ranges leave a gap, overlap, or disagree with their shape."""


class ChecksumMismatch(FormatError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple
    codec: str
    begin: int
    end: int
    nbytes: int
    crc32: int
    scale: Optional[str] = None  # quantized (quant.SCHEME): the name of its scale tensor


@dataclass(frozen=True)
class Header:
    metadata: Dict[str, str]
    tensors: Dict[str, TensorEntry]
    payload_start: int


# ---------------------------------------------------------------- writing
@dataclass(frozen=True)
class RawTensor:
    """What the writer hands in: a name, a dtype name, a shape and C-order bytes (a buffer,
    or a 2-D uint8 numpy array of row-contiguous bytes: see _raw_and_crc)."""

    name: str
    dtype: str
    shape: Sequence[int]
    data: memoryview
    scale: Optional[str] = None  # quantized (quant.SCHEME): the name of its scale tensor


def encode_file(
    tensors: Iterable[RawTensor], metadata: Mapping[str, str], codec: str = "zstd", level: int = 1
) -> List[bytes]:
    """Return the chunks of one .hst file (header first), ready to be written in order."""
    _codec.codec_for(codec, "float32")  # an unknown codec fails before any work
    entries: Dict[str, dict] = {}
    payloads: List[bytes] = []
    offset = 0
    # Sorted names give identical bytes for identical captures.
    for t in sorted(tensors, key=lambda t: t.name):
        if t.dtype not in ITEMSIZE:
            raise TensorInvalidInfo(f"{t.name}: unsupported dtype {t.dtype!r}")
        expect = _checked_nbytes(t.name, t.dtype, t.shape)
        nbytes = t.data.size if _is_block(t.data) else memoryview(t.data).nbytes
        if nbytes != expect:
            raise SizeMismatch(f"{t.name}: {nbytes} bytes given, shape/dtype need {expect}")
        used = _codec.codec_for(codec, t.dtype)
        if used == "bytegroup" and nbytes:  # it checksums the bytes as it reads them
            row_bytes = int(t.shape[-1]) * ITEMSIZE[t.dtype] if len(t.shape) else 0
            chunks, crc = _codec.encode_bytegroup(t.data, level, ITEMSIZE[t.dtype], t.dtype, row_bytes)
        else:
            raw, crc = _raw_and_crc(t.data)
            if not isinstance(raw, memoryview):
                import numpy as np

                raw = memoryview(np.ascontiguousarray(raw)).cast("B")
            payload = _codec.encode(raw, used, level, ITEMSIZE[t.dtype], t.dtype)
            chunks = payload if isinstance(payload, list) else [payload]
        size = sum(len(c) if isinstance(c, bytes) else memoryview(c).nbytes for c in chunks)
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": [int(s) for s in t.shape],
            "codec": used,
            "offsets": [offset, offset + size],
            "nbytes": nbytes,
            "crc32": crc,
        }
        if t.scale is not None:
            entries[t.name]["quant"] = {"scheme": _quant.SCHEME, "scale": t.scale}
        payloads += chunks
        offset += size
    quantized = any("quant" in e for e in entries.values())
    if quantized:  # the rules a reader holds it to (read_header), before any byte is written
        _check_quant({n: _entry(n, e) for n, e in entries.items()})
    header = {
        "__format__": {"version": 2 if quantized else 1},  # an older reader reads what it can
        "__metadata__": {str(k): str(v) for k, v in metadata.items()},
        **entries,
    }
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)
    return [MAGIC + struct.pack("<Q", len(blob)) + blob, *payloads]


def _is_block(data) -> bool:
    """A 2-D uint8 numpy array whose rows are contiguous but not adjacent (a column block)."""
    return hasattr(data, "flags") and data.ndim == 2 and not data.flags.c_contiguous


def _raw_and_crc(data):
    """Bytes to encode and their crc32. `data` is a buffer, or a 2-D uint8 numpy array whose
    rows are contiguous but not adjacent (one layer's column block of SGLang's packed aux
    buffer): such a block is checksummed row by row and never copied whole."""
    if _is_block(data):
        import numpy as np

        crc = 0
        step = max(1, (1 << 20) // max(1, data.shape[1]))
        for a in range(0, data.shape[0], step):  # ~1 MB gathered per crc call: few GIL round trips
            crc = zlib.crc32(np.ascontiguousarray(data[a:a + step]), crc)
        return data, crc
    view = memoryview(data)
    raw = view.cast("B") if view.nbytes else memoryview(b"")
    return raw, zlib.crc32(raw)


def _checked_nbytes(name: str, dtype: str, shape: Sequence[int]) -> int:
    n = ITEMSIZE[dtype]
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise TensorInvalidInfo(f"{name}: bad shape {list(shape)!r}")
        n *= s
        if n > 1 << 62:
            raise TensorInvalidInfo(f"{name}: shape {list(shape)!r} overflows")
    return n


# ---------------------------------------------------------------- reading
@contextmanager
def opened(path: str) -> Iterator[Tuple[BinaryIO, "Header"]]:
    """A .hst file open for reading with its header read and checked: the one way a file is
    opened (OSError and FormatError come out as they are)."""
    with open(path, "rb") as f:
        yield f, read_header(f, os.fstat(f.fileno()).st_size)


def read_arrays(path: str) -> Dict[str, "object"]:
    """Every tensor of a file as a numpy array, checked against its crc32; a quantized state
    comes back dequantized (float32, as bfloat16 does), its scale tensor folded in."""
    with opened(path) as (f, header):
        if not any(e.scale for e in header.tensors.values()):
            return {name: to_numpy(read_tensor_bytes(f, header, name), e.dtype, e.shape)
                    for name, e in header.tensors.items()}
        return {name: t.float().numpy() if t.is_floating_point() else t.numpy()
                for name, t in read_tensors(f, header).items()}


def read_tensors(f: BinaryIO, header: "Header") -> Dict[str, "object"]:
    """Every tensor of an open file as a torch tensor of its recorded dtype, checked against
    its crc32; a quantized state dequantized to bfloat16 (quant.py), its scale tensor folded in."""
    out = {name: to_torch(read_tensor_bytes(f, header, name), e.dtype, e.shape)
           for name, e in header.tensors.items()}
    scales = {name: e.scale for name, e in header.tensors.items() if e.scale}
    for name, scale in scales.items():
        out[name] = _quant.dequantize(out[name], out[scale])
    for scale in set(scales.values()):
        del out[scale]
    return out


def read_header(f: BinaryIO, file_size: int) -> Header:
    """Validate and return the header of an open .hst file, rules in a fixed order."""
    if file_size < _PREFIX:
        raise HeaderTooSmall(f"file is {file_size} bytes, smaller than the {_PREFIX}-byte prefix")
    f.seek(0)
    prefix = f.read(_PREFIX)
    if prefix[: len(MAGIC)] != MAGIC:
        raise BadMagic("not an hs_capture tensor file (bad magic)")
    (n,) = struct.unpack("<Q", prefix[len(MAGIC):])
    if n > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"header length {n} exceeds {MAX_HEADER_BYTES}")
    if _PREFIX + n > file_size:
        raise Truncated(f"header length {n} runs past the end of the {file_size}-byte file")
    raw = f.read(n)
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("header does not start with '{'")
        header = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidHeader(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise InvalidHeader("header is not a JSON object")
    fmt = header.pop("__format__", None)
    version = fmt.get("version") if isinstance(fmt, dict) else None
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise UnsupportedVersion(f"format version {fmt!r} is not one this hs_capture reads "
                                 f"({', '.join(map(str, READ_VERSIONS))}): upgrade hs_capture to read it")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidHeader("__metadata__ must map strings to strings")
    tensors: Dict[str, TensorEntry] = {}
    for name, info in header.items():
        tensors[name] = _entry(name, info)
        if tensors[name].scale and version < 2:
            raise TensorInvalidInfo(f"{name}: a quantized tensor in a version {version} file")
    _check_quant(tensors)
    expected = 0
    for e in sorted(tensors.values(), key=lambda e: e.begin):
        if e.begin != expected or e.end < e.begin:
            raise InvalidOffset(f"{e.name}: offsets [{e.begin}, {e.end}) leave a gap or overlap")
        expected = e.end
    payload_start = _PREFIX + n
    if payload_start + expected > file_size:
        raise Truncated(f"payload ends at {payload_start + expected} but the file has {file_size} bytes")
    if payload_start + expected < file_size:
        raise TrailingBytes(f"payload ends at {payload_start + expected} but the file has {file_size} bytes")
    return Header(meta, tensors, payload_start)


def no_duplicate_keys(pairs):
    """json.loads object_pairs_hook: a key given twice is a ValueError, not a silent overwrite."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _entry(name: str, info) -> TensorEntry:
    try:
        dtype, shape, codec = info["dtype"], info["shape"], info["codec"]
        begin, end = info["offsets"]
        nbytes, crc = info["nbytes"], info["crc32"]
    except (TypeError, KeyError, ValueError):
        raise TensorInvalidInfo(f"{name}: incomplete tensor entry") from None
    if dtype not in ITEMSIZE:
        raise TensorInvalidInfo(f"{name}: unsupported dtype {dtype!r}")
    if codec not in CODECS:
        raise CodecError(f"{name}: unknown codec {codec!r}")
    if codec == "bytegroup" and dtype not in _codec.FLOAT_DTYPES:
        raise CodecError(f"{name}: bytegroup is for floats, not {dtype}")
    if not isinstance(shape, list):
        raise TensorInvalidInfo(f"{name}: shape is not a list")
    if not all(is_count(x) for x in (begin, end, nbytes, crc)):
        raise TensorInvalidInfo(f"{name}: offsets, nbytes and crc32 must be non-negative integers")
    if nbytes > MAX_TENSOR_BYTES:
        raise TensorInvalidInfo(f"{name}: {nbytes} bytes is beyond any tensor ({MAX_TENSOR_BYTES} max)")
    if _checked_nbytes(name, dtype, shape) != nbytes:
        raise TensorInvalidInfo(f"{name}: nbytes {nbytes} disagrees with shape {shape} of {dtype}")
    scale = None
    if "quant" in info:
        q = info["quant"]
        if not isinstance(q, dict) or q.get("scheme") != _quant.SCHEME or not isinstance(q.get("scale"), str):
            raise TensorInvalidInfo(f"{name}: quant {q!r} is not {{'scheme': {_quant.SCHEME!r}, 'scale': <tensor>}}")
        scale = q["scale"]
    return TensorEntry(name, dtype, tuple(shape), codec, begin, end, nbytes, crc, scale)


def _check_quant(tensors: Mapping[str, TensorEntry]) -> None:
    """A quantized state [T, H] is float8_e4m3fn and names a float32 scale [T] of the same file."""
    for name, e in tensors.items():
        if e.scale is None:
            continue
        s = tensors.get(e.scale)
        if e.dtype != _quant.STORED_DTYPE or len(e.shape) != 2:
            raise TensorInvalidInfo(f"{name}: quantized as {_quant.SCHEME}, so [T, H] {_quant.STORED_DTYPE}, "
                                    f"not {list(e.shape)} {e.dtype}")
        if s is None or s.scale is not None or s.dtype != _quant.SCALE_DTYPE or s.shape != e.shape[:1]:
            raise TensorInvalidInfo(f"{name}: its scale {e.scale!r} is not a {_quant.SCALE_DTYPE} "
                                    f"[{e.shape[0]}] tensor of this file")


def read_tensor_bytes(f: BinaryIO, header: Header, name: str) -> bytes:
    """Decode one tensor's raw bytes and check them against the header's crc32."""
    try:
        e = header.tensors[name]
    except KeyError:
        raise TensorInvalidInfo(f"no tensor named {name!r}") from None
    f.seek(header.payload_start + e.begin)
    data = f.read(e.end - e.begin)
    raw, crc = _codec.decode_checked(data, e.codec, e.nbytes, ITEMSIZE[e.dtype])
    if crc != e.crc32:
        raise ChecksumMismatch(f"{name}: crc32 of the decoded bytes does not match the header")
    return raw


def to_numpy(raw: bytes, dtype: str, shape: Sequence[int]):
    """Raw bytes to a numpy array; bfloat16 comes back as float32 (numpy has no bf16)."""
    import numpy as np

    if dtype == "bfloat16":
        u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u16.view(np.float32).reshape(shape)
    if dtype == _quant.STORED_DTYPE:  # numpy has no fp8 either: its values, unscaled, as float32
        return to_torch(raw, dtype, shape).float().numpy()
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def to_torch(raw: bytes, dtype: str, shape: Sequence[int]):
    """Raw bytes to a torch tensor of the recorded dtype (bfloat16 included), without a copy.
    The tensor shares the (read-only) bytes: callers that write to it must clone it first."""
    import warnings

    import torch

    tdtype = getattr(torch, dtype)
    if not raw:
        return torch.empty(tuple(shape), dtype=tdtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we never write through it
        t = torch.frombuffer(raw, dtype=tdtype)
    return t.reshape(tuple(shape))
