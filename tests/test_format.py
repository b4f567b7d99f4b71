"""The .hst file: round trips and the abuse cases of safetensors' attacks/."""

import io
import json
import struct

import numpy as np
import pytest
import torch

from hs_capture.dump import hst as fmt


def encode(tensors, codec="zstd", meta=None, level=1):
    return b"".join(bytes(c) for c in fmt.encode_file(tensors, meta or {"k": "v"}, codec, level))


def raw(name, t):
    t = t.contiguous()
    return fmt.RawTensor(name, str(t.dtype).split(".")[1], list(t.shape), memoryview(t.view(torch.uint8).numpy()))


def decode(blob):
    f = io.BytesIO(blob)
    h = fmt.read_header(f, len(blob))
    return h, {n: fmt.to_torch(fmt.read_tensor_bytes(f, h, n), e.dtype, e.shape) for n, e in h.tensors.items()}


@pytest.mark.parametrize("codec", fmt.CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32])
def test_round_trip_is_bit_exact(codec, dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(37, 19, generator=g) * 100).to(dtype)
    ids = torch.arange(37, dtype=torch.int64)
    h, out = decode(encode([raw("hidden", t), raw("input_ids", ids)], codec))
    assert torch.equal(out["hidden"], t) and out["hidden"].dtype == dtype
    assert torch.equal(out["input_ids"], ids)
    want = "zstd" if codec == "bytegroup" and not dtype.is_floating_point else codec
    assert h.metadata == {"k": "v"} and h.tensors["hidden"].codec == want
    assert h.tensors["input_ids"].codec == ("zstd" if codec == "bytegroup" else codec)
    assert h.payload_start % 8 == 0


def test_bf16_to_numpy_is_exact_float32():
    t = torch.randn(5, 3).to(torch.bfloat16)
    f = io.BytesIO(encode([raw("x", t)]))
    h = fmt.read_header(f, len(f.getvalue()))
    arr = fmt.to_numpy(fmt.read_tensor_bytes(f, h, "x"), "bfloat16", (5, 3))
    assert np.array_equal(arr, t.float().numpy())


def test_identical_captures_give_identical_bytes():
    t = torch.randn(4, 4)
    assert encode([raw("a", t), raw("b", t)]) == encode([raw("b", t), raw("a", t)])


@pytest.mark.parametrize("codec,level", [("raw", 1), ("zstd", 1), ("bytegroup", 1), ("bytegroup", 2)])
def test_empty_tensor_round_trips(codec, level):
    for shape in ((0, 8), (0,), (8, 0)):
        h, out = decode(encode([raw("x", torch.empty(shape))], codec, level=level))
        assert out["x"].shape == shape


def _with_header(header: dict, payload: bytes = b"") -> bytes:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return fmt.MAGIC + struct.pack("<Q", len(blob)) + blob + payload


GOOD = {"__format__": {"version": 1}, "x": {"dtype": "float32", "shape": [2], "codec": "raw",
                                            "offsets": [0, 8], "nbytes": 8, "crc32": 0}}


@pytest.mark.parametrize("blob, error", [
    (b"HSCA", fmt.HeaderTooSmall),
    (b"NOTMAGIC" + b"\0" * 8, fmt.BadMagic),
    (fmt.MAGIC + struct.pack("<Q", 1 << 40), fmt.HeaderTooLarge),  # huge N
    (fmt.MAGIC + struct.pack("<Q", 64) + b"{}", fmt.Truncated),  # N past the end
    (fmt.MAGIC + struct.pack("<Q", 8) + b"\xff\xfe      ", fmt.InvalidHeader),
    (fmt.MAGIC + struct.pack("<Q", 8) + b"[1]     ", fmt.InvalidHeader),
    (_with_header({"__format__": {"version": 99}}), fmt.UnsupportedVersion),
    (_with_header({**GOOD, "x": {**GOOD["x"], "dtype": "float8"}}, b"\0" * 8), fmt.TensorInvalidInfo),
    (_with_header({**GOOD, "x": {**GOOD["x"], "shape": [3]}}, b"\0" * 8), fmt.TensorInvalidInfo),
    (_with_header({**GOOD, "x": {**GOOD["x"], "shape": [1 << 40, 1 << 40]}}, b"\0" * 8), fmt.TensorInvalidInfo),
    (_with_header({**GOOD, "x": {**GOOD["x"], "codec": "lz4"}}, b"\0" * 8), fmt.CodecError),
    (_with_header({**GOOD, "x": {**GOOD["x"], "offsets": [4, 12]}}, b"\0" * 12), fmt.InvalidOffset),
    (_with_header({**GOOD, "y": {**GOOD["x"]}}, b"\0" * 16), fmt.InvalidOffset),  # overlapping
    (_with_header(GOOD, b"\0" * 9), fmt.TrailingBytes),  # trailing byte
    (_with_header(GOOD, b"\0" * 7), fmt.Truncated),  # truncated
])
def test_malformed_headers_are_rejected_by_rule(blob, error):
    with pytest.raises(error):
        fmt.read_header(io.BytesIO(blob), len(blob))


