"""One completeness rule (hs_capture.offline.read.coverage, planning) for send, merge, verify and
DumpDataset: they agree on a sample split across two runs, on a sample captured whole and then
again in part in the same run (the radix cache on, the dataset sent twice: the re-send
recomputes only the last token), which is merged from its whole capture, and on a dump with a
deleted, a truncated and a bit-flipped step file."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from hs_capture.dump import hst as fmt
from hs_capture.cli import main
from hs_capture.dump.paths import RankId, step_file
from hs_capture.offline.read.reader import open_runs
from hs_capture.dump.files import atomic_write
from tests.sglang_cpu.harness import serve_and_send, server_env, write_jsonl
from tests.test_verify import errors, flip_a_bit, verify


def cli(*args):
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res


def send_dry_run(data, dump, *extra):
    code, res = cli("send", data, "--dry-run", "--dump-dir", dump, "--json", "--failures", os.devnull + "x", *extra)
    assert code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def merged_ids(dump, data, out):
    code, res = cli("merge", dump, "-o", str(out), "--format", "modelopt", "--dataset", data, "--json")
    assert code == 0, res.output
    with open(os.path.join(out, "merge_report.json")) as f:
        return json.loads(res.stdout.strip().splitlines()[-1]), json.load(f)


def split_run(dump, from_step):
    """Move the steps >= from_step of the dump's one run into a later run of their own (files
    re-written under that run's id, as its own server would have): a sample whose chunks were
    captured by two runs."""
    (run,) = open_runs(dump)
    new_id = "run-99991231T000000Z-split-1"
    new = os.path.join(dump, new_id)
    for sub in ("ranks", "index"):
        os.makedirs(os.path.join(new, sub))
    for tag, typed in run.ranks.items():
        meta = typed.to_json()  # the files as written, edited by hand
        keep, move = [], []
        for line in (x.to_json() for x in run.index(tag)):
            (move if line["step"] >= from_step else keep).append(line)
        for path, run_id, lines in ((os.path.join(run.path, "ranks", tag + ".json"), meta["run_id"], keep),
                                    (os.path.join(new, "ranks", tag + ".json"), new_id, move)):
            stats = {**meta["stats"], "steps_written": sum(1 for x in lines if "files" in x),
                     "tokens_written": sum(x["num_tokens"] for x in lines if "files" in x)}
            with open(path, "w") as f:
                json.dump({**meta, "run_id": run_id, "stats": stats}, f)
        for line in move:  # the new run numbers its steps from 0, as a new server does
            line["step"] -= from_step
            for part, info in line["files"].items():
                src = os.path.join(run.path, info["path"])
                with open(src, "rb") as f:
                    header = fmt.read_header(f, os.fstat(f.fileno()).st_size)
                    tensors = [fmt.RawTensor(n, e.dtype, list(e.shape), fmt.read_tensor_bytes(f, header, n))
                               for n, e in header.tensors.items()]
                info["path"] = step_file(RankId(*(int(x[2:]) for x in tag.split("-"))), line["step"], part)
                dst = os.path.join(new, info["path"])
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                md = {**header.metadata, "run_id": new_id, "step": str(line["step"])}
                info["bytes"] = atomic_write(dst, fmt.encode_file(tensors, md), False)
                os.remove(src)
        for path, lines in ((os.path.join(run.path, "index", tag + ".jsonl"), keep),
                            (os.path.join(new, "index", tag + ".jsonl"), move)):
            with open(path, "w") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)
    return run, new


def test_a_sample_split_across_two_runs_is_whole_for_send_merge_and_verify(served_dump, tmp_path):
    dump = str(tmp_path / "dump")
    shutil.copytree(served_dump["dir"], dump)
    (run,) = open_runs(dump)
    tag = next(iter(run.ranks))
    long_rid = served_dump["rows"][7]["id"]  # 600 tokens: five 128-token chunks
    steps = sorted(x.step for x in run.index(tag) if long_rid in x.rids())
    assert len(steps) >= 3
    split_run(dump, steps[1])  # its first chunk in the first run, the rest in the second
    rows, data = served_dump["rows"], served_dump["data"]
    assert send_dry_run(data, dump)["skipped_already_captured"] == len(rows)  # send: nothing to re-send
    summary, report = merged_ids(dump, data, tmp_path / "out")
    assert summary["written"] == len(rows) and report["incomplete"] == {}  # merge: all written
    code, doc = verify(dump, "--dataset", data)
    assert code == 0 and doc["stats"]["samples_complete"] == len(rows), errors(doc)  # verify: all whole
    _, doc = verify(str(tmp_path / "out"), "--dataset", data)
    assert doc["ok"], errors(doc)


@pytest.fixture(scope="module")
def sent_twice(tiny_model, tmp_path_factory):
    """The radix cache ON and shared by captured requests (HSCAP_CACHE_NAMESPACE=0) and the
    dataset sent twice to one server: the second send hits the cache and recomputes (and so
    captures) only each sample's last token."""
    root = tmp_path_factory.mktemp("twice")
    rows = [{"id": f"r{i}", "input_ids": [(7 * i + j) % 900 + 2 for j in range(n)]}
            for i, n in enumerate([30, 90, 150, 64, 200, 45])]
    data = write_jsonl(root / "data.jsonl", rows)
    dump = str(root / "dump")
    serve_and_send(tiny_model, server_env(dump, HSCAP_LAYERS="1,3", HSCAP_CACHE_NAMESPACE="0"), root,
                   ["--chunked-prefill-size", "128"], data, len(rows), concurrency=2, times=2,
                   warmup=False)  # radix cache on
    return {"dump": dump, "data": data, "rows": rows, "root": root, "model": tiny_model}


