"""The writer process (the default, HSCAP_WRITER=process) on CPU tensors: what it writes is
what was submitted, a close drains it, and either side may die without harm: a dead writer
stops capture loudly and never holds a forward; a dead server leaves every step it handed
over committed and the run closed. The planted faults reach the child through the test
shims' sitecustomize (tests/sglang_cpu/shims), as they do a test server's processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from hs_capture.dump.paths import RankId, index_path, rank_meta_path
from hs_capture.dump.schema import RankMeta
from hs_capture.offline.read.reader import open_runs
from hs_capture.server.config import CaptureConfig
from hs_capture.server.writer import ShardWriter
from tests.sglang_cpu.harness import SHIMS
from tests.sglang_cpu.stitch import stitch
from tests.test_writer import H, index_lines, step


@pytest.fixture
def shims_on_path(monkeypatch):
    """The child inherits this process's environment: put the test shims on its path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SHIMS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def make_writer(tmp_path, **kw):
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False, **kw)
    assert cfg.writer == "process"  # the default
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H))
    w.start()
    return w


def meta_of(w):
    with open(rank_meta_path(w.run_dir, w.rank)) as f:
        return json.load(f)


def test_every_step_is_written_as_submitted_and_the_costs_are_recorded(tmp_path):
    w = make_writer(tmp_path)
    assert w._sink._proc.pid != os.getpid()
    sent = {}
    for k in range(12):
        line, t = step(f"r{k}", 20 + k)
        sent[f"r{k}"] = t
        assert w.submit(line, t, aux_layers=[1, 2])
    assert w.close()
    got = stitch(open_runs(str(tmp_path))[0])
    for rid, t in sent.items():
        s = got[rid]
        assert s.complete and s.input_ids.tolist() == t["tokens"].tolist()
        assert torch.equal(torch.from_numpy(s.final.copy()), t["final"])
        assert torch.equal(torch.from_numpy(s.layers[1].copy()), t["aux"][:, :H])
        assert torch.equal(torch.from_numpy(s.layers[2].copy()), t["aux"][:, H:])
    meta = meta_of(w)
    assert meta["status"] == "closed" and meta["stats"]["steps_written"] == 12 and w.stats["steps_written"] == 12
    cost = meta["stats"]["forward_cost"]
    assert cost["steps"] == 12 and cost["staging_s"] > 0 and meta["stats"]["writer"] == "process"
    assert w._sink._proc.returncode == 0  # the child ended with the close


def test_close_drains_every_step_queued_in_the_child(tmp_path, monkeypatch, shims_on_path):
    monkeypatch.setenv("HSCAP_TEST_SLOW_DISK_MS", "100")
    w = make_writer(tmp_path, writer_threads=1)
    for k in range(10):
        assert w.submit(*step(f"r{k}", 8), aux_layers=[1, 2])
    assert w.stats["steps_written"] < 10  # the slow disk left steps queued in the child
    assert w.close()
    assert len([x for x in index_lines(w) if "files" in x]) == 10 and meta_of(w)["status"] == "closed"


def test_a_dead_writer_stops_capture_loudly_and_never_holds_a_forward(tmp_path, monkeypatch, shims_on_path, caplog):
    monkeypatch.setenv("HSCAP_TEST_SLOW_DISK_MS", "3000")
    one_step = sum(x.numel() * x.element_size() for x in step("x", 100)[1].values())
    w = make_writer(tmp_path, writer_threads=1, max_inflight_bytes=int(one_step * 2.5))
    for k in range(2):
        assert w.submit(*step(f"r{k}", 100), aux_layers=[1, 2])
    held = threading.Event()
    # the budget is full: this forward waits for the writer, which is about to die
    threading.Thread(target=lambda: (w.submit(*step("r2", 100), aux_layers=[1, 2]), held.set()), daemon=True).start()
    time.sleep(0.3)
    assert not held.is_set()
    w._sink._proc.kill()
    assert held.wait(10)  # let go, not left waiting for a writer that is gone
    deadline = time.time() + 10
    while not w.stopped and time.time() < deadline:
        time.sleep(0.05)
    assert w.stopped and "writer process exited" in w.stopped["reason"]
    assert not w.submit(*step("r3", 8), aux_layers=[1, 2])  # capture is off; the caller serves on
    assert "capture STOPPED" in caplog.text and "writer process exited" in caplog.text
    w.close(5)
    meta = meta_of(w)
    assert "writer process exited" in meta["capture_stopped"]["reason"]
    # nothing that looks written but is not: every indexed step's files are whole
    for line in index_lines(w) if os.path.exists(index_path(w.run_dir, w.rank)) else []:
        for f in line.get("files", {}).values():
            assert os.path.getsize(os.path.join(w.run_dir, f["path"])) == f["size"]