def test_duplicate_keys_are_rejected():
    text = b'{"__format__":{"version":1},"x":{},"x":{}}'
    text += b" " * (-len(text) % 8)
    blob = fmt.MAGIC + struct.pack("<Q", len(text)) + text
    with pytest.raises(fmt.InvalidHeader):
        fmt.read_header(io.BytesIO(blob), len(blob))


def test_flipped_bit_is_caught_by_the_checksum():
    blob = bytearray(encode([raw("x", torch.randn(64, 64))], codec="raw"))
    blob[-5] ^= 0x10
    f = io.BytesIO(bytes(blob))
    h = fmt.read_header(f, len(blob))
    with pytest.raises(fmt.ChecksumMismatch):
        fmt.read_tensor_bytes(f, h, "x")


def test_zstd_frame_must_declare_the_header_size():
    """A frame that inflates beyond what the header declares is refused before decoding."""
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    blob = _with_header({"__format__": {"version": 1}, "x": {"dtype": "uint8", "shape": [8], "codec": "zstd",
                                                             "offsets": [0, len(bomb)], "nbytes": 8, "crc32": 0}}, bomb)
    f = io.BytesIO(blob)
    h = fmt.read_header(f, len(blob))
    with pytest.raises(fmt.SizeMismatch):
        fmt.read_tensor_bytes(f, h, "x")


def test_writer_refuses_bytes_that_disagree_with_the_shape():
    with pytest.raises(fmt.SizeMismatch):
        fmt.encode_file([fmt.RawTensor("x", "float32", [3], memoryview(b"\0" * 8))], {})


# ---------------------------------------------------------------- bytegroup
HEAD, ENTRY = 12, 9  # bytegroup payload prefix and chunk-table entry sizes


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16),
                                         (torch.float32, torch.int32)])