def test_a_sample_captured_whole_then_again_in_part_is_merged_from_its_whole_capture(sent_twice, tmp_path):
    dump, data, rows = sent_twice["dump"], sent_twice["data"], sent_twice["rows"]
    (run,) = open_runs(dump)
    seen = {}
    for tag in run.ranks:
        for line in run.index(tag):
            for s in line.seqs:
                seen.setdefault(s.rid, []).append((s.prefix, s.len))
    again = [r["id"] for r in rows if len(seen[r["id"]]) > 1 and any(p > 0 for p, _ in seen[r["id"]])]
    assert len(again) >= 4, seen  # the re-sends hit the radix cache: captured again in part
    assert send_dry_run(data, dump)["skipped_already_captured"] == len(rows)
    summary, report = merged_ids(dump, data, tmp_path / "out")
    assert summary["written"] == len(rows) and report["incomplete"] == {}
    assert set(again) <= set(report["recaptured"])
    code, doc = verify(dump, "--dataset", data)
    assert code == 0 and doc["stats"]["samples_complete"] == len(rows), errors(doc)
    warned = {f["rid"] for f in doc["findings"] if f["check"] == "coverage" and f["severity"] == "warning"}
    assert set(again) <= warned
    code, doc = verify(str(tmp_path / "out"), "--dataset", data, "--reference", sent_twice["model"])
    assert code == 0, errors(doc)