_SERVER = r"""
import os, sys, time
sys.path.insert(0, {repo!r})
from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import RankMeta
from hs_capture.server.config import CaptureConfig
from hs_capture.server.writer import ShardWriter
from tests.test_writer import step
cfg = CaptureConfig(dump_dir={dump!r}, run_id="run-test", layers=[1, 2], fsync=False, writer_threads=1)
w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=64))
w.start()
for k in range(8):
    w.submit(*step(f"r{{k}}", 16), aux_layers=[1, 2])
print(w._sink._proc.pid, flush=True)
time.sleep(0.3)  # the child has the steps (their copies were done when sent)
os.kill(os.getpid(), 9)  # the server dies without a word
"""


def test_a_server_that_dies_leaves_every_step_it_handed_over_committed(tmp_path, monkeypatch, shims_on_path):
    monkeypatch.setenv("HSCAP_TEST_SLOW_DISK_MS", "100")  # steps still queued in the child at the kill
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dump = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _SERVER.format(repo=repo, dump=dump)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the writer process outlived its server")
    rank = RankId(0, 0, 0)
    run_dir = os.path.join(dump, "run-test")
    with open(index_path(run_dir, rank)) as f:
        lines = [json.loads(x) for x in f]
    assert len([x for x in lines if "files" in x]) == 8  # every step handed over is committed
    with open(rank_meta_path(run_dir, rank)) as f:
        assert json.load(f)["status"] == "closed"
    assert "the server closed without a word" in proc.stderr
    samples = stitch(open_runs(dump)[0])
    assert all(samples[f"r{k}"].complete for k in range(8))


def closed_after_five_steps(tmp_path, copier, **cfg) -> dict:
    """A writer with that copier, five steps submitted, closed as the server's exit closes it
    (its closing line logged): its run metadata."""
    from hs_capture.server import capture

    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False, **cfg)
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H), copier=copier)
    w.start()
    capture._writers.add(w)
    for k in range(5):
        assert w.submit(*step(f"r{k}", 8), aux_layers=[1, 2])
    capture.close_all(30)
    return meta_of(w)


def test_a_slow_forward_side_path_is_reported_by_its_cause(tmp_path, caplog):
    """A cost the hook puts on the forwards is never silent: planted in the staging copies, it
    is in the closing line and the run metadata under that cause."""
    from hs_capture.server.staging import CpuCopy

    class SlowCopy(CpuCopy):
        def copy(self, host, t):
            time.sleep(0.02)
            host.copy_(t)

    cost = closed_after_five_steps(tmp_path, SlowCopy())["stats"]["forward_cost"]
    assert cost["staging_s"] >= 5 * 4 * 0.02 and cost["held_s"] >= cost["staging_s"]  # 4 tensors a step
    assert cost["budget_wait_s"] < 0.05 and cost["buffer_wait_s"] < 0.05 and cost["steps"] == 5
    line = next(r.getMessage() for r in caplog.records if "closed:" in r.getMessage())
    assert f"staging copies {cost['staging_s']:.3f} s" in line and "forwards held" in line


