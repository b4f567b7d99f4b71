"""hscap verify on a dump from the REAL CPU server and on every merge format: the clean data
passes (with --dataset and --reference against transformers); each injected fault is caught
by its own check, with a message naming the file or rid."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hs_capture.dump import hst as fmt
from hs_capture.cli import main
from tests.sglang_cpu.harness import make_tiny_deepseek, write_jsonl


def verify(*args):
    res = CliRunner().invoke(main, ["verify", "--json", *args], catch_exceptions=False)
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["ok"] == (res.exit_code == 0)
    return res.exit_code, doc


def errors(doc, check=None):
    """Error findings (of one check); without a check, all but the coverage findings that
    follow from a damaged step (asserted separately where it matters)."""
    return [f for f in doc["findings"] if f["severity"] == "error"
            and (f["check"] == check if check else f["check"] != "coverage")]


def rids_of(line):
    return {s["rid"] for s in line["seqs"] if s["rid"] and not s["rid"].startswith("HEALTH_CHECK_")}


@pytest.fixture
def copy(served_dump, tmp_path):
    """A private copy of the served dump: (dump dir, run dir, first index line with files)."""
    d = tmp_path / "dump"
    shutil.copytree(served_dump["dir"], d)
    (run,) = [d / x for x in os.listdir(d)]
    return str(d), run


def lines_of(run):
    return (run / "index" / "dp0-tp0-pp0.jsonl").read_text().splitlines(keepends=True)


def part_file(run, k, part, min_tokens=1):
    """The file of one part of the k-th written step (of those with min_tokens), with its index line."""
    line = [x for x in map(json.loads, lines_of(run)) if "files" in x and x["num_tokens"] >= min_tokens][k]
    return str(run / line["files"][part]["path"]), line


def rewrite(path, change):
    """Re-encode a .hst file with its hidden state changed: a VALID file holding bad values."""
    with open(path, "rb") as f:
        header = fmt.read_header(f, os.fstat(f.fileno()).st_size)
        tensors = {n: (e, bytearray(fmt.read_tensor_bytes(f, header, n))) for n, e in header.tensors.items()}
    out = []
    for n, (e, raw) in tensors.items():
        if n == "hidden":
            a = np.frombuffer(raw, dtype=np.float32).reshape(e.shape).copy()
            raw = change(a).astype(np.float32).tobytes()
        out.append(fmt.RawTensor(n, e.dtype, list(e.shape), memoryview(bytes(raw))))
    with open(path, "wb") as f:
        for c in fmt.encode_file(out, header.metadata, "zstd", 1):
            f.write(c)


def hidden_of(path):
    with open(path, "rb") as f:
        h = fmt.read_header(f, os.fstat(f.fileno()).st_size)
        e = h.tensors["hidden"]
        return fmt.to_numpy(fmt.read_tensor_bytes(f, h, "hidden"), e.dtype, e.shape).copy()


# ------------------------------------------------------------------ the clean dump
def test_clean_dump_passes_every_check_with_dataset_and_reference(served_dump, tiny_model):
    code, doc = verify(served_dump["dir"], "--dataset", served_dump["data"], "--reference", tiny_model,
                       "--reference-samples", "5")
    assert code == 0, errors(doc)
    ran = {r["check"] for r in doc["checks"]}
    assert {"files", "checksum", "placement", "coverage", "tokens", "nonfinite", "degenerate", "identical",
            "reference", "positions", "shapes", "ranks", "index"} <= ran
    st = doc["stats"]
    assert st["samples_complete"] == len(served_dump["rows"]) and st["samples_incomplete"] == 0
    assert st["steps_decoded"] == st["steps"] > 1 and st["reference_samples"] == 5
    assert st["reference_max_abs_diff"] <= 1e-4


def test_human_summary_is_a_table_and_sample_mode_decodes_k_steps(served_dump):
    res = CliRunner().invoke(main, ["verify", served_dump["dir"], "--sample", "3", "-j", "2"])
    assert res.exit_code == 0 and "PASS: 0 error(s)" in res.output and "steps_decoded=3" in res.output
    assert res.stdout.splitlines()[0].split()[:3] == ["check", "status", "checked"]


# ------------------------------------------------------------------ one fault, one check
def flip_a_bit(path):
    """One bit of a .hst file's payload flipped: the file keeps its size, only decoding finds it."""
    with open(path, "r+b") as f:
        h = fmt.read_header(f, os.fstat(f.fileno()).st_size)
        e = h.tensors["hidden"]
        at = h.payload_start + (e.begin + e.end) // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_flipped_bit_is_a_checksum_error(copy):
    d, run = copy
    path, line = part_file(run, 1, "L03")
    flip_a_bit(path)
    code, doc = verify(d)
    (f,) = errors(doc)
    assert code == 1 and f["check"] == "checksum" and f["path"].endswith(os.path.relpath(path, d))
    assert {x["rid"] for x in errors(doc, "coverage")} == rids_of(line)  # the samples merge would lose


