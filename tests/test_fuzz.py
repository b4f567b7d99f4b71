"""Every reader of untrusted bytes, fuzzed with hypothesis: .hst headers and payloads (raw,
zstd, bytegroup at both transforms), index lines, run metadata, the safetensors reader of
verify. Malformed input gives the reader's own clear error: never another exception, a hang
or a huge allocation, and nothing read from a dump is ever unpickled."""

import io
import json
import os
import pickle
import tracemalloc

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hs_capture.dump import codec as codec_mod
from hs_capture.dump import hst as fmt
from hs_capture.cli import main
from hs_capture.server.config import CaptureConfig
from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import IndexLine, RankMeta, SchemaError, SeqEntry, step_line
from hs_capture.offline.read.reader import open_runs
from hs_capture.offline.formats import FORMATS, SampleRef
from hs_capture.offline.formats.speculators import load_safetensors
from hs_capture.server.writer import ShardWriter
from tests.sglang_cpu.stitch import stitch

FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 40, generator=g)
    x *= torch.rand(24, 1, generator=g) + 0.5
    return [fmt.RawTensor("a", "bfloat16", [24, 40], memoryview(x.to(torch.bfloat16).view(torch.uint8).numpy())),
            fmt.RawTensor("b", "float32", [24, 40], memoryview(x.view(torch.uint8).numpy())),
            fmt.RawTensor("ids", "int64", [24], memoryview(torch.arange(24).view(torch.uint8).numpy()))]


SEEDS = {(codec, level): b"".join(bytes(c) for c in fmt.encode_file(tensors(), {"k": "v"}, codec, level))
         for codec, level in (("raw", 1), ("zstd", 1), ("bytegroup", 1), ("bytegroup", 2))}


def read_all(blob: bytes) -> list:
    """What every reader does: the header, then each tensor (decoded and checksummed). Returns
    the decoded bytes of each tensor."""
    f = io.BytesIO(blob)
    h = fmt.read_header(f, len(blob))
    return [bytes(fmt.read_tensor_bytes(f, h, name)) for name in h.tensors]


WRITTEN = {bytes(t.data) for t in tensors()}  # the raw bytes each seed file holds, whatever its codec
assert all(sorted(read_all(blob)) == sorted(WRITTEN) for blob in SEEDS.values())

mutation = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8)
# a byte of the last tensor's payload changed: only the crc32 can tell (the raw codec has no other check)
PAYLOAD_FLIP = len(SEEDS[("raw", 1)]) - 8, SEEDS[("raw", 1)][-8] ^ 0x01


@FUZZ
@given(seed=st.sampled_from(sorted(SEEDS)), edits=mutation, cut=st.none() | st.integers(0, 1 << 20))
@example(seed=("raw", 1), edits=[PAYLOAD_FLIP], cut=None)
def test_mutated_tensor_files_fail_only_with_format_errors(seed, edits, cut):
    """Damage is a FormatError, or a read that still gives back exactly the bytes written:
    never other bytes (a damaged payload that decodes is caught by its crc32)."""
    blob = bytearray(SEEDS[seed])
    for at, value in edits:
        blob[at % len(blob)] = value
    if cut is not None:
        del blob[cut % len(blob):]
    try:
        got = read_all(bytes(blob))
    except fmt.FormatError:
        return
    assert set(got) <= WRITTEN, "damaged bytes were read back as if whole"


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_are_never_a_tensor_file(data):
    with pytest.raises(fmt.FormatError):
        read_all(fmt.MAGIC + data if data[:1] == b"\x00" else data)


@FUZZ
@given(shape=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=3), codec=st.sampled_from(fmt.CODECS),
       dtype=st.sampled_from(sorted(fmt.ITEMSIZE)))
def test_headers_claiming_huge_tensors_are_refused_without_allocating(shape, codec, dtype):
    """A valid header (nbytes = its shape's) over a 64-byte frame: whatever size it claims (up
    to 2^60 bytes), reading allocates about what the file holds, never what the header says."""
    import zstandard

    frame = zstandard.ZstdCompressor().compress(b"\0" * 64)
    nbytes = int(np.prod(shape)) * fmt.ITEMSIZE[dtype]
    header = {"__format__": {"version": 1},
              "x": {"dtype": dtype, "shape": shape, "codec": codec, "offsets": [0, len(frame)], "nbytes": nbytes,
                    "crc32": 0}}
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    blob = fmt.MAGIC + len(body).to_bytes(8, "little") + body + frame
    tracemalloc.start()
    try:
        read_all(blob)
    except fmt.FormatError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated for a {len(blob)}-byte file claiming {nbytes}"


