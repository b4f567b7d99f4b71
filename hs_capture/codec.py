"""Payload codecs of the .hst format: raw, zstd, and bytegroup (lossless, float-aware).

bytegroup splits each element's bytes into planes (plane j = byte j of every little-endian
element). In a float the sign and exponent sit in the top byte(s) and carry a few bits of
entropy; the low mantissa bytes are close to random. Each plane is zstd-compressed when a
sample of it compresses, else stored raw, so no time is spent on noise. Compressible planes
use a fast, literal-heavy zstd preset at level 1 (short hash table, long minimum match: in
these planes matches are rare and Huffman coding of literals does the work); other levels
are zstd's own.

    bytegroup payload := u8 version (1) | u8 itemsize | itemsize x (u8 mode, u64 length) | planes
    mode: 0 raw, 1 zstd frame (declaring its content size, which must be nbytes / itemsize)

zstandard objects are not thread-safe (a shared compressor segfaulted on the H200 host):
one per thread.
"""

from __future__ import annotations

import struct
import threading
from typing import List, Tuple

CODECS = ("raw", "zstd", "bytegroup")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_BG_VERSION = 1
_SAMPLE = 1 << 16  # bytes of a plane tried before it is compressed
_WORTH = 1.1  # a plane is compressed when its sample shrinks at least this much


class FormatError(ValueError):
    """Base of every rule a .hst file can break; the class name is the rule. (Defined here,
    the lowest module, and re-exported by format.py.)"""


class CodecError(FormatError):
    """A payload that cannot be encoded or decoded as its codec says."""


class SizeMismatch(FormatError):
    """Decoded (or declared) size differs from the header's: no zip bombs, no short reads."""


_tls = threading.local()


def _compressor(level: int, fast_planes: bool = False):
    import zstandard

    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    key = (level, fast_planes)
    c = cache.get(key)
    if c is None:
        if fast_planes and level <= 1:
            params = zstandard.ZstdCompressionParameters(
                window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, strategy=1,
                write_content_size=True)
            c = zstandard.ZstdCompressor(compression_params=params)
        else:
            c = zstandard.ZstdCompressor(level=level, write_content_size=True)
        cache[key] = c
    return c


def _decompressor():
    import zstandard

    d = getattr(_tls, "decompressor", None)
    if d is None:
        d = _tls.decompressor = zstandard.ZstdDecompressor()
    return d


def _zstd_decode(data, nbytes: int) -> bytes:
    import zstandard

    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CodecError(f"bad zstd frame: {e}") from None
    if declared != nbytes:  # a frame must declare its size and it must be the header's
        raise SizeMismatch(f"zstd frame declares {declared} bytes, header says {nbytes}")
    try:
        out = _decompressor().decompress(data, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd decode failed: {e}") from None
    if len(out) != nbytes:
        raise SizeMismatch(f"zstd frame decoded to {len(out)} bytes, header says {nbytes}")
    return out


def codec_for(codec: str, dtype: str) -> str:
    """The codec a tensor is actually stored with: bytegroup applies to floats only."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    return "zstd" if codec == "bytegroup" and dtype not in FLOAT_DTYPES else codec


def encode(raw: memoryview, codec: str, level: int, itemsize: int):
    """Encode C-order bytes; returns bytes or a list of chunks (written in order)."""
    if codec == "raw":
        return raw
    if codec == "zstd":
        return _compressor(level).compress(raw)
    if codec == "bytegroup":
        return _bytegroup_encode(raw, level, itemsize)
    raise CodecError(f"unknown codec {codec!r}")


def decode(data: bytes, codec: str, nbytes: int, itemsize: int) -> bytes:
    if codec == "raw":
        if len(data) != nbytes:
            raise SizeMismatch(f"raw payload is {len(data)} bytes, header says {nbytes}")
        return data
    if codec == "zstd":
        return _zstd_decode(data, nbytes)
    if codec == "bytegroup":
        return _bytegroup_decode(data, nbytes, itemsize)
    raise CodecError(f"unknown codec {codec!r}")


def _bytegroup_encode(raw, level: int, itemsize: int) -> List[bytes]:
    """raw: a contiguous buffer, or a 2-D uint8 array with contiguous rows (planes are cut
    straight out of it: no contiguous copy first)."""
    import numpy as np

    if itemsize == 1:
        raise CodecError("bytegroup needs elements of 2 bytes or more")
    u8 = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    if u8.shape[-1] % itemsize:
        raise CodecError(f"bytegroup needs whole elements of {itemsize} bytes")
    table, planes = [], []
    for j in range(itemsize):
        plane = np.ascontiguousarray(u8[..., j::itemsize]).reshape(-1)  # byte j of every element
        mode, data, size = 0, memoryview(plane), plane.size
        if plane.size:
            c = _compressor(level, fast_planes=True)
            head = plane[:_SAMPLE]
            if len(c.compress(head)) * _WORTH <= head.size:
                data = c.compress(plane)
                mode, size = 1, len(data)
        table.append(struct.pack("<BQ", mode, size))
        planes.append(data)
    return [struct.pack("<BB", _BG_VERSION, itemsize) + b"".join(table), *planes]


def _bytegroup_table(data: bytes, itemsize: int) -> Tuple[int, List[Tuple[int, int, int]]]:
    if len(data) < 2:
        raise CodecError("bytegroup payload shorter than its prefix")
    version, size = struct.unpack_from("<BB", data, 0)
    if version != _BG_VERSION:
        raise CodecError(f"bytegroup version {version} is not {_BG_VERSION}")
    if size != itemsize:
        raise CodecError(f"bytegroup payload has {size}-byte elements, the dtype has {itemsize}")
    at = 2 + 9 * size
    if len(data) < at:
        raise CodecError("bytegroup plane table runs past the payload")
    out = []
    for j in range(size):
        mode, n = struct.unpack_from("<BQ", data, 2 + 9 * j)
        if mode not in (0, 1):
            raise CodecError(f"bytegroup plane {j}: unknown mode {mode}")
        if at + n > len(data):
            raise CodecError(f"bytegroup plane {j} runs past the payload")
        out.append((mode, at, n))
        at += n
    if at != len(data):
        raise CodecError(f"bytegroup planes end at {at}, the payload has {len(data)} bytes")
    return size, out


def _bytegroup_decode(data: bytes, nbytes: int, itemsize: int) -> bytes:
    import numpy as np

    if itemsize < 2 or nbytes % itemsize:
        raise SizeMismatch(f"{nbytes} bytes are not whole {itemsize}-byte elements")
    count = nbytes // itemsize
    size, table = _bytegroup_table(data, itemsize)
    out = np.empty((count, size), dtype=np.uint8)
    view = memoryview(data)
    for j, (mode, at, n) in enumerate(table):
        chunk = view[at:at + n]
        plane = _zstd_decode(chunk, count) if mode else chunk
        if len(plane) != count:
            raise SizeMismatch(f"bytegroup plane {j} holds {len(plane)} bytes, expected {count}")
        out[:, j] = np.frombuffer(plane, dtype=np.uint8)
    return memoryview(out).cast("B") if count else b""