def test_truncated_file_is_named(copy):
    d, run = copy
    path, _ = part_file(run, 0, "final")
    os.truncate(path, os.path.getsize(path) - 100)
    code, doc = verify(d)
    assert code == 1 and {f["check"] for f in errors(doc)} == {"truncated"}
    assert all(f["path"].endswith(os.path.basename(path)) for f in errors(doc))


def test_a_dump_holding_merged_output_is_still_checked_as_a_dump(copy, served_dump, tmp_path):
    """Older merges wrote into the dump when asked (-o DUMP): verify then took the directory for
    merged output and passed a truncated dump file."""
    d, run = copy
    out = tmp_path / "mo"
    res = CliRunner().invoke(main, ["merge", "-q", d, "-o", str(out), "--format", "modelopt", "--dataset",
                                    served_dump["data"]], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    for name in os.listdir(out):  # what `merge -o DUMP` used to leave there
        shutil.copy(out / name, os.path.join(d, name))
    path, line = part_file(run, 2, "final")
    os.truncate(path, os.path.getsize(path) - 100)
    code, doc = verify(d, "--dataset", served_dump["data"])
    assert code == 1 and "truncated" in {f["check"] for f in errors(doc)}, doc["findings"][:5]
    broken = rids_of(line) & {r["id"] for r in served_dump["rows"]}  # the samples that step breaks
    assert broken and {x["rid"] for x in errors(doc, "coverage")} == broken


def test_deleted_file_is_missing(copy):
    d, run = copy
    path, line = part_file(run, 2, "L05")
    os.remove(path)
    code, doc = verify(d)
    (f,) = errors(doc, "files")
    assert code == 1 and "missing" in f["message"] and f["path"].endswith(os.path.basename(path))
    # merge would skip the samples of that step: verify names them too
    assert {x["rid"] for x in errors(doc, "coverage")} == rids_of(line)


def test_deleted_index_line_leaves_a_missing_step_and_extra_files(copy, served_dump):
    d, run = copy
    lines = lines_of(run)
    gone = json.loads(lines[3])
    (run / "index" / "dp0-tp0-pp0.jsonl").write_text("".join(lines[:3] + lines[4:]))
    code, doc = verify(d, "--dataset", served_dump["data"])  # a sample wholly in that step: only the dataset knows it
    assert code == 1
    assert any(f"no index line: {gone['step']}" in f["message"] for f in errors(doc, "index"))
    assert len(errors(doc, "files")) == len(gone["files"]) and {f["check"] for f in errors(doc)} <= {"index", "files"}
    assert all("extra" in f["message"] for f in errors(doc, "files"))
    assert {f["rid"] for f in errors(doc, "coverage")} == {s["rid"] for s in gone["seqs"]}


def test_swapped_layer_files_are_misplaced(copy):
    d, run = copy
    a, _ = part_file(run, 1, "L02")
    b, _ = part_file(run, 1, "L03")
    tmp = a + ".swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    code, doc = verify(d)
    found = errors(doc)
    assert code == 1 and {f["check"] for f in found} == {"placement"} and len(found) == 2
    assert any("part='L03' (expected 'L02')" in f["message"] for f in found)


def _corrupt_header(path):
    with open(path, "r+b") as f:
        f.seek(16)
        f.write(b"\xff\xfe")


@pytest.mark.parametrize("part, damage, check, words", [
    ("L03", lambda path: rewrite(path, np.zeros_like), "degenerate", "all zeros"),  # a zeroed tensor
    ("L02", _corrupt_header, "header", "InvalidHeader"),  # a corrupt header is named
])
def test_one_damaged_file_is_one_named_finding(copy, part, damage, check, words):
    d, run = copy
    path, _ = part_file(run, 0, part)
    damage(path)
    code, doc = verify(d)
    (f,) = errors(doc)
    assert code == 1 and f["check"] == check and words in f["message"]


def test_leftover_temp_file_is_reported(copy):
    d, run = copy
    path, _ = part_file(run, 0, "L02")
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp-4242")
    shutil.copy(path, tmp)
    code, doc = verify(d)
    (f,) = errors(doc)
    assert code == 1 and f["check"] == "files" and "temp file" in f["message"] and f["path"].endswith(".tmp-4242")


def test_nan_and_identical_layers_and_zero_rows(copy):
    d, run = copy
    p1, _ = part_file(run, 0, "L02")
    p3, _ = part_file(run, 0, "L03")
    p5, _ = part_file(run, 1, "L05", min_tokens=2)
    pn, _ = part_file(run, 2, "L02")
    same = hidden_of(p1)

    def nan(a):
        a[0, 7] = np.nan
        return a

    def zero_row(a):
        a[-1] = 0
        return a
    rewrite(p3, lambda a: same)  # the same layer written twice
    rewrite(pn, nan)
    rewrite(p5, zero_row)
    code, doc = verify(d)
    by = {f["check"]: f for f in errors(doc)}
    assert set(by) == {"identical", "nonfinite", "degenerate"}
    assert "1 NaN" in by["nonfinite"]["message"] and "row 0" in by["nonfinite"]["message"]
    assert "L02 and L03" in by["identical"]["message"] and "rows are all zeros" in by["degenerate"]["message"]


def test_dataset_token_mismatch_and_unsent_sample(served_dump, tmp_path):
    rows = [dict(r) for r in served_dump["rows"]]
    rows[5] = {**rows[5], "input_ids": rows[5]["input_ids"][:10] + [3] + rows[5]["input_ids"][11:]}
    rows.append({"id": "never-sent", "input_ids": [1, 2, 3]})
    code, doc = verify(served_dump["dir"], "--dataset", write_jsonl(tmp_path / "d.jsonl", rows))
    toks = errors(doc, "tokens")
    assert code == 1 and {f["rid"] for f in toks} == {rows[5]["id"]} and "position 10" in toks[0]["message"]
    assert [(f["rid"], f["message"]) for f in errors(doc, "coverage")] == [("never-sent", "never captured")]


def test_missing_rank_dropped_step_and_mixed_runs(copy):
    d, run = copy
    meta_path = run / "ranks" / "dp0-tp0-pp0.json"
    meta = json.loads(meta_path.read_text())
    meta["parallel"]["dp_size"] = 2  # the run had two DP groups: dp1's files are not here
    meta_path.write_text(json.dumps(meta))
    lines = lines_of(run)
    last = json.loads(lines[-1])
    dropped = {k: last[k] for k in ("mode", "num_tokens", "seqs")}
    with open(run / "index" / "dp0-tp0-pp0.jsonl", "a") as f:
        f.write(json.dumps({**dropped, "step": last["step"] + 1, "dropped": "writer_full"}) + "\n")
    other = run.parent / (run.name + "-other")
    shutil.copytree(run, other)
    om = json.loads((other / "ranks" / "dp0-tp0-pp0.json").read_text())
    om["layers"] = [1, 2, 5]
    (other / "ranks" / "dp0-tp0-pp0.json").write_text(json.dumps(om))
    code, doc = verify(d)
    checks = {f["check"] for f in errors(doc)}
    assert code == 1 and {"ranks", "dropped", "config"} <= checks
    assert "DP group 1 of 2" in errors(doc, "ranks")[0]["message"]
    assert "writer_full" in errors(doc, "dropped")[0]["message"]
    assert any("layers=[1, 2, 5]" in f["message"] for f in errors(doc, "config"))


def test_bad_input_is_one_line(tmp_path):
    res = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert res.exit_code == 1 and "no hs_capture run here" in res.output and "Traceback" not in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    res = CliRunner().invoke(main, ["verify", str(tmp_path), "--dataset", str(bad)])
    assert res.exit_code == 1 and "line 1: not JSON" in res.output


# ------------------------------------------------------------------ merged outputs
@pytest.fixture(scope="module")
def merged(served_dump, tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    out = {}
    for f in ("specforge", "modelopt", "speculators", "hscap"):
        out[f] = str(root / f)
        res = CliRunner().invoke(main, ["merge", "-q", served_dump["dir"], "-o", out[f], "--format", f,
                                        "--dataset", served_dump["data"]], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("name", ["specforge", "modelopt", "speculators", "hscap"])
def test_every_merge_format_passes_with_reference(merged, served_dump, tiny_model, name):
    code, doc = verify(merged[name], "--dataset", served_dump["data"], "--reference", tiny_model,
                       "--reference-samples", "3")
    assert code == 0, errors(doc)
    assert doc["stats"]["samples"] == len(served_dump["rows"]) and doc["stats"]["formats"] == [name]
    assert doc["stats"]["reference_samples"] == 3 and doc["stats"]["reference_max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("name", ["specforge", "modelopt", "speculators", "hscap"])
def test_merged_output_checked_against_an_unrelated_dataset_fails(merged, served_dump, tmp_path, name):
    other = tmp_path / "other.jsonl"
    with open(served_dump["data"]) as f, open(other, "w") as g:
        for line in f:
            row = json.loads(line)
            g.write(json.dumps({**row, "id": "other-" + str(row["id"])}) + "\n")
    code, doc = verify(merged[name], "--dataset", str(other))
    assert code == 1
    # every sample is named: its id missing from the output, or (speculators keeps the id a file
    # was merged from) the file's id not in the dataset
    named = [f for f in doc["findings"] if f["severity"] == "error" and (
        "missing from the merged output" in f["message"] or "not in the dataset" in f["message"])]
    assert len(named) >= len(served_dump["rows"]), doc["findings"][:3]


def test_merged_faults_are_caught(merged, served_dump, tmp_path):
    sf = tmp_path / "sf"
    shutil.copytree(merged["specforge"], sf)
    ckpts = sorted(p for p in os.listdir(sf) if p.endswith(".ckpt"))
    d = torch.load(sf / ckpts[0], weights_only=True)
    d["aux_hidden_state"][..., :256] = 0
    torch.save(d, sf / ckpts[0])
    os.remove(sf / ckpts[1])
    (sf / (".x.ckpt.tmp-1")).write_bytes(b"half")
    code, doc = verify(str(sf), "--dataset", served_dump["data"])
    assert code == 1
    assert errors(doc, "degenerate")[0]["path"].endswith(ckpts[0])
    assert len(errors(doc, "coverage")) == 1 and "missing from the merged output" in errors(doc, "coverage")[0]["message"]
    assert len(errors(doc, "files")) == 1
    sp = tmp_path / "sp"
    shutil.copytree(merged["speculators"], sp)
    os.truncate(sp / "hs_3.safetensors", os.path.getsize(sp / "hs_3.safetensors") - 8)
    code, doc = verify(str(sp))
    (f,) = errors(doc)
    assert code == 1 and f["check"] == "truncated" and f["path"].endswith("hs_3.safetensors")
    na = tmp_path / "na"
    shutil.copytree(merged["hscap"], na)
    (shard,) = os.listdir(na / "shards")
    with open(na / "shards" / shard, "r+b") as f:
        f.seek(-1000, 2)
        b = f.read(1)
        f.seek(-1000, 2)
        f.write(bytes([b[0] ^ 1]))
    code, doc = verify(str(na))
    assert code == 1 and {f["check"] for f in errors(doc)} == {"checksum"}


def test_reference_catches_a_dump_of_another_model(served_dump, tmp_path):
    other = make_tiny_deepseek(str(tmp_path / "other"), layers=6, seed=1)
    code, doc = verify(served_dump["dir"], "--reference", other, "--reference-samples", "2")
    assert code == 1 and {f["check"] for f in errors(doc)} == {"reference"}
    assert "exceeds atol=0.0001" in errors(doc)[0]["message"]