def test_a_frame_declaring_far_more_than_it_can_hold_is_refused():
    import zstandard

    n = 1 << 36  # 64 GiB declared by a few bytes
    frame = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * 8))
    with pytest.raises(fmt.SizeMismatch):
        codec_mod.decode(bytes(frame), "zstd", n, 1)
    big = {"__format__": {"version": 1}, "x": {"dtype": "uint8", "shape": [n], "codec": "zstd",
                                               "offsets": [0, len(frame)], "nbytes": n, "crc32": 0}}
    body = json.dumps(big).encode()
    body += b" " * (-len(body) % 8)
    with pytest.raises(fmt.SizeMismatch):
        read_all(fmt.MAGIC + len(body).to_bytes(8, "little") + body + bytes(frame))


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                           max_leaves=20)
index_like = st.fixed_dictionaries({"step": st.integers(-2, 5) | st.text(max_size=3)}, optional={
    "files": st.dictionaries(st.text(max_size=4), st.fixed_dictionaries({"path": st.text(max_size=20) | st.integers()}),
                             max_size=3) | json_values,
    "seqs": st.lists(st.dictionaries(st.sampled_from(["rid", "len", "prefix", "offset"]), json_values), max_size=3),
    "num_tokens": json_values, "dropped": json_values})


@FUZZ
@given(st.one_of(json_values, index_like))
def test_index_lines_are_judged_never_crash(line):
    try:
        parsed = IndexLine.from_json(line)
    except SchemaError as e:
        assert str(e)
        return
    if parsed.written:  # accepted lines keep their paths inside the run
        assert all(not os.path.isabs(f.path) and not os.path.normpath(f.path).startswith("..")
                   for f in parsed.files.values())


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzzdump"))
    cfg = CaptureConfig(dump_dir=root, run_id="run-fuzz", layers=[1, 2], fsync=False, min_free_bytes=0)
    w = ShardWriter(cfg, RankId(), RankMeta(layers=[1, 2], hidden_size=16, num_layers=4, run_id="run-fuzz"))
    w.start()
    for i in range(3):
        t = {"final": torch.randn(5, 16), "aux": torch.randn(5, 32), "tokens": torch.arange(5),
             "positions": torch.arange(5)}
        w.submit(step_line("EXTEND", 5, 5, "float32", [SeqEntry(f"r{i}", 5, 0, 0)]),
                 t, aux_layers=[1, 2])
    assert w.close()
    return root


def _damage(dump: str, tmp, which: str, data: bytes) -> str:
    import shutil

    d = os.path.join(str(tmp), "d")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(dump, d)
    run = os.path.join(d, "run-fuzz")
    target = {"index": os.path.join(run, "index", "dp0-tp0-pp0.jsonl"),
              "meta": os.path.join(run, "ranks", "dp0-tp0-pp0.json")}[which]
    with open(target, "ab" if which == "index" else "wb") as f:
        f.write(data)
    return d


@settings(max_examples=40, deadline=10000, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["index", "meta"]), data=st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_verify_and_merge_on_damaged_metadata_exit_cleanly(small_dump, tmp_path, which, data):
    d = _damage(small_dump, tmp_path, which, data)
    res = CliRunner().invoke(main, ["verify", "--json", d])
    assert res.exit_code in (0, 1) and (res.exception is None or isinstance(res.exception, SystemExit)), res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])  # a verdict, with the damage as findings
    assert doc["ok"] == (res.exit_code == 0) and (doc["ok"] or doc["findings"])
    res = CliRunner().invoke(main, ["merge", d, "-o", os.path.join(str(tmp_path), "o"), "--format", "hscap"])
    assert res.exit_code in (0, 1) and (res.exception is None or isinstance(res.exception, SystemExit)), res.output


@FUZZ
@given(edits=mutation, cut=st.none() | st.integers(0, 4096))
def test_safetensors_reader_fails_only_with_format_errors(tmp_path_factory, edits, cut):
    from hs_capture.offline.formats.speculators import save_safetensors

    base = tmp_path_factory.getbasetemp()
    path = os.path.join(str(base), "st.safetensors")
    if not os.path.exists(path):
        save_safetensors({"hidden_states": torch.randn(3, 4, 8).to(torch.bfloat16), "token_ids": torch.arange(3)},
                         path, {"rid": "x"})
    blob = bytearray(open(path, "rb").read())
    for at, value in edits:
        blob[at % len(blob)] = value
    if cut is not None:
        del blob[cut % len(blob):]
    bad = path + ".bad"
    with open(bad, "wb") as f:
        f.write(blob)
    try:
        load_safetensors(bad)
    except fmt.FormatError:
        pass
    try:  # the format's reader on top: KeyError for a tensor the file lacks, else the format's errors
        FORMATS["speculators"].load(SampleRef("speculators", bad, hidden_size=8), {})
    except (fmt.FormatError, KeyError):
        pass


def test_reading_a_dump_never_unpickles(small_dump, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("something read from a dump was unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    (run,) = open_runs(small_dump)
    samples = stitch(run)
    assert sorted(samples) == ["r0", "r1", "r2"] and all(np.isfinite(s.final).all() for s in samples.values())
    res = CliRunner().invoke(main, ["verify", "--json", small_dump])
    assert res.exit_code == 0, res.output
    with pytest.raises(FileNotFoundError):  # the CLI refuses a missing dir before (click.Path(exists=True))
        open_runs(os.path.join(small_dump, "nope"))