@pytest.fixture
def damaged(served_dump, tmp_path):
    """A copy of the served dump with a deleted, a truncated and a bit-flipped step file, and the
    samples each of them holds."""
    dump = str(tmp_path / "dump")
    shutil.copytree(served_dump["dir"], dump)
    (run,) = open_runs(dump)
    tag = next(iter(run.ranks))
    lines = [x for x in run.index(tag) if x.written and x.rids() and not any(
        r.startswith("HEALTH_CHECK_") for r in x.rids())]
    deleted, truncated, flipped = lines[1], lines[-2], lines[len(lines) // 2]
    assert len({deleted.step, truncated.step, flipped.step}) == 3
    os.remove(os.path.join(run.path, deleted.files["L03"].path))
    path = os.path.join(run.path, truncated.files["final"].path)
    os.truncate(path, os.path.getsize(path) - 100)
    flip_a_bit(os.path.join(run.path, flipped.files["L02"].path))
    sized = set(deleted.rids()) | set(truncated.rids())  # what the files' sizes show
    return {"dump": dump, "sized": sized, "flipped": set(flipped.rids()) - sized, "all": sized | set(flipped.rids()),
            "rows": served_dump["rows"], "data": served_dump["data"]}


def test_send_merge_verify_and_the_dataset_agree_on_a_damaged_dump(damaged, tmp_path):
    """A deleted, a truncated and a bit-flipped step file: the samples they hold are not whole for
    any tool that reads them. Sizes alone (a stat per file) show the first two; the flipped bit
    shows when the file is decoded: merge and verify always decode, send's resume with
    --check-data, DumpDataset with check_data=N (else when it reads the sample: a one-line
    DumpError)."""
    from hs_capture.offline.train.dump_dataset import DumpDataset
    from hs_capture.offline.read.planning import plan
    from hs_capture.offline.read.reader import DumpError

    dump, rows, data, hit = damaged["dump"], damaged["rows"], damaged["data"], damaged["all"]
    assert damaged["flipped"]
    # send: its resume re-sends what the sizes show; with --check-data, the flipped step's too
    assert send_dry_run(data, dump)["skipped_already_captured"] == len(rows) - len(damaged["sized"])
    checked = send_dry_run(data, dump, "--check-data", "-j", "2")
    assert checked["skipped_already_captured"] == len(rows) - len(hit) and checked["damaged_steps"] == 1
    # merge: all three damaged steps' samples unwritten, each with its cause
    summary, report = merged_ids(dump, data, tmp_path / "out")
    assert summary["written"] == len(rows) - len(hit) and set(report["incomplete"]) == hit
    reasons = report["incomplete"].values()
    assert any("L03 file is missing" in why for why in reasons)
    assert any("not the" in why and "its index line says" in why for why in reasons)
    assert any("unreadable" in why and ".L02.hst" in why for why in reasons)
    # verify: fails, and counts exactly the others whole
    code, doc = verify(dump, "--dataset", data)
    assert code == 1 and doc["stats"]["samples_complete"] == len(rows) - len(hit)
    # DumpDataset: the sizes' damage out of len and named; the flipped step's samples fail in one line
    ds = DumpDataset(dump, data)
    assert len(ds) == len(rows) - len(damaged["sized"]) and set(ds.incomplete) == damaged["sized"]
    for rid in damaged["flipped"]:
        with pytest.raises(DumpError) as e:
            ds.by_id(rid)
        assert "\n" not in str(e.value) and repr(rid) in str(e.value) and ".L02.hst" in str(e.value)
    for rid in set(ds.rids) - hit:
        ds.by_id(rid)
    # DumpDataset(check_data=N) decodes every step at open, as merge does: all three out of len
    checked_ds = DumpDataset(dump, data, check_data=2)
    assert len(checked_ds) == len(rows) - len(hit) and set(checked_ds.incomplete) == hit
    # the plan the tools share, with every step decoded first: all three left out, each with its cause
    p = plan([dump], {r["id"]: len(r["input_ids"]) for r in rows}, check_jobs=2)
    assert set(p.incomplete) == hit and set(p.samples) == {r["id"] for r in rows} - hit
    assert any("L02 file fails when decoded" in why for why in p.incomplete.values())
    with pytest.raises(DumpError, match="no such directory"):
        DumpDataset(str(tmp_path / "missing"))


def test_a_damaged_sample_under_dataloader_workers_is_one_line_in_the_trainers_process(damaged):
    import torch

    from hs_capture.offline.train.dump_dataset import DumpDataset
    from hs_capture.offline.read.reader import DumpError

    ds = DumpDataset(damaged["dump"], damaged["data"])
    rid = sorted(damaged["flipped"])[0]
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, [ds.rids.index(rid)]), batch_size=None,
                                         num_workers=1)
    with pytest.raises(DumpError) as e:
        next(iter(loader))
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"sample {rid!r}: ") and message.endswith("(in DataLoader worker process 0)"), message
