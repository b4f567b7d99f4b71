"""Faults against the REAL CPU server: kill -9 mid-capture and resume, a full disk (a tmpfs
made by the test) and the free-space floor, a slow disk with the drop policy, two servers on
one HSCAP_DIR, hostile rids, and the permissions of what is written. Each ends with what
`hscap verify` and `hscap merge` make of the dump. docs/faults.md's table states these (CONTRIBUTING.md maps them)."""

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.offline.read.planning import Captured
from tests.sglang_cpu.harness import REPO, Server, hscap_send, server_env, write_jsonl

CHUNK = ["--chunked-prefill-size", "128", "--disable-radix-cache"]


def dataset(n, seed, lo=20, hi=500, prefix="f"):
    rng = random.Random(seed)
    return [{"id": f"{prefix}{i:03d}", "input_ids": [rng.randrange(2, 1000) for _ in range(rng.randrange(lo, hi))]}
            for i in range(n)]


def verify(*args):
    res = CliRunner().invoke(main, ["verify", "--json", *args], catch_exceptions=False)
    assert res.exit_code in (0, 1) and "Traceback" not in res.output, res.output[-3000:]
    return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])


def merge(*args):
    res = CliRunner().invoke(main, ["merge", "--json", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def errors(doc, check=None):
    return [f for f in doc["findings"] if f["severity"] == "error" and (check is None or f["check"] == check)]


def incomplete_by_index(dump, rows):
    """The dataset ids whose captured positions do not cover [0, len): from the index lines
    alone: the rule send, merge and verify share (hs_capture.offline.read.coverage through Captured)."""
    cap = Captured([dump], strict=False)
    return {r["id"] for r in rows if cap.judge(r["id"], len(r["input_ids"]))[0] is None}


def index_lines(dump):
    n = 0
    for root, _, names in os.walk(dump):
        for name in names:
            if name.endswith(".jsonl"):
                with open(os.path.join(root, name), "rb") as f:
                    n += f.read().count(b"\n")
    return n


# ------------------------------------------------------------------ kill -9, then resume
def test_kill_9_mid_capture_loses_nothing_committed_and_a_resend_completes_it(tiny_model, tmp_path):
    rows = dataset(24, seed=1)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    dump = str(tmp_path / "dump")
    # A slow disk keeps steps queued in memory when the kill comes.
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5", HSCAP_TEST_SLOW_DISK_MS="150"),
                 str(tmp_path / "s1.log"), CHUNK, warmup=False)
    sender = None
    try:
        srv.wait_healthy()
        sender = subprocess.Popen([sys.executable, "-m", "hs_capture.cli", "send", data, "--url", srv.url, "-c", "4",
                                   "--retries", "0", "--failures", str(tmp_path / "f1.jsonl"), "-q"],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while index_lines(dump) < 6 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert index_lines(dump) >= 6, srv.log()[-2000:]
        os.killpg(srv.proc.pid, signal.SIGKILL)  # the whole server: launcher, scheduler, detokenizer
        srv.proc.wait(30)
    finally:
        if sender is not None:
            sender.kill()
            sender.wait()
        srv.kill()
    lost = incomplete_by_index(dump, rows)
    assert 0 < len(lost) < len(rows)
    code, doc = verify(dump, "--dataset", data)
    assert code == 1
    # what was committed is intact: no damaged file; the crash debris are only warnings
    assert not errors(doc) or {f["check"] for f in errors(doc)} == {"coverage"}
    assert {f["rid"] for f in errors(doc, "coverage")} == lost  # exactly the incomplete samples
    assert any(f["check"] == "status" for f in doc["findings"])
    s = merge(dump, "-o", str(tmp_path / "m1"), "--format", "specforge", "--dataset", data)
    assert s["written"] == len(rows) - len(lost) and s["incomplete"] == len(lost)

    # restart (a new run in the same dir) and re-send: only what is missing goes out
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5"), str(tmp_path / "s2.log"), CHUNK, warmup=False)
    try:
        srv.wait_healthy()
        rc, summary = hscap_send(data, "--url", srv.url, "-c", "4", "--dump-dir", dump,
                                 "--failures", str(tmp_path / "f2.jsonl"))
    finally:
        srv.stop()
    assert rc == 0 and summary["sent"] == len(lost) and summary["skipped_already_captured"] == len(rows) - len(lost)
    code, doc = verify(dump, "--dataset", data, "--reference", tiny_model, "--reference-samples", "3")
    assert code == 0, errors(doc)
    s = merge(dump, "-o", str(tmp_path / "m2"), "--format", "specforge", "--dataset", data)
    assert s["written"] == len(rows) and s["incomplete"] == 0


# ------------------------------------------------------------------ full disk, free-space floor
@pytest.fixture
def small_fs(tmpfs):
    """A 3 MB tmpfs, mounted and unmounted by the test."""
    return tmpfs("3m")


@pytest.mark.parametrize("floor,reason", [("0", "disk full"), ("0.0015", "below HSCAP_MIN_FREE_GB"),
                                          # in memory the floor is the host's available memory (the test's
                                          # tmpfs is as small as the floor is large: either stops capture)
                                          ("100000", "the dump dir is in memory (tmpfs) and the memory available")])
def test_full_disk_stops_capture_loudly_and_the_server_keeps_serving(tiny_model, tmp_path, small_fs, floor, reason):
    rows = dataset(16, seed=2, lo=200, hi=400)  # ~20 MB of states: far more than 3 MB
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    dump = os.path.join(small_fs, "dump")
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5", HSCAP_MIN_FREE_GB=floor, HSCAP_FSYNC="0"),
                 str(tmp_path / "s.log"), CHUNK, warmup=False)
    try:
        srv.wait_healthy()
        rc, summary = hscap_send(data, "--url", srv.url, "-c", "4", "--failures", str(tmp_path / "f.jsonl"))
        assert rc == 0 and summary["sent"] == len(rows) and summary["failed"] == 0  # serving went on
        srv.generate("after-the-stop", [5, 6, 7])  # and still goes on
    finally:
        srv.stop()
    log = srv.log()
    assert "[HS_DUMP] ERROR: rank dp0-tp0-pp0: capture STOPPED at step" in log and reason in log
    assert log.count("capture STOPPED") == 1
    assert "[HS_DUMP] rank dp0-tp0-pp0: the dump dir is in memory (tmpfs): capture stops when" in log
    (run,) = os.listdir(dump)
    meta = json.load(open(os.path.join(dump, run, "ranks", "dp0-tp0-pp0.json")))
    assert reason in meta["capture_stopped"]["reason"] and meta["capture_stopped"]["time"] > 0
    code, doc = verify(dump, "--dataset", data)
    assert code == 1 and any(reason in f["message"] for f in errors(doc, "dropped"))
    lost = incomplete_by_index(dump, rows)
    assert lost and {f["rid"] for f in errors(doc, "coverage")} == lost
    assert not [f for f in errors(doc) if f["check"] in ("header", "truncated", "checksum", "placement")]


# ------------------------------------------------------------------ slow disk: drop policy
def test_slow_disk_with_the_drop_policy_counts_and_reports_every_drop(tiny_model, tmp_path):
    rows = dataset(16, seed=3, lo=100, hi=300)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    dump = str(tmp_path / "dump")
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5", HSCAP_ON_FULL="drop", HSCAP_MAX_INFLIGHT_MB="1",
                                        HSCAP_TEST_SLOW_DISK_MS="400"), str(tmp_path / "s.log"), CHUNK, warmup=False)
    try:
        srv.wait_healthy()
        rc, summary = hscap_send(data, "--url", srv.url, "-c", "8", "--failures", str(tmp_path / "f.jsonl"))
    finally:
        srv.stop()
    assert rc == 0 and summary["sent"] == len(rows)
    assert "writer full, dropped step" in srv.log()
    (run,) = os.listdir(dump)
    meta = json.load(open(os.path.join(dump, run, "ranks", "dp0-tp0-pp0.json")))
    dropped = [json.loads(x) for x in open(os.path.join(dump, run, "index", "dp0-tp0-pp0.jsonl")) if '"dropped"' in x]
    assert meta["stats"]["steps_dropped"] == len(dropped) > 0
    code, doc = verify(dump, "--dataset", data)
    assert code == 1 and len(errors(doc, "dropped")) == len(dropped)
    lost = incomplete_by_index(dump, rows)
    assert lost == {f["rid"] for f in errors(doc, "coverage")}
    assert {s["rid"] for d in dropped for s in d["seqs"] if not s["rid"].startswith("HEALTH_CHECK_")} <= lost


