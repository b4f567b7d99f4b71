"""bytegroup: the float-aware lossless codec of the .hst format (codec.py dispatches here).

A float's sign and exponent carry a few bits of entropy; its low mantissa bits are close to
random. bytegroup cuts every element into byte planes, entropy-codes (zstd) the planes that
compress, and stores the others as they are, so no time is spent on noise.

Transforms (the payload records which one, so every file decodes whatever the writer's level):
  PLANES    (level 1, the default: fastest) plane j = byte j of each little-endian element;
            for bf16 the top plane holds the sign and 7 exponent bits.
  EXPONENT  (level >= 2, bf16 and fp32: best ratio) each element is rotated left by one bit,
            so the top plane is the 8-bit exponent alone and the sign joins the mantissa;
            when it lowers the exponents' entropy (judged on the first block), each row's
            exponents are centred on the row's median (LLM residual streams scale per token),
            and the centres are stored (zeros when not centred).
Rows are processed in ~1 MB blocks so the plane split stays in cache; each compressed plane is
one zstd frame, streamed block by block.

    payload := u8 version (1) | u8 itemsize | u8 transform | u8 n | u64 rows
               | n x (u8 mode, u64 length) | chunk 0 .. chunk n-1
    PLANES:   chunks = planes 0..itemsize-1                      (n = itemsize)
    EXPONENT: chunks = row centres (rows bytes; empty: not centred), planes 0..itemsize-1
                                                                    (n = itemsize + 1)
    mode: 0 raw, 1 zstd frame declaring exactly its chunk's decoded size
"""

from __future__ import annotations

import struct
import zlib
from typing import Callable, List, Tuple

import numpy as np

VERSION = 1
PLANES, EXPONENT = 0, 1
_HEAD = struct.Struct("<BBBBQ")
_ENTRY = struct.Struct("<BQ")
_BLOCK = 1 << 20  # raw bytes per row block
_SAMPLE = 1 << 16  # bytes of a plane tried before deciding to compress it
_WORTH = 1.1  # compress a plane when its sample shrinks at least this much
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # 1: fp8 (one plane: the bytes)
_CENTRE_STRIDE = 16  # every 16th column estimates a row's median exponent


class BytegroupError(ValueError):
    pass


def transform_for(dtype: str, level: int) -> int:
    return EXPONENT if level >= 2 and dtype in ("bfloat16", "float32") else PLANES


def _rows_view(raw, row_bytes: int) -> np.ndarray:
    """[rows, row_bytes] uint8: a 2-D array passes as it is (its rows may be strided)."""
    if isinstance(raw, np.ndarray) and raw.ndim == 2:
        return raw
    flat = np.frombuffer(raw, dtype=np.uint8)
    if not flat.size:
        return flat.reshape(0, 0)
    if row_bytes <= 0 or flat.size % row_bytes:
        row_bytes = flat.size or 1
    return flat.reshape(-1, row_bytes)


