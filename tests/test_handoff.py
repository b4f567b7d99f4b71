"""HSCAP_HANDOFF=forward: the forwards send the writer process the steps whose device copies
are done and read its replies, and no thread of capture's wakes per step in the server's
process. Once the steps stop, the replies thread sends the last ones; a forward held by the
budget reads the replies that free it; a close sends every step owed; a dead writer lets a
held forward go. The copies here finish on a clock (as a side-stream copy does while the
forward goes on), so the tests see whether anything waited for them."""

import threading
import time

import pytest
import torch

from hs_capture.offline.read.reader import open_runs
from hs_capture.server import config
from hs_capture.server.config import CaptureConfig, ConfigError
from hs_capture.server.staging import CpuCopy
from hs_capture.server.writer import ShardWriter
from hs_capture.server.writer_process import ACTIVE_S, TAIL_S
from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import RankMeta
from tests.sglang_cpu.stitch import stitch
from tests.test_writer import H, step
from tests.test_writer_process import meta_of, shims_on_path  # noqa: F401 (a fixture)

COPY_S = 0.3  # how long each step's "device copy" runs after its forward


class LateCopy:
    """An event that is done COPY_S after the step was staged; waiting for it sleeps."""

    def __init__(self) -> None:
        self.at = time.monotonic() + COPY_S
        self.slept = False  # someone waited for the copy while it ran

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        left = self.at - time.monotonic()
        if left > 0:
            self.slept = True
            time.sleep(left)


class LateCopier(CpuCopy):
    def __init__(self) -> None:
        self.events = []

    def finish(self):
        self.events.append(LateCopy())
        return self.events[-1]


def writer(tmp_path, copier):
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False, handoff="forward")
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H), copier=copier)
    w.start()
    return w


def test_the_forwards_never_wait_for_a_copy_and_the_last_steps_are_sent_by_the_timer(tmp_path):
    copier = LateCopier()
    w = writer(tmp_path, copier)
    try:
        assert not any(t.name == "hscap-send" for t in threading.enumerate())  # no hand-off thread
        sent = {}
        for k in range(6):
            line, t = step(f"r{k}", 10 + k)
            sent[f"r{k}"] = t
            assert w.submit(line, t, aux_layers=[1, 2])
        assert w.cost.report()["handoff_s"] < COPY_S / 3  # no forward waited for a copy
        # no forward comes after the last: the timer sends each step once its copy is done
        deadline = time.monotonic() + COPY_S + 20 * TAIL_S + 5
        while w.stats["steps_written"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.stats["steps_written"] == 6
        assert not any(e.slept for e in copier.events)  # each was sent once done, by whoever came
    finally:
        assert w.close()
    assert meta_of(w)["stats"]["handoff"] == "forward"
    got = stitch(open_runs(str(tmp_path))[0])
    for rid, t in sent.items():
        assert got[rid].complete and torch.equal(torch.from_numpy(got[rid].final.copy()), t["final"])
        assert torch.equal(torch.from_numpy(got[rid].layers[2].copy()), t["aux"][:, H:])


def test_a_close_sends_every_step_whose_copy_is_still_running(tmp_path):
    w = writer(tmp_path, LateCopier())
    for k in range(4):
        assert w.submit(*step(f"r{k}", 8), aux_layers=[1, 2])
    assert w.stats["steps_written"] == 0  # every copy still running
    assert w.close()
    assert w.stats["steps_written"] == 4 and len(stitch(open_runs(str(tmp_path))[0])) == 4


def test_the_handoff_setting_is_checked_and_recorded():
    assert config.load({"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r"}).handoff == "thread"
    assert config.load({"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r", "HSCAP_HANDOFF": "forward"}).handoff == "forward"
    with pytest.raises(ConfigError, match="HSCAP_HANDOFF='later': choose thread"):
        config.load({"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r", "HSCAP_HANDOFF": "later"})


def test_a_forward_held_by_the_budget_hears_the_writer_itself(tmp_path):
    """No thread hears the writer while steps come: a forward the in-flight budget holds reads
    the replies that free it, so back-pressure costs no timer's period a step."""
    one_step = sum(x.numel() * x.element_size() for x in step("x", 100)[1].values())
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False, handoff="forward",
                        max_inflight_bytes=int(one_step * 1.5))
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H))
    w.start()
    t0 = time.monotonic()
    for k in range(12):
        assert w.submit(*step(f"r{k}", 100), aux_layers=[1, 2])
    elapsed = time.monotonic() - t0
    assert w.close()
    assert w.stats["steps_written"] == 12 and w.cost.report()["budget_wait_s"] > 0  # it was held
    assert elapsed < 12 * ACTIVE_S / 2, elapsed  # not a replies-thread period per held step


def test_a_dead_writer_lets_a_held_forward_go_and_stops_capture_loudly(tmp_path, monkeypatch, shims_on_path, caplog):
    monkeypatch.setenv("HSCAP_TEST_SLOW_DISK_MS", "3000")
    one_step = sum(x.numel() * x.element_size() for x in step("x", 100)[1].values())
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False, handoff="forward",
                        writer_threads=1, max_inflight_bytes=int(one_step * 2.5))
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H))
    w.start()
    for k in range(2):
        assert w.submit(*step(f"r{k}", 100), aux_layers=[1, 2])
    held = threading.Event()
    threading.Thread(target=lambda: (w.submit(*step("r2", 100), aux_layers=[1, 2]), held.set()), daemon=True).start()
    time.sleep(0.3)
    assert not held.is_set()  # the budget is full: it waits for the writer, which is about to die
    w._sink._proc.kill()
    assert held.wait(10)
    deadline = time.time() + 10
    while not w.stopped and time.time() < deadline:
        time.sleep(0.05)
    assert w.stopped and "writer process exited" in w.stopped["reason"] and "capture STOPPED" in caplog.text
    assert not w.submit(*step("r3", 8), aux_layers=[1, 2])
    w.close(5)
    assert "writer process exited" in meta_of(w)["capture_stopped"]["reason"]