def test_bytegroup_keeps_every_bit_pattern(dtype, width, level):
    """NaN payloads, -0.0, subnormals, Inf: every pattern comes back exactly, at every level."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2 ** 15), 2 ** 15, (4096 * 3,), generator=g, dtype=torch.int32)
    if width == torch.int16:
        t = bits.to(torch.int16).view(dtype)
    else:
        t = (bits * 65537 + 12345).view(dtype)
    for shape in ((4096 * 3,), (96, 128), (1, 4096 * 3), (4096 * 3, 1)):
        x = t.reshape(shape)
        h, out = decode(encode([raw("x", x)], "bytegroup", level=level))
        assert h.tensors["x"].codec == "bytegroup"
        assert torch.equal(out["x"].view(width), x.view(width)), shape


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 5000])  # one row block, several
def test_bytegroup_round_trips_when_every_plane_compresses(dtype, level, rows):
    """A periodic input (a prompt of two alternating tokens) makes every byte plane worth
    compressing: no plane's sample may disturb another plane's frame."""
    g = torch.Generator().manual_seed(5)
    two = torch.randn(2, 256, generator=g)
    x = two.repeat(rows // 2 + 1, 1)[:rows].to(dtype)
    h, out = decode(encode([raw("x", x)], "bytegroup", level=level))
    assert torch.equal(out["x"], x)


def llm_like_bf16(rows=512, h=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g)
    x[:, torch.randperm(h, generator=g)[:8]] *= 50  # outlier channels of residual streams
    x *= torch.rand(rows, 1, generator=g) * 2 + 0.5  # per-token scale
    return x.to(torch.bfloat16)


def _payload(blob):
    h = fmt.read_header(io.BytesIO(blob), len(blob))
    return h, blob[h.payload_start:]


def test_bytegroup_compresses_exponents_and_stores_mantissas_raw():
    t = llm_like_bf16()
    z = len(encode([raw("x", t)], "zstd"))
    sizes = {}
    for level, transform in ((1, 0), (2, 1)):
        blob = encode([raw("x", t)], "bytegroup", level=level)
        _, payload = _payload(blob)
        n = payload[3]
        modes = [payload[HEAD + ENTRY * j] for j in range(n)]
        assert payload[2] == transform
        # level 1: low byte (mantissa) raw, high byte (sign, exponent) zstd; level 2: the row
        # centres (raw), then sign+mantissa (raw) and the exponent (zstd)
        assert modes == ([0, 1] if level == 1 else [0, 0, 1])
        if level == 2:  # per-token scales: the exponents were centred per row (512 centres)
            assert struct.unpack_from("<BQ", payload, HEAD)[1] == t.shape[0]
        sizes[level] = len(blob)
    assert sizes[2] < sizes[1] < 0.9 * z and t.numel() * 2 / sizes[2] > 1.45


def _bg_file(t, level=1):
    blob = bytearray(encode([raw("x", t)], "bytegroup", level=level))
    h = fmt.read_header(io.BytesIO(bytes(blob)), len(blob))
    return blob, h.payload_start


@pytest.mark.parametrize("damage,error", [
    (lambda b, p: b.__setitem__(p, 9), "version 9"),
    (lambda b, p: b.__setitem__(p + 1, 4), "4-byte elements"),
    (lambda b, p: b.__setitem__(p + 2, 5), "unknown transform 5"),
    (lambda b, p: b.__setitem__(p + 3, 7), "7 chunks"),
    (lambda b, p: b.__setitem__(p + HEAD, 7), "unknown mode 7"),
    (lambda b, p: b.__setitem__(slice(p + HEAD + 1, p + HEAD + 9), (10 ** 9).to_bytes(8, "little")), "runs past"),
    (lambda b, p: b.__setitem__(slice(p + HEAD + 1, p + HEAD + 9), (5).to_bytes(8, "little")), "chunks end at"),
    (lambda b, p: b.__setitem__(slice(p + 4, p + 12), (7).to_bytes(8, "little")), "rows do not divide"),
])
def test_bytegroup_malformed_tables_are_clear_errors(damage, error):
    blob, p = _bg_file(llm_like_bf16(64, 64))
    damage(blob, p)
    f = io.BytesIO(bytes(blob))
    h = fmt.read_header(f, len(blob))
    with pytest.raises(fmt.FormatError, match=error):
        fmt.read_tensor_bytes(f, h, "x")


def test_bytegroup_chunk_frame_declaring_another_size_is_refused():
    import zstandard

    t = llm_like_bf16(64, 64)
    count = t.numel()
    bomb = zstandard.ZstdCompressor().compress(bytes(count * 1000))  # declares 1000x the plane
    payload = (struct.pack("<BBBBQ", 1, 2, 0, 2, 64) + struct.pack("<BQ", 0, count) + struct.pack("<BQ", 1, len(bomb))
               + bytes(count) + bomb)
    header = {"__format__": {"version": 1}, "x": {"dtype": "bfloat16", "shape": [64, 64], "codec": "bytegroup",
                                                  "offsets": [0, len(payload)], "nbytes": count * 2, "crc32": 0}}
    blob = _with_header(header, payload)
    f = io.BytesIO(blob)
    h = fmt.read_header(f, len(blob))
    with pytest.raises(fmt.SizeMismatch, match="declares"):
        fmt.read_tensor_bytes(f, h, "x")


def test_bytegroup_is_refused_for_integers_in_a_header():
    header = {"__format__": {"version": 1}, "x": {"dtype": "int64", "shape": [1], "codec": "bytegroup",
                                                  "offsets": [0, 8], "nbytes": 8, "crc32": 0}}
    blob = _with_header(header, bytes(8))
    with pytest.raises(fmt.CodecError, match="bytegroup is for floats"):
        fmt.read_header(io.BytesIO(blob), len(blob))


@pytest.mark.parametrize("codec,level", [("raw", 1), ("zstd", 1), ("bytegroup", 1), ("bytegroup", 2)])
def test_a_column_block_encodes_like_its_contiguous_copy(codec, level):
    """The writer hands one layer's block of SGLang's packed [T, K*H] aux as a strided view:
    the file must be byte-identical to the one of a contiguous copy."""
    packed = llm_like_bf16(64, 3 * 96)
    block = packed[:, 96:192]
    strided = fmt.RawTensor("hidden", "bfloat16", [64, 96], block.view(torch.uint8).numpy())
    assert not strided.data.flags.c_contiguous
    assert encode([strided], codec, level=level) == encode([raw("hidden", block.contiguous())], codec, level=level)
    _, out = decode(encode([strided], codec, level=level))
    assert torch.equal(out["hidden"], block)