# ------------------------------------------------------------------ two servers, one HSCAP_DIR
def test_two_servers_on_one_dump_dir_never_clobber(tiny_model, tmp_path):
    rows_a, rows_b = dataset(6, seed=4, prefix="a"), dataset(6, seed=5, prefix="b")
    data_a, data_b = write_jsonl(tmp_path / "a.jsonl", rows_a), write_jsonl(tmp_path / "b.jsonl", rows_b)
    dump = str(tmp_path / "dump")
    env = server_env(dump, HSCAP_LAYERS="1,3,5")
    a = Server(tiny_model, env, str(tmp_path / "a.log"), CHUNK, warmup=False)
    b = Server(tiny_model, env, str(tmp_path / "b.log"), CHUNK, warmup=False)
    try:
        a.wait_healthy()
        b.wait_healthy()
        for srv, data in ((a, data_a), (b, data_b)):
            rc, _ = hscap_send(data, "--url", srv.url, "-c", "4", "--failures", str(tmp_path / "f.jsonl"))
            assert rc == 0
    finally:
        a.stop()
        b.stop()
    runs = sorted(os.listdir(dump))
    assert len(runs) == 2  # one run id each
    both = write_jsonl(tmp_path / "ab.jsonl", rows_a + rows_b)
    code, doc = verify(dump, "--dataset", both)
    assert code == 0, errors(doc)
    # the same run id given twice: the second server refuses to start, nothing of the first is touched
    before = {os.path.join(r, n): os.path.getmtime(os.path.join(r, n)) for r, _, ns in os.walk(dump) for n in ns}
    c = Server(tiny_model, {**env, "HSCAP_RUN_ID": runs[0]}, str(tmp_path / "c.log"), CHUNK)
    try:
        assert c.wait_exit(180) != 0
    finally:
        c.kill()
    assert f"run '{runs[0]}' rank dp0-tp0-pp0 already exists" in c.log() and "[HS_DUMP] ERROR" in c.log()
    after = {os.path.join(r, n): os.path.getmtime(os.path.join(r, n)) for r, _, ns in os.walk(dump) for n in ns}
    assert after == before