def encode(raw, compressor: Callable, itemsize: int, row_bytes: int, transform: int) -> Tuple[List, int]:
    """Chunks of one payload, and the crc32 of the raw bytes (taken block by block while they
    are in cache: one pass over memory, not two). `compressor(slot)` gives this thread's zstd
    compressor for that slot: each plane's frame stays open across blocks, so each plane has
    a compressor of its own (frames open on one compressor share its context and corrupt
    each other), and samples are taken on another."""
    if itemsize not in _UINT:
        raise BytegroupError(f"bytegroup takes 1-, 2- or 4-byte floats, not {itemsize}-byte elements")
    u8 = _rows_view(raw, row_bytes)
    rows, width = u8.shape
    if width % itemsize or (width == 0 and rows):
        raise BytegroupError(f"rows of {width} bytes are not whole {itemsize}-byte elements")
    uint, bits = _UINT[itemsize], itemsize * 8
    per_row = width // itemsize
    count = rows * per_row
    step = max(1, _BLOCK // max(1, width))
    sampler = compressor(itemsize)
    sinks: List = [None] * itemsize  # per plane: a _Stream, or the whole plane kept raw
    centres = np.empty(rows, dtype=np.uint8) if transform == EXPONENT else None
    centre = None  # centre the exponents per row? decided on the first block
    crc = 0
    # Scratch buffers reused by every block: fresh ones would page-fault on every block.
    block = np.empty((min(step, rows), width), dtype=np.uint8)
    word = np.empty((min(step, rows), per_row), dtype=uint)
    spare = np.empty_like(word)
    plane = np.empty((min(step, rows), per_row), dtype=np.uint8)
    for a in range(0, rows, step):
        src = u8[a:a + step]
        n = len(src)
        if src.flags.c_contiguous:
            b = src
        else:  # a column block of a wider buffer: gather its rows once, then work in cache
            np.copyto(block[:n], src)
            b = block[:n]
        crc = zlib.crc32(b, crc)
        w = b.view(uint)
        if transform == EXPONENT:  # rotate left by one: [exponent | mantissa, sign]
            np.left_shift(w, 1, out=word[:n])
            np.right_shift(w, bits - 1, out=spare[:n])
            np.bitwise_or(word[:n], spare[:n], out=word[:n])
            w = word[:n]
        for j in range(itemsize):
            p = plane[:n]
            if j:  # byte j of each element: shift it down, keep the low byte (faster than a strided copy)
                np.right_shift(w, 8 * j, out=spare[:n])
                np.copyto(p, spare[:n], casting="unsafe")
            else:
                np.copyto(p, w, casting="unsafe")
            if centres is not None and j == itemsize - 1:
                m = _row_centres(p) if centre is not False else np.zeros(n, dtype=np.uint8)
                if centre is None:  # the first block decides: centre only where it helps
                    centre = _entropy(p - m[:, None]) < _entropy(p) - 0.02
                    m = m if centre else np.zeros(n, dtype=np.uint8)
                centres[a:a + n] = m
                np.subtract(p, m[:, None], out=p)  # modulo 256: lossless
            flat = p.reshape(-1)
            if sinks[j] is None:  # the first block decides, from a sample
                head = flat[:_SAMPLE]
                worth = head.size and len(sampler.compress(head)) * _WORTH <= head.size
                sinks[j] = _Stream(compressor(j), count) if worth else np.empty(count, dtype=np.uint8)
            if isinstance(sinks[j], _Stream):
                sinks[j].add(flat)
            else:
                sinks[j][a * per_row:(a + n) * per_row] = flat
    if centres is not None and not centre:
        centres = centres[:0]  # not centred: an empty chunk says so
    return _assemble(sinks, centres, itemsize, rows, transform), crc


def _row_centres(e: np.ndarray) -> np.ndarray:
    """Each row's median exponent, from every 16th column (np.partition: linear time)."""
    sample = e[:, ::_CENTRE_STRIDE]
    k = sample.shape[1] // 2
    return np.partition(sample, k, axis=1)[:, k].copy()


def _entropy(x: np.ndarray) -> float:
    """Order-0 entropy of a byte array, bits per byte."""
    counts = np.bincount(x.reshape(-1), minlength=256)
    p = counts[counts > 0] / x.size
    return float(-(p * np.log2(p)).sum())


class _Stream:
    """One zstd frame fed block by block (it declares the plane's full size up front)."""

    def __init__(self, compressor, size: int) -> None:
        self._obj = compressor.compressobj(size=size)
        self.out: List[bytes] = []

    def add(self, data: np.ndarray) -> None:
        got = self._obj.compress(data)
        if got:
            self.out.append(got)

    def finish(self) -> List[bytes]:
        self.out.append(self._obj.flush())
        return self.out


def _assemble(sinks, centres, itemsize: int, rows: int, transform: int) -> List:
    chunks: List = []
    table: List[bytes] = []
    if centres is not None:
        table.append(_ENTRY.pack(0, centres.size))
        chunks.append(memoryview(centres))
    for s in sinks:
        if s is None:  # an empty tensor
            table.append(_ENTRY.pack(0, 0))
        elif isinstance(s, np.ndarray):
            table.append(_ENTRY.pack(0, s.size))
            chunks.append(memoryview(s))
        else:
            frame = s.finish()
            table.append(_ENTRY.pack(1, sum(len(x) for x in frame)))
            chunks += frame
    head = _HEAD.pack(VERSION, itemsize, transform, len(table), rows) + b"".join(table)
    return [head, *chunks]


def parse(data, itemsize: int) -> Tuple[int, int, List[Tuple[int, int, int]]]:
    """(transform, rows, [(mode, offset, length)]) with every rule checked."""
    if len(data) < _HEAD.size:
        raise BytegroupError("bytegroup payload shorter than its prefix")
    version, size, transform, n, rows = _HEAD.unpack_from(data, 0)
    if version != VERSION:
        raise BytegroupError(f"bytegroup version {version} is not {VERSION}")
    if size != itemsize:
        raise BytegroupError(f"bytegroup payload has {size}-byte elements, the dtype has {itemsize}")
    if transform not in (PLANES, EXPONENT):
        raise BytegroupError(f"bytegroup: unknown transform {transform}")
    if n != itemsize + (transform == EXPONENT):
        raise BytegroupError(f"bytegroup: {n} chunks for {itemsize}-byte elements")
    at = _HEAD.size + _ENTRY.size * n
    if len(data) < at:
        raise BytegroupError("bytegroup chunk table runs past the payload")
    out = []
    for j in range(n):
        mode, length = _ENTRY.unpack_from(data, _HEAD.size + _ENTRY.size * j)
        if mode not in (0, 1):
            raise BytegroupError(f"bytegroup chunk {j}: unknown mode {mode}")
        if at + length > len(data):
            raise BytegroupError(f"bytegroup chunk {j} runs past the payload")
        out.append((mode, at, length))
        at += length
    if at != len(data):
        raise BytegroupError(f"bytegroup chunks end at {at}, the payload has {len(data)} bytes")
    return transform, rows, out


def decode(data, nbytes: int, itemsize: int, unzstd: Callable) -> Tuple[memoryview, int]:
    """The raw bytes and their crc32 (taken block by block while in cache). unzstd(frame,
    size) decodes one zstd frame that must declare exactly `size` bytes."""
    if itemsize not in _UINT or nbytes % itemsize:
        raise BytegroupError(f"{nbytes} bytes are not whole {itemsize}-byte floats")
    count = nbytes // itemsize
    transform, rows, table = parse(data, itemsize)
    if count and (rows == 0 or count % rows):
        raise BytegroupError(f"bytegroup: {rows} rows do not divide {count} elements")
    view = memoryview(data)
    centred = transform == EXPONENT and table[0][2] > 0  # an empty centre chunk: not centred
    sizes = ([rows if centred else 0] if transform == EXPONENT else []) + [count] * itemsize
    chunks = []
    for j, ((mode, at, length), want) in enumerate(zip(table, sizes)):
        chunk = unzstd(view[at:at + length], want) if mode else view[at:at + length]
        if len(chunk) != want:
            raise BytegroupError(f"bytegroup chunk {j} holds {len(chunk)} bytes, expected {want}")
        chunks.append(np.frombuffer(chunk, dtype=np.uint8))
    if not count:
        return memoryview(b""), 0
    planes = chunks[-itemsize:]
    uint, bits = _UINT[itemsize], itemsize * 8
    out = np.empty(count, dtype=uint)
    per_row = count // rows
    step = max(1, _BLOCK // (per_row * itemsize))
    top = np.empty(min(step, rows) * per_row, dtype=np.uint8)
    spare = np.empty(len(top), dtype=uint)
    crc = 0
    for a in range(0, rows, step):  # block by block, in cache
        lo, hi = a * per_row, min(rows, a + step) * per_row
        w, n = out[lo:hi], hi - lo
        t = planes[-1][lo:hi]
        if centred:  # undo the row centring (modulo 256)
            np.add(t.reshape(-1, per_row), chunks[0][a:a + step][:, None], out=top[:n].reshape(-1, per_row))
            t = top[:n]
        np.copyto(w, t, casting="unsafe")
        for j in range(itemsize - 2, -1, -1):
            np.left_shift(w, 8, out=w)
            np.bitwise_or(w, planes[j][lo:hi], out=w, casting="unsafe")
        if transform == EXPONENT:  # rotate right by one
            np.right_shift(w, 1, out=spare[:n])
            np.left_shift(w, bits - 1, out=w)
            np.bitwise_or(w, spare[:n], out=w)
        crc = zlib.crc32(w, crc)
    return memoryview(out).cast("B"), crc
