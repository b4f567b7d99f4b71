"""Payload codecs of the .hst format: raw, zstd, and bytegroup (float-aware, lossless:
bytegroup.py). Every decoder checks sizes before it allocates (no zip bombs).

zstandard objects are not thread-safe (a shared compressor segfaulted on the H200 host):
one per thread.
"""

from __future__ import annotations

import threading
import zlib
from typing import List, Tuple

CODECS = ("raw", "zstd", "bytegroup")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
# A zstd block decodes to at most 128 KiB and takes at least 4 bytes (an RLE block): no
# frame expands more than this, so a larger declared size is a lie, refused before allocating.
_ZSTD_MAX_RATIO = (128 << 10) // 4


class FormatError(ValueError):
    """Base of every rule a .hst file can break; the class name is the rule. (Defined here,
    the lowest module, and re-exported by format.py.)"""


class CodecError(FormatError):
    """A payload that cannot be encoded or decoded as its codec says."""


class SizeMismatch(FormatError):
    """Decoded (or declared) size differs from the header's: no zip bombs, no short reads."""


_tls = threading.local()


def _compressor(level: int, fast_planes: bool = False, slot: int = 0):
    """This thread's compressor; `slot`: one of several whose frames are open at once (a
    streamed frame lives in its compressor's context: two open on one interleave)."""
    import zstandard

    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    key = (level, fast_planes, slot)
    c = cache.get(key)
    if c is None:
        if fast_planes and level <= 2:
            # byte planes: matches are rare and Huffman coding of literals does the work, so a
            # tiny hash table and the longest minimum match are both faster and smaller
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
    if nbytes > (len(data) + 1) * _ZSTD_MAX_RATIO:  # no real frame expands further: refuse
        raise SizeMismatch(f"a {len(data)}-byte zstd frame cannot hold the {nbytes} bytes it declares")
    try:
        out = _decompressor().decompress(data, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd decode failed: {e}") from None
    except MemoryError:
        raise SizeMismatch(f"zstd frame declares {nbytes} bytes: more than this machine can allocate") from None
    if len(out) != nbytes:
        raise SizeMismatch(f"zstd frame decoded to {len(out)} bytes, header says {nbytes}")
    return out


def codec_for(codec: str, dtype: str) -> str:
    """The codec a tensor is actually stored with: bytegroup applies to floats only."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    return "zstd" if codec == "bytegroup" and dtype not in FLOAT_DTYPES else codec


def encode_bytegroup(raw, level: int, itemsize: int, dtype: str, row_bytes: int) -> Tuple[List, int]:
    """bytegroup chunks of C-order bytes (a buffer, or a 2-D uint8 array of row-contiguous
    bytes: a column block stays where it is) and the crc32 of those raw bytes."""
    from hs_capture.dump import bytegroup  # numpy: imported only when a float tensor is written

    try:
        return bytegroup.encode(raw, lambda slot=0: _compressor(level, fast_planes=True, slot=slot), itemsize, row_bytes,
                                bytegroup.transform_for(dtype, level))
    except bytegroup.BytegroupError as e:
        raise CodecError(str(e)) from None


def encode(raw, codec: str, level: int, itemsize: int, dtype: str = "", row_bytes: int = 0):
    """Encode C-order bytes; returns bytes or a list of chunks (written in order)."""
    if codec == "raw":
        return raw
    if codec == "zstd":
        return _compressor(level).compress(raw)
    if codec == "bytegroup":
        return encode_bytegroup(raw, level, itemsize, dtype, row_bytes)[0]
    raise CodecError(f"unknown codec {codec!r}")


def decode(data: bytes, codec: str, nbytes: int, itemsize: int) -> bytes:
    return decode_checked(data, codec, nbytes, itemsize)[0]


def decode_checked(data: bytes, codec: str, nbytes: int, itemsize: int) -> Tuple[bytes, int]:
    """The raw bytes and their crc32 (bytegroup takes it while each block is in cache)."""
    if codec == "raw":
        if len(data) != nbytes:
            raise SizeMismatch(f"raw payload is {len(data)} bytes, header says {nbytes}")
        return data, zlib.crc32(data)
    if codec == "zstd":
        raw = _zstd_decode(data, nbytes)
        return raw, zlib.crc32(raw)
    if codec == "bytegroup":
        from hs_capture.dump import bytegroup

        try:
            return bytegroup.decode(data, nbytes, itemsize, _zstd_decode)
        except bytegroup.BytegroupError as e:
            raise CodecError(str(e)) from None
    raise CodecError(f"unknown codec {codec!r}")
