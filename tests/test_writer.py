"""The shard writer on CPU tensors: back-pressure, counted drops, flush on close, atomicity.
The store's logic is the same wherever it runs; these tests run it in this process
(HSCAP_WRITER=thread) so that they can plant faults in it. The writer process itself:
test_writer_process.py. (The CUDA path is measured on the GPU: benchmarks/gpu/.)"""

import errno
import json
import os
import threading
import time
import types

import pytest
import torch

from hs_capture.dump import files as files_mod
from hs_capture.server import backlog as backlog_mod
from hs_capture.server import writer as writer_mod
from hs_capture.server.config import CaptureConfig
from hs_capture.dump.paths import TEMP_MARK, RankId, index_path, rank_meta_path, temp_name
from hs_capture.offline.read.reader import open_runs
from hs_capture.dump.schema import RankMeta, SeqEntry, step_line
from tests.sglang_cpu.stitch import stitch

H = 64


def make_writer(tmp_path, writer="thread", **kw):
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False, writer=writer, **kw)
    w = writer_mod.ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H))
    w.start()
    return w


def step(rid, n, start=0, rows=None):
    rows = rows or n
    pos = torch.arange(start, start + rows)
    tensors = {"final": torch.randn(rows, H), "aux": torch.randn(rows, 2 * H),
               "tokens": torch.randint(0, 1000, (rows,)), "positions": pos}
    return step_line("EXTEND", n, rows, "float32", [SeqEntry(rid, n, start, 0)]), tensors


def index_lines(w):
    with open(index_path(w.run_dir, w.rank)) as f:
        return [json.loads(x) for x in f]