def test_slow_request_bookkeeping_in_the_scheduler_is_reported(tmp_path, caplog, monkeypatch):
    """Capture's work in the scheduler's thread (picking, judging, capping matches) holds no
    forward but slows a scheduler-bound server: planted slow, it is in the closing line and the
    run metadata."""
    from hs_capture.server import requests as requests_mod
    from hs_capture.server.forward_cost import SCHEDULER

    class SlowPicker:
        def on_new_request(self, req):
            time.sleep(0.02)

    monkeypatch.setattr(requests_mod, "picker", lambda: SlowPicker())
    before = SCHEDULER.report()
    for _ in range(5):
        requests_mod.on_new_request(object())
    from hs_capture.server.staging import CpuCopy

    cost = closed_after_five_steps(tmp_path, CpuCopy())["stats"]["scheduler_cost"]
    assert cost["requests"] - before["requests"] == 5 and cost["pick_s"] - before["pick_s"] >= 5 * 0.02
    assert cost["held_s"] >= cost["pick_s"]
    line = next(r.getMessage() for r in caplog.records if "closed:" in r.getMessage())
    assert f"picking new requests {cost['pick_s']:.3f} s" in line and f"over {cost['requests']} requests" in line


def test_a_writer_process_that_cannot_start_leaves_the_writing_to_threads(tmp_path, monkeypatch, caplog):
    from hs_capture.server import writer_process
    from hs_capture.server.config import ConfigError

    def refuse(self, meta):
        raise ConfigError("the writer process did not start (exit code 1)")

    monkeypatch.setattr(writer_process.ProcessSink, "start", refuse)
    w = make_writer(tmp_path)
    assert w.cfg.writer == "thread" and "writing in threads of the server's process instead" in caplog.text
    assert w.submit(*step("r0", 8), aux_layers=[1, 2])
    assert w.close()
    assert meta_of(w)["stats"]["writer"] == "thread" and meta_of(w)["stats"]["steps_written"] == 1


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_capture_threads_in_the_servers_process_are_reported(tmp_path, caplog, writer):
    """Work that holds no forward but takes cores and the interpreter lock from the scheduler's
    thread is never silent either: a copy whose wait burns CPU (as a spinning CUDA event wait
    does) shows in the closing line and the run metadata's `server_threads`."""
    from hs_capture.server.staging import CpuCopy

    class Spin:
        def synchronize(self):
            end = time.thread_time() + 0.03
            while time.thread_time() < end:
                pass

    class SpinningWait(CpuCopy):
        def finish(self):
            return Spin()

    stats = closed_after_five_steps(tmp_path, SpinningWait(), writer=writer)["stats"]
    threads = stats["server_threads"]
    spun = "handoff_cpu_s" if writer == "process" else "writer_cpu_s"
    assert threads[spun] >= 4 * 0.03 and threads["copy_wait_s"] >= 4 * 0.03, threads
    cost = stats["forward_cost"]  # the forwards did not wait for the spinning copy waits
    assert cost["handoff_s"] < 0.05 and cost["buffer_wait_s"] < 0.05 and cost["budget_wait_s"] < 0.05, cost
    line = next(r.getMessage() for r in caplog.records if "closed:" in r.getMessage())
    assert "capture's threads in the server's process used" in line and "waiting for device copies" in line


def test_the_child_starts_without_torch(tmp_path):
    """The server waits for the child's "ready" while it loads the model: the child must not
    import torch (or SGLang) to read its start message, even where the run metadata holds
    their objects (torch.__version__ is one)."""
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False)
    meta = RankMeta(layers=[1, 2], hidden_size=H, extra={"torch_version": torch.__version__,
                                                         "dtype": torch.bfloat16})
    w = ShardWriter(cfg, RankId(0, 0, 0), meta)
    w.start()
    try:
        with open(f"/proc/{w._sink._proc.pid}/maps") as f:
            mapped = f.read()
        assert "libtorch" not in mapped and "/torch/" not in mapped
        assert w.submit(*step("r0", 8), aux_layers=[1, 2])
    finally:
        assert w.close()
    assert meta_of(w)["torch_version"] == str(torch.__version__) and meta_of(w)["dtype"] == "torch.bfloat16"