# ------------------------------------------------------------------ hostile rids, permissions
HOSTILE = ["../../../../tmp/escape", "/etc/passwd", "a" * 3000, "日本語/../..\\x", " lead space", "dot.", "..",
           "nul\u0000byte", "new\nline", "%2e%2e%2f"]


def test_hostile_rids_never_escape_and_merge_exactly_under_a_strict_umask(tiny_model, tmp_path):
    rng = random.Random(6)
    rows = [{"id": rid, "input_ids": [rng.randrange(2, 1000) for _ in range(rng.randrange(5, 300))]} for rid in HOSTILE]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    dump = str(tmp_path / "dump")
    old = os.umask(0o027)  # the server and merge inherit it
    try:
        srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5"), str(tmp_path / "s.log"), CHUNK, warmup=False)
        try:
            srv.wait_healthy()
            rc, summary = hscap_send(data, "--url", srv.url, "-c", "4", "--failures", str(tmp_path / "f.jsonl"))
            assert rc == 0 and summary["sent"] == len(rows)
            srv.generate("", [3, 4, 5])  # an empty rid straight from a client
        finally:
            srv.stop()
        outs = {f: str(tmp_path / f"m-{f}") for f in ("specforge", "hscap")}
        for f, out in outs.items():
            s = merge(dump, "-o", out, "--format", f, "--dataset", data)
            assert s["written"] == len(rows) and s["incomplete"] == 0
    finally:
        os.umask(old)
    assert not os.path.exists("/tmp/escape")
    for top in (dump, *outs.values()):
        for root, dirs, names in os.walk(top):
            for p in [os.path.join(root, d) for d in dirs] + [os.path.join(root, n) for n in names]:
                assert os.path.realpath(p).startswith(os.path.realpath(top) + os.sep)
                mode = stat.S_IMODE(os.stat(p).st_mode)
                assert mode & 0o027 == 0, (p, oct(mode))  # nothing wider than the umask allows
    for out in outs.values():
        code, doc = verify(out, "--dataset", data, "--reference", tiny_model, "--reference-samples", "4")
        assert code == 0, errors(doc)
    code, doc = verify(dump, "--dataset", data)
    assert code == 0, errors(doc)
    with open(os.path.join(dump, os.listdir(dump)[0], "index", "dp0-tp0-pp0.jsonl")) as f:
        assert "" in {s["rid"] for line in f for s in json.loads(line)["seqs"]}  # captured, and harmless
