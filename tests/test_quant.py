"""The compact tier's pure logic: FP8 e4m3 with one power-of-two scale per token
(hs_capture/dump/quant.py), its place in the .hst file (version 2, the scale named by the
state's entry) and a step's way from the device's tensors to the files (server/step.py's
`compact`, step_files). The real server's fp8 dump: tests/test_compact_tier.py."""

import io
import json
import struct

import numpy as np
import pytest
import torch

from hs_capture.dump import hst as fmt
from hs_capture.dump import quant
from tests.test_format import decode, encode, raw


def states(rows=64, hidden=256, seed=0, outlier=30.0):
    """Residual-stream-like rows: a few channels far larger than the rest, a scale per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    x[:, 7] *= outlier
    x *= torch.rand(rows, 1, generator=g) * 4 + 0.1
    return x.to(torch.bfloat16)


def test_scales_are_powers_of_two_that_put_each_token_in_the_top_binade():
    x = states()
    q, s = quant.quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (64,)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # powers of two
    top = q.float().abs().amax(dim=1)
    assert (top >= 224).all() and (top <= 448).all()  # (224, 448], rounded: 224 itself included


def test_dequantizing_is_exact_in_bfloat16_and_within_the_e4m3_bound():
    x = states()
    q, s = quant.quantize(x)
    back = quant.dequantize(q, s)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.float(), q.float() * s[:, None])  # q x 2^k is a bfloat16: no rounding
    xf = x.float()
    err = (back.float() - xf).abs()
    y = xf.abs() / s[:, None]  # in units of the scale
    fine, coarse, sub = y >= quant.COARSE_BELOW, (y < quant.COARSE_BELOW) & (y >= 2.0 ** -6), y < 2.0 ** -6
    assert fine.any() and coarse.any()
    assert (err[fine] <= 2.0 ** -4 * xf.abs()[fine]).all()  # 3 mantissa bits
    assert (err[coarse] <= 2.0 ** -3 * xf.abs()[coarse]).all()  # 2 mantissa bits
    assert (err[sub] <= 2.0 ** -9 * s[:, None].expand_as(xf)[sub]).all()  # e4m3's subnormal step
    # the large values really keep their third mantissa bit, the small ones really lose it
    assert (err[fine] > 2.0 ** -5 * xf.abs()[fine]).any() and (err[coarse] > 2.0 ** -4 * xf.abs()[coarse]).any()
    rel = quant.rel_error(xf.numpy())
    want = ((back.float() - xf).norm(dim=1) / xf.norm(dim=1)).numpy()
    np.testing.assert_allclose(rel, want, rtol=1e-5)
    assert 0.005 < float(np.median(rel)) < 2.0 ** -4  # really quantized, and within the bound


def test_zero_rows_and_non_finite_rows():
    x = states(rows=4)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    q, s = quant.quantize(x)
    back = quant.dequantize(q, s).float()
    assert s[0] == 1 and torch.equal(back[0], torch.zeros_like(back[0]))
    assert back[1].isnan().all() and back[2].isnan().all()  # verify's non-finite check still sees them
    assert torch.isfinite(back[3]).all()


def test_quantizing_is_chunked_the_same_as_whole(monkeypatch):
    x = states(rows=50)
    whole = quant.quantize(x)
    monkeypatch.setattr(quant, "_ELEMS", 7 * x.shape[1])
    parts = quant.quantize(x)
    assert torch.equal(whole[0].view(torch.uint8), parts[0].view(torch.uint8)) and torch.equal(whole[1], parts[1])


def same(a, b):
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bound", [None, 40 * 32])  # together in one pass; apart (over the bound)
def test_a_steps_states_quantized_together_as_each_alone(monkeypatch, bound):
    packed = torch.cat([states(rows=20, hidden=32, seed=i) for i in (1, 2, 3)], dim=1)  # SGLang's packed aux
    parts = [packed[:, 0:32], packed[:, 64:96], states(rows=20, hidden=32, seed=4)]  # strided blocks, a state
    alone = [quant.quantize(p.contiguous()) for p in parts]
    if bound:
        monkeypatch.setattr(quant, "_ELEMS", bound)
    together = quant.quantize_parts(parts)
    assert len(together) == 3 and all(same(a, b) for a, b in zip(alone, together))
    assert all(q.shape == (20, 32) and s.shape == (20,) for q, s in together)


def test_on_grid_tells_fp8_states_read_back_from_lossless_ones():
    x = states(rows=40, hidden=128)
    back = quant.dequantize(*quant.quantize(x)).float().numpy()
    assert quant.on_grid(back)
    assert not quant.on_grid(x.float().numpy())  # bf16 values: most carry more than 3 mantissa bits
    back[3, 5] = np.nextafter(back[3, 5], np.float32(np.inf), dtype=np.float32)  # one value off the grid
    assert not quant.on_grid(back)
    assert not quant.on_grid(np.zeros((4, 128), np.float32))  # nothing to tell by
    nan = quant.dequantize(*quant.quantize(x)).float().numpy()
    nan[2, 1] = np.nan  # a non-finite row is verify's other check's; the rest still tells
    assert quant.on_grid(nan)


def compact_file(rows=33, hidden=64):
    x = states(rows, hidden)
    q, s = quant.quantize(x)
    t = fmt.RawTensor("hidden", "float8_e4m3fn", [rows, hidden], memoryview(q.view(torch.uint8).numpy()),
                      scale="hidden_scale")
    return x, q, s, encode([t, raw("hidden_scale", s), raw("input_ids", torch.arange(rows))], "bytegroup")


def test_a_compact_file_is_version_2_and_reads_back_dequantized():
    x, q, s, blob = compact_file()
    h, stored = decode(blob)
    assert json.loads(blob[16:16 + struct.unpack("<Q", blob[8:16])[0]])["__format__"] == {"version": 2}
    assert h.tensors["hidden"].scale == "hidden_scale" and h.tensors["hidden"].dtype == "float8_e4m3fn"
    assert torch.equal(stored["hidden"].view(torch.uint8), q.view(torch.uint8))  # the bytes as stored
    f = io.BytesIO(blob)
    out = fmt.read_tensors(f, fmt.read_header(f, len(blob)))
    assert set(out) == {"hidden", "input_ids"}  # the scale folded in
    assert out["hidden"].dtype == torch.bfloat16 and torch.equal(out["hidden"], quant.dequantize(q, s))


def test_a_file_without_a_quantized_tensor_stays_version_1():
    blob = encode([raw("hidden", states())], "bytegroup")
    assert json.loads(blob[16:16 + struct.unpack("<Q", blob[8:16])[0]])["__format__"] == {"version": 1}


def test_fp8_bytes_are_entropy_coded():
    *_, blob = compact_file(rows=512, hidden=1024)
    assert len(blob) < 0.9 * 512 * 1024  # a Huffman code over the e4m3 values, smaller than a byte each


def _with_quant(entry_quant, scale_shape=(33,), scale_dtype="float32", dtype="float8_e4m3fn", version=2):
    x, q, s, blob = compact_file()
    n = struct.unpack("<Q", blob[8:16])[0]
    header = json.loads(blob[16:16 + n])
    header["__format__"]["version"] = version
    header["hidden"]["quant"] = entry_quant
    header["hidden"]["dtype"] = dtype
    header["hidden_scale"]["shape"] = list(scale_shape)
    header["hidden_scale"]["dtype"] = scale_dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return fmt.MAGIC + struct.pack("<Q", len(text)) + text + blob[16 + n:]


@pytest.mark.parametrize("kw", [
    {"entry_quant": {"scheme": "int4", "scale": "hidden_scale"}},
    {"entry_quant": {"scheme": "fp8_e4m3", "scale": "missing"}},
    {"entry_quant": {"scheme": "fp8_e4m3", "scale": "input_ids"}},  # not a float32 scale
    {"entry_quant": {"scheme": "fp8_e4m3", "scale": "hidden_scale"}, "version": 1},
])
def test_malformed_quant_entries_are_refused(kw):
    blob = _with_quant(**kw)
    with pytest.raises(fmt.TensorInvalidInfo):
        fmt.read_header(io.BytesIO(blob), len(blob))


def test_a_version_this_reader_does_not_know_names_the_upgrade():
    blob = _with_quant({"scheme": "fp8_e4m3", "scale": "hidden_scale"}, version=3)
    with pytest.raises(fmt.UnsupportedVersion, match="upgrade hs_capture"):
        fmt.read_header(io.BytesIO(blob), len(blob))


def test_a_step_goes_to_its_files_quantized(tmp_path):
    """server/step.compact on a step as take_step leaves it (SGLang's packed aux included),
    through the stager and step_files, read back by the offline reader."""
    from hs_capture.dump.paths import RankId
    from hs_capture.dump.schema import SeqEntry, step_line
    from hs_capture.server.staging import CpuCopy, Stager
    from hs_capture.server.step import compact
    from hs_capture.server.step_files import write_step_files

    T, H = 37, 64
    aux, final = states(T, 3 * H, seed=1), states(T, H, seed=2)
    tensors = {"final": final, "aux": aux, "tokens": torch.arange(T), "positions": torch.arange(T)}
    line, out, aux_layers = compact(step_line("EXTEND", T, T, "bfloat16", [SeqEntry("a", T, 0, 0)]), tensors,
                                    [2, 3, 5], H)
    assert line.dtype == "float8_e4m3fn" and aux_layers == []
    assert set(out) == {"final", "final#scale", "L02", "L02#scale", "L03", "L03#scale", "L05", "L05#scale",
                        "tokens", "positions"}
    stager = Stager(copier=CpuCopy())
    staged = stager.stage(out, inputs=("tokens", "positions"))
    files, raw_bytes, _ = write_step_files(str(tmp_path), RankId(0, 0, 0), 0, {"run_id": "r"},
                                           staged.buffer.tensor.numpy(), staged.layout, aux_layers, "bytegroup", 1,
                                           False)
    assert set(files) == {"final", "L02", "L03", "L05"}
    assert raw_bytes == 4 * (T * H + 4 * T) + 2 * 8 * T
    got = fmt.read_arrays(str(tmp_path / files["L03"].path))
    assert set(got) == {"hidden"}
    want = aux[:, H:2 * H].float().numpy()
    rel = np.linalg.norm(got["hidden"] - want, axis=1) / np.linalg.norm(want, axis=1)
    np.testing.assert_allclose(rel, quant.rel_error(want), rtol=1e-5)  # exactly what quantizing it gives
    fin = fmt.read_arrays(str(tmp_path / files["final"].path))
    assert np.array_equal(fin["input_ids"], np.arange(T))