class Gate:
    """Holds every file write from now until opened: a disk that has stopped."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.entered = threading.Event()  # a write is being held
        real = files_mod.atomic_write

        def slow(path, chunks, fsync):
            self.entered.set()
            self.open.wait(30)
            return real(path, chunks, fsync)

        monkeypatch.setattr(files_mod, "atomic_write", slow)


def test_split_aux_round_trips_through_the_reader(tmp_path):
    w = make_writer(tmp_path)
    meta, t = step("a", 10)
    w.submit(meta, t, aux_layers=[1, 2])
    meta2, t2 = step("a", 5, start=10)
    w.submit(meta2, t2, aux_layers=[1, 2])
    assert w.close()
    s = stitch(open_runs(str(tmp_path))[0])["a"]
    assert s.complete and s.final.shape == (15, H)
    assert torch.equal(torch.from_numpy(s.layers[2][:10].copy()), t["aux"][:, H:])
    assert torch.equal(torch.from_numpy(s.layers[1][10:].copy()), t2["aux"][:, :H])


def test_block_policy_holds_the_forward_until_memory_frees(tmp_path, monkeypatch):
    one_step = sum(x.numel() * x.element_size() for x in step("x", 100)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * 1.5), writer_threads=1)
    gate = Gate(monkeypatch)
    w.submit(*step("a", 100), aux_layers=[1, 2])
    done = threading.Event()
    threading.Thread(target=lambda: (w.submit(*step("b", 100), aux_layers=[1, 2]), done.set())).start()
    time.sleep(0.5)
    assert not done.is_set()  # back-pressure: the second step waits
    gate.open.set()
    assert done.wait(10)
    assert w.close()
    assert [x["seqs"][0]["rid"] for x in index_lines(w)] == ["a", "b"]
    assert w.stats["steps_dropped"] == 0


def test_drop_policy_counts_and_indexes_every_drop(tmp_path, monkeypatch):
    one_step = sum(x.numel() * x.element_size() for x in step("x", 100)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * 1.5), on_full="drop", writer_threads=1)
    gate = Gate(monkeypatch)
    assert w.submit(*step("a", 100), aux_layers=[1, 2])
    assert not w.submit(*step("b", 100), aux_layers=[1, 2])
    gate.open.set()
    assert w.close()
    lines = index_lines(w)
    dropped = [x for x in lines if "dropped" in x]
    assert [x["seqs"][0]["rid"] for x in dropped] == ["b"] and "files" not in dropped[0]
    meta = json.load(open(rank_meta_path(w.run_dir, w.rank)))
    assert meta["stats"]["steps_dropped"] == 1 and meta["status"] == "closed"


def test_close_flushes_everything_queued(tmp_path, monkeypatch):
    w = make_writer(tmp_path, writer_threads=2)
    gate = Gate(monkeypatch)
    for i in range(20):
        w.submit(*step(f"r{i}", 8), aux_layers=[1, 2])
    assert w.stats["steps_written"] == 0
    gate.open.set()
    assert w.close()
    assert len([x for x in index_lines(w) if "files" in x]) == 20
    assert w.stats["steps_written"] == 20


def test_a_failed_write_is_counted_and_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    real = files_mod.atomic_write
    calls = {"n": 0}

    def disk_full(path, chunks, fsync):
        calls["n"] += 1
        if calls["n"] == 2:  # the step's second file: the first is already in place
            with open(temp_name(path), "wb") as f:
                f.write(b"partial")
            os.remove(temp_name(path))
            raise OSError(errno.EIO, "Input/output error")
        return real(path, chunks, fsync)

    monkeypatch.setattr(files_mod, "atomic_write", disk_full)
    w = make_writer(tmp_path, writer_threads=1)
    w.submit(*step("a", 8), aux_layers=[1, 2])
    w.submit(*step("b", 8), aux_layers=[1, 2])
    assert w.close()
    assert w.stats["steps_failed"] == 1 and w.stats["steps_written"] == 1
    assert [x["seqs"][0]["rid"] for x in index_lines(w)] == ["b"]  # no index line for the broken step
    leftovers = [n for _, _, names in os.walk(w.run_dir) for n in names if TEMP_MARK in n]
    assert not leftovers
    # the broken step's first file, already in place, was removed: no file without an index line
    files = {os.path.relpath(os.path.join(r, n), w.run_dir) for r, _, names in os.walk(w.run_dir) for n in names
             if n.endswith(".hst")}
    assert files == {f["path"] for x in index_lines(w) for f in x["files"].values()}
    meta = json.load(open(rank_meta_path(w.run_dir, w.rank)))
    assert "Input/output error" in meta["last_failure"]


def test_a_full_disk_stops_capture_for_good_and_says_so(tmp_path, monkeypatch):
    real = files_mod.atomic_write
    calls = {"n": 0}

    def disk_full(path, chunks, fsync):
        calls["n"] += 1
        if calls["n"] >= 5:  # step a's 4 files fit, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, chunks, fsync)

    monkeypatch.setattr(files_mod, "atomic_write", disk_full)
    w = make_writer(tmp_path, writer_threads=1)
    assert w.submit(*step("a", 8), aux_layers=[1, 2])
    w.submit(*step("b", 8), aux_layers=[1, 2])
    deadline = time.time() + 10
    while not w.stopped and time.time() < deadline:
        time.sleep(0.01)
    assert w.stopped and "disk full" in w.stopped["reason"] and w.stopped["step"] == 1
    assert not w.submit(*step("c", 8), aux_layers=[1, 2])  # nothing more is even staged
    monkeypatch.setattr(files_mod, "atomic_write", real)  # space comes back: the close still records
    assert w.close()
    assert [x["seqs"][0]["rid"] for x in index_lines(w)] == ["a"]
    meta = json.load(open(rank_meta_path(w.run_dir, w.rank)))
    assert meta["capture_stopped"]["step"] == 1 and "No space left" in meta["capture_stopped"]["reason"]


def test_below_the_free_space_floor_capture_stops(tmp_path):
    w = make_writer(tmp_path, writer_threads=1, min_free_bytes=1 << 60)  # more than any disk has
    w.submit(*step("a", 8), aux_layers=[1, 2])
    assert w.close()
    assert w.stopped and "below HSCAP_MIN_FREE_GB" in w.stopped["reason"]
    assert not os.path.exists(index_path(w.run_dir, w.rank))  # nothing written, nothing indexed


def test_the_mount_table_says_which_filesystem_a_path_is_on(tmp_path, monkeypatch):
    from hs_capture.server import run_record

    table = tmp_path / "mountinfo"
    table.write_text("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                     "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1k\n"
                     "90 27 0:40 / /data/my\\040dumps rw - ramfs none rw\n"
                     "91 25 0:41 / /dev/shm rw - xfs /dev/vdb rw\n")  # mounted over the tmpfs
    with open(table, "ab") as f:  # a mount point's name need not be UTF-8
        f.write(b"92 27 0:42 / /mnt/\xff\xfe rw - tmpfs tmpfs rw\n")
    monkeypatch.setattr(run_record, "MOUNTINFO", str(table))
    assert run_record.filesystem_type("/data/my dumps/run-1") == "ramfs"
    assert run_record.filesystem_type("/data/my") == "ext4"
    assert run_record.filesystem_type("/dev/shm/hs") == "xfs"  # the mount on top
    assert run_record.filesystem_type("/dev/shmx") == "ext4"
    monkeypatch.setattr(run_record, "MOUNTINFO", str(tmp_path / "none"))
    assert run_record.filesystem_type("/dev/shm") is None


@pytest.mark.parametrize("available_gb,stops", [(0.5, True), (None, False)])
def test_a_dump_in_memory_stops_before_the_host_runs_out_of_memory(tmp_path, tmpfs, monkeypatch, available_gb, stops):
    """A Kimi-K2.5-wide sweep on one H100 filled /dev/shm (as big as the host's memory) until the
    kernel killed SGLang's scheduler: in memory, the host's available memory is the free space."""
    from hs_capture.server import run_record

    dump = tmpfs("2g")
    if available_gb is not None:
        meminfo = tmp_path / "meminfo"
        meminfo.write_text(f"MemTotal: 100 kB\nMemAvailable: {int(available_gb * 2**20)} kB\n")
        monkeypatch.setattr(run_record, "MEMINFO", str(meminfo))
    monkeypatch.setattr(run_record, "memory_floor", lambda *a: 1 << 30)
    monkeypatch.setattr(run_record, "CGROUP_MEMORY", (str(tmp_path / "no-v2"), str(tmp_path / "no-v1")))
    w = make_writer(dump, writer_threads=1)
    assert w.in_memory().startswith("the dump dir is in memory (tmpfs)")
    w.submit(*step("a", 8), aux_layers=[1, 2])
    assert w.close()
    if stops:
        assert w.stopped and "memory available 0.50 GB is below 1.00 GB" in w.stopped["reason"]
        assert not os.path.exists(index_path(w.run_dir, w.rank))  # nothing written, nothing indexed
    else:  # this host's own MemAvailable, above 1 GiB
        assert not w.stopped and [x["seqs"][0]["rid"] for x in index_lines(w)] == ["a"]


@pytest.mark.parametrize("inactive_gb,stops", [(0, True), (1, False)])
def test_in_a_container_the_memory_cgroup_s_headroom_counts(tmp_path, tmpfs, monkeypatch, inactive_gb, stops):
    """tmpfs pages count against the writer's memory cgroup, whose OOM killer acts long before
    the host runs low: its limit less its use (the inactive file cache aside) is what is left."""
    from hs_capture.server import run_record

    v2 = tmp_path / "cgroup"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{2 << 30}\n")
    (v2 / "memory.current").write_text(f"{int(1.8 * 2**30)}\n")
    (v2 / "memory.stat").write_text(f"anon 5\ninactive_file {inactive_gb << 30}\nshmem 7\n")
    monkeypatch.setattr(run_record, "CGROUP_MEMORY", (str(v2), str(tmp_path / "no-v1")))
    monkeypatch.setattr(run_record, "memory_floor", lambda *a: 1 << 30)
    avail, total = run_record.available_memory()
    assert total == 2 << 30 and avail == int(1.8 * 2**30) * -1 + (2 << 30) + (inactive_gb << 30)
    w = make_writer(tmpfs("2g"), writer_threads=1)
    w.submit(*step("a", 8), aux_layers=[1, 2])
    assert w.close()
    assert bool(w.stopped) == stops
    if stops:
        assert "memory available 0.20 GB is below 1.00 GB" in w.stopped["reason"]


def test_a_dump_on_disk_is_not_held_to_the_memory_floor(tmp_path, monkeypatch):
    from hs_capture.server import run_record

    if run_record.filesystem_type(str(tmp_path)) in run_record.MEMORY_FILESYSTEMS:
        pytest.skip("the test's temporary dir is in memory on this host")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 1 kB\n")
    monkeypatch.setattr(run_record, "MEMINFO", str(meminfo))
    w = make_writer(tmp_path / "dump", writer_threads=1)
    assert w.in_memory() is None
    w.submit(*step("a", 8), aux_layers=[1, 2])
    assert w.close() and not w.stopped


class _Boom(Exception):
    pass


def _chunks_then(error):
    yield b"ok"  # some bytes are in the temp file when the error comes
    raise error


@pytest.mark.parametrize("where", ["write", "interrupt", "fsync", "rename"])
def test_atomic_write_removes_its_temp_file_on_error(tmp_path, monkeypatch, where):
    """Whatever fails (a chunk, a Ctrl-C or a shutdown mid-write, the fsync, the rename), the
    caller gets that error and the directory holds neither the temp file nor the target."""
    error = KeyboardInterrupt() if where == "interrupt" else _Boom(where)
    chunks = [b"ok", b"more"]
    if where in ("write", "interrupt"):
        chunks = _chunks_then(error)
    elif where == "fsync":
        def fsync(fd):
            raise error

        monkeypatch.setattr(files_mod.os, "fsync", fsync)
    else:
        def replace(src, dst):
            with open(src, "rb") as f:
                assert f.read() == b"okmore"  # written whole, then refused
            raise error

        monkeypatch.setattr(files_mod.os, "replace", replace)
    target = tmp_path / "x.hst"
    with pytest.raises(type(error)) as raised:
        files_mod.atomic_write(str(target), chunks, fsync=True)
    assert raised.value is error
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_a_writer_behind_writes_raw_until_it_catches_up_and_keeps_every_byte(tmp_path, monkeypatch):
    """Compression slower than the producer: over half the budget waiting, steps go raw (no
    forward held while raw writes keep up); every step decodes to the exact bytes submitted."""
    from hs_capture.dump import codec as codec_mod

    real = codec_mod.encode_bytegroup

    def slow(*a, **kw):
        time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(codec_mod, "encode_bytegroup", slow)
    one_step = sum(x.numel() * x.element_size() for x in step("x", 200)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * 4.5), writer_threads=1)
    sent = []
    for k in range(24):
        meta, t = step(f"r{k}", 200)
        sent.append(t)
        assert w.submit(meta, t, aux_layers=[1, 2])
        time.sleep(0.02)  # a producer faster than compression, slower than raw writes: it catches up
    assert w.close()
    assert 0 < w.stats["steps_written_raw"] < 24 and w.stats["steps_written"] == 24
    run = open_runs(str(tmp_path))[0]
    codecs = set()
    for line in index_lines(w):
        from hs_capture.dump import hst as fmt

        for part, f in line["files"].items():
            with open(os.path.join(run.path, f["path"]), "rb") as fh:
                codecs.add(fmt.read_header(fh, os.fstat(fh.fileno()).st_size).tensors["hidden"].codec)
    assert codecs == {"raw", "bytegroup"}
    got = stitch(run)
    for k, t in enumerate(sent):
        s = got[f"r{k}"]
        assert torch.equal(torch.from_numpy(s.final.copy()), t["final"])
        assert torch.equal(torch.from_numpy(s.layers[2].copy()), t["aux"][:, H:])


def test_a_step_whose_forward_waited_for_the_writer_goes_raw(tmp_path, monkeypatch):
    """Kimi-K2.5's widths on one H100: each step ~1/16 of the budget, 12 threads compressing,
    none waiting for a thread, yet the budget full and the forwards held 40 s with no step raw.
    Here 4 threads on a 4.5-step budget: the steps whose forward waited go raw."""
    from hs_capture.dump import codec as codec_mod

    real = codec_mod.encode_bytegroup
    monkeypatch.setattr(codec_mod, "encode_bytegroup", lambda *a, **kw: (time.sleep(0.2), real(*a, **kw))[1])
    one_step = sum(x.numel() * x.element_size() for x in step("x", 200)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * 4.5), writer_threads=4)
    sent = {}
    for k in range(16):
        meta, t = step(f"r{k}", 200)
        sent[f"r{k}"] = t
        assert w.submit(meta, t, aux_layers=[1, 2])
    assert w.close()
    assert 0 < w.stats["steps_written_raw"] < 16 and w.stats["steps_written"] == 16
    got = stitch(open_runs(str(tmp_path))[0])
    for rid, t in sent.items():
        assert torch.equal(torch.from_numpy(got[rid].final.copy()), t["final"])


@pytest.mark.parametrize("budget_steps", [1.0, 1.33, 4.5])
def test_a_writer_that_keeps_up_compresses_every_step_however_large(tmp_path, budget_steps):
    """Each step written before the next comes: none is raw, even one that fills the budget."""
    one_step = sum(x.numel() * x.element_size() for x in step("x", 200)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * budget_steps), writer_threads=4)
    for k in range(6):
        assert w.submit(*step(f"r{k}", 200), aux_layers=[1, 2])
        deadline = time.time() + 10
        while w.stats["steps_written"] <= k and time.time() < deadline:
            time.sleep(0.005)
    assert w.close()
    assert w.stats["steps_written"] == 6 and w.stats["steps_written_raw"] == 0


@pytest.mark.parametrize("policy,raw_steps", [("off", 0), ("raw", 1)])
def test_the_backlog_policy_decides_whether_a_waiting_step_goes_raw(tmp_path, monkeypatch, policy, raw_steps):
    one_step = sum(x.numel() * x.element_size() for x in step("x", 200)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * 4.5), writer_threads=1, on_backlog=policy)
    gate = Gate(monkeypatch)
    w.submit(*step("r0", 200), aux_layers=[1, 2])
    assert gate.entered.wait(10)  # r0 was encoded with 1 step in flight; its write is held
    for k in range(1, 4):
        w.submit(*step(f"r{k}", 200), aux_layers=[1, 2])
    gate.open.set()
    assert w.close()
    # when r1 is picked up r2 and r3 still wait (2 steps: over a quarter of the 4.5-step budget): raw;
    # when r2 is, only r3 waits (1 step: under a quarter); r3 finds none waiting
    assert w.stats["steps_written"] == 4 and w.stats["steps_written_raw"] == raw_steps


def test_a_disk_that_cannot_keep_up_is_reported_once_with_the_rates(tmp_path, monkeypatch, caplog):
    one_step = sum(x.numel() * x.element_size() for x in step("x", 2000)[1].values())
    w = make_writer(tmp_path, max_inflight_bytes=int(one_step * 1.5), writer_threads=1)
    real = files_mod.atomic_write
    monkeypatch.setattr(files_mod, "atomic_write", lambda p, c, f: (time.sleep(0.25), real(p, c, f))[1])
    monkeypatch.setattr(backlog_mod, "DISK_BOUND_AFTER_S", 0.3)
    logged = []
    monkeypatch.setattr(writer_mod.log, "warning", lambda msg, *a: logged.append(msg % a))
    for k in range(5):
        w.submit(*step(f"r{k}", 2000), aux_layers=[1, 2])
    assert w.close()
    said = [m for m in logged if "cannot keep up" in m]
    # one step in flight at a time: never behind enough to write raw, so the disk is not blamed alone
    assert len(said) == 1 and "GB/s" in said[0] and "compressing and writing are the limit" in said[0]
    assert "by the in-flight budget" in said[0] and "waiting for a pinned buffer" in said[0]
    with open(rank_meta_path(w.run_dir, w.rank)) as f:
        meta = json.load(f)
    assert meta["disk_bound"]["produced_gbps"] > 0 and meta["stats"]["steps_written"] == 5


def test_the_reported_rates_are_those_of_the_last_steps_not_diluted_by_idle_time(monkeypatch):
    # On the H200 a server idle between two sends reported "produced at 0.09 GB/s ... the disk is
    # the limit" while its send produced 0.33 GB/s: the rates were since the first step.
    clock = [100.0]
    # backlog's own clock only (patching time.monotonic itself would stop every thread's waits)
    monkeypatch.setattr(backlog_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    b = backlog_mod.Backlog(1 << 40)  # never full: admit counts, it does not hold
    written = 0
    for t, n in [(100.0, 10**6), (101.0, 10**6)] + [(160.0 + k, 10**9) for k in range(5)]:
        clock[0] = t  # two small steps, a minute idle, then a second of 1 GB steps
        b.admit(n, block=True)
        b.sample(written, written // 2)
        written += n
    clock[0] = 165.0
    r = b.rates(written, written // 2, waited_s=1.5)
    assert r["window_s"] == 5.0 and r["forward_waited_s"] == 1.5
    assert r["produced_gbps"] == 0.8  # the 4 steps after the window's first one, over 5 s
    assert r["written_gbps"] == 1.0 and r["to_disk_gbps"] == 0.5
    since_start = b.produced / 1e9 / (165.0 - 100.0)
    assert r["produced_gbps"] > 10 * since_start
    # one step after another long pause: the rate since the step before it, not since the first
    clock[0] = 200.0
    b.admit(10**9, block=True)
    b.sample(written, written // 2)
    clock[0] = 204.0
    r = b.rates(written, written // 2, waited_s=1.5)
    assert r["window_s"] == 40.0 and r["produced_gbps"] == 0.025  # 1 GB since the step at 164 s
    # one step only: the rates since it (no history to take a window from)
    one = backlog_mod.Backlog(1 << 30)
    clock[0] = 200.0
    one.admit(10**9, block=True)
    one.sample(0, 0)
    clock[0] = 202.0
    assert one.rates(10**9, 10**9, 0.0)["produced_gbps"] == 0.5


def test_forwards_held_by_the_pinned_buffers_count_as_disk_bound(tmp_path):
    # On the H200's disk the forwards waited for pinned buffers (each comes back only once its
    # step is on disk; CPU tensors here take no pinned buffer, so the wait is set as the pool
    # records it), not for the budget: 17 s held and no report. Both waits count.
    w = make_writer(tmp_path)
    w._stager.pool.waited_s = 2.0
    w.submit(*step("r0", 100), aux_layers=[1, 2])
    assert w.close()
    with open(rank_meta_path(w.run_dir, w.rank)) as f:
        meta = json.load(f)
    assert meta["disk_bound"]["forward_waited_s"] >= 2.0 and meta["stats"]["forward_waited_s"] >= 2.0
    # and the report says which limit held them
    assert meta["disk_bound"]["held_by_pinned_s"] >= 2.0 and meta["disk_bound"]["held_by_budget_s"] < 1.0
    # and so do the closing counters, over the whole run
    assert meta["stats"]["held_by_pinned_s"] >= 2.0 and meta["stats"]["held_by_budget_s"] < 1.0


def test_forwards_held_while_most_pinned_buffers_are_free_are_said_to_outgrow_them(tmp_path, monkeypatch):
    # The H200's --prenorm server: every full step outgrew the 62 buffers pinned ahead and waited
    # for the one big enough ("1 of 63 in flight"); the warning blamed the disk. CPU tensors take
    # no pinned buffer here, so the pool is set as it stood.
    logged = []
    monkeypatch.setattr(writer_mod.log, "warning", lambda msg, *a: logged.append(msg % a))
    # nothing written yet, so nothing raw: compressing and writing are blamed, not the disk alone
    for in_flight, blamed in ((1, "larger than the buffers pinned ahead"), (63, "compressing and writing are the limit")):
        w = make_writer(tmp_path / str(in_flight))
        pool = w._stager.pool
        pool.waited_s, pool.buffers = 2.0, 63
        pool._free = [types.SimpleNamespace(nbytes=1)] * (63 - in_flight)
        w.submit(*step("r0", 100), aux_layers=[1, 2])
        pool._free = []  # the stand-ins are not the writer's to give back
        assert w.close()
        said = [m for m in logged if "cannot keep up" in m]
        assert len(said) == 1 and f"{in_flight} of 63 in flight" in said[0] and blamed in said[0], said
        logged.clear()


def test_settings_left_at_auto_are_resolved_by_the_writer_and_recorded(tmp_path, monkeypatch):
    from hs_capture.server import config as config_mod

    # a 10-core host with 1 TiB of memory (on a small test host the 2-thread floor, the 4 GiB
    # floor and the memory cap would give the same answer whatever the writer was told)
    real_sysconf = os.sysconf
    memory = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (1 << 40) // 4096}
    monkeypatch.setattr(config_mod, "usable_cores", lambda: 10)
    monkeypatch.setattr(config_mod.os, "sysconf", lambda name: memory[name] if name in memory else real_sysconf(name))
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-auto", layers=[1, 2], fsync=False, writer="thread")
    sizes = [8192 * 3 * 7168 * 2, 8192 * 7168 * 2, 8192 * 8, 8192 * 8]  # one H200 step: 470 MB
    w = writer_mod.ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H), step_sizes=sizes)
    w.start()
    started = w._sink.workers.count
    assert w.close()
    threads, budget = 10 - 4, (10 - 4 + 4) * sum(sizes)  # cores less 4; every thread busy plus 4 steps waiting
    assert budget > 4 << 30  # above the floor: the step sizes decide it
    assert (w.cfg.writer_threads, started, w.cfg.max_inflight_bytes) == (threads, threads, budget)
    with open(rank_meta_path(w.run_dir, w.rank)) as f:
        stats = json.load(f)["stats"]
    assert (stats["writer_threads"], stats["inflight_budget_bytes"]) == (threads, budget)
    # settings given are kept, not resolved again
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-set", layers=[1, 2], fsync=False, writer_threads=3,
                        max_inflight_bytes=123 << 20, writer="thread")
    w = writer_mod.ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H), step_sizes=sizes)
    w.start()
    started = w._sink.workers.count
    assert w.close()
    assert (w.cfg.writer_threads, started, w.cfg.max_inflight_bytes) == (3, 3, 123 << 20)
    with open(rank_meta_path(w.run_dir, w.rank)) as f:
        stats = json.load(f)["stats"]
    assert (stats["writer_threads"], stats["inflight_budget_bytes"]) == (3, 123 << 20)
