"""HSCAP_COPY_START=next-forward: a step's device-to-host copy starts when the next forward
begins (behind the server's own copy of the step's results on the GPU's copy engine), not as
its forward ends; with no next forward, whoever waits for the copy starts it once it is
LATE_S old; a copy that cannot start fails its step loudly and the server goes on. The
copier here is a CPU stand-in for the side stream's (staging.CudaSideStream) that records
how each copy was started; the CUDA path itself runs on a GPU (benchmarks/gpu)."""

import time

import pytest
import torch

from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import RankMeta
from hs_capture.offline.read.reader import open_runs
from hs_capture.server import config, staging
from hs_capture.server.config import CaptureConfig, ConfigError
from hs_capture.server.staging import LATE_S, CpuCopy, DeferredCopy
from hs_capture.server.writer import ShardWriter
from tests.sglang_cpu.stitch import stitch
from tests.test_writer import H, step
from tests.test_writer_process import meta_of


class Done:
    def query(self):
        return True

    def synchronize(self):
        pass


class DeferringCopy(CpuCopy):
    """Holds each step's copies, as CudaSideStream(defer=True) does; `starts` records how each
    step's copy started (True: by a forward, behind the forward stream's current work)."""

    def __init__(self, fail: bool = False) -> None:
        self.starts, self.fail, self._pairs = [], fail, []

    def begin(self):
        self._pairs = []

    def copy(self, host, t):
        self._pairs.append((host, t.clone()))

    def finish(self):
        pairs = self._pairs

        def launch(after_current):
            if self.fail:
                raise RuntimeError("no stream")
            for host, t in pairs:
                host.copy_(t)
            self.starts.append(after_current)
            return Done()

        return DeferredCopy(launch)


def writer(tmp_path, copier, **kw):
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1, 2], fsync=False,
                        copy_start="next-forward", **kw)
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1, 2], hidden_size=H), copier=copier)
    w.start()
    return w


@pytest.mark.parametrize("handoff", ["thread", "forward"])
def test_each_copy_starts_at_the_next_forward(tmp_path, handoff, monkeypatch):
    monkeypatch.setattr(staging, "LATE_S", 60.0)  # a loaded machine's slow loop must not start them late
    copier = DeferringCopy()
    w = writer(tmp_path, copier, handoff=handoff)
    sent = {}
    for k in range(5):
        w.start_copies()  # the forward begins: the step before it starts copying
        assert copier.starts == [True] * k
        line, t = step(f"r{k}", 10 + k)
        sent[f"r{k}"] = t
        assert w.submit(line, t, aux_layers=[1, 2])
    w.start_copies()
    assert copier.starts == [True] * 5 and w.close()
    got = stitch(open_runs(str(tmp_path))[0])
    for rid, t in sent.items():
        assert got[rid].complete and torch.equal(torch.from_numpy(got[rid].final.copy()), t["final"])
        assert torch.equal(torch.from_numpy(got[rid].layers[1].copy()), t["aux"][:, :H])
    assert meta_of(w)["stats"]["copy_start"] == "next-forward"


@pytest.mark.parametrize("handoff", ["thread", "forward"])
def test_with_no_next_forward_the_copy_starts_late_and_the_step_is_written(tmp_path, handoff):
    copier = DeferringCopy()
    w = writer(tmp_path, copier, handoff=handoff)
    try:
        assert w.submit(*step("r0", 12), aux_layers=[1, 2])
        deadline = time.monotonic() + LATE_S + 5
        while w.stats["steps_written"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.stats["steps_written"] == 1 and copier.starts == [False]  # started late, by its waiter
    finally:
        assert w.close()


def test_a_copy_that_cannot_start_fails_its_step_and_capture_goes_on(tmp_path):
    w = writer(tmp_path, DeferringCopy(fail=True))
    assert w.submit(*step("r0", 12), aux_layers=[1, 2])
    w.start_copies()  # the forward is not disturbed: the failure is the waiter's to hear
    w.close()
    assert w.stats["steps_written"] == 0 and "could not start" in (w.failure or "")


def test_the_copy_start_setting_is_checked():
    base = {"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r"}
    assert config.load(base).copy_start == "forward-end"
    assert config.load({**base, "HSCAP_COPY_START": "next-forward"}).copy_start == "next-forward"
    with pytest.raises(ConfigError, match="HSCAP_COPY_START='later': choose forward-end"):
        config.load({**base, "HSCAP_COPY_START": "later"})
