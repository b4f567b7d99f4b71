"""The overlap-scheduler race, reproduced on a CPU (found on the H200, sglang 0.5.15).

On a GPU the host copy of a step runs on a side stream, later than the forward's own stream
moves on; under SGLang's overlap scheduler the next batch's `load_batch` refills the fixed
input buffers (input_ids, positions) that this step's forward read. A copier whose copies run
only when the writer waits for them (DeferredCopier) is that side stream on a CPU: refill the
buffers after submit, and the stored step must still be the step that was submitted.
"""

import numpy as np
import pytest
import torch

from hs_capture.server.config import CaptureConfig
from hs_capture.dump.paths import RankId
from hs_capture.offline.read.reader import open_runs
from hs_capture.server.staging import Stager, may_be_refilled
from hs_capture.server.writer import ShardWriter
from hs_capture.dump.schema import RankMeta, SeqEntry, step_line
from tests.sglang_cpu.stitch import stitch

H = 32


class DeferredCopier:
    """Copies run when the writer waits on the step (as a side stream's run after the forward's
    stream has moved on); `own` runs at once (as a clone on the forward's stream does)."""

    pin_memory = False

    def __init__(self) -> None:
        self.pending = []
        self.owned = 0

    def own(self, t: torch.Tensor) -> torch.Tensor:
        self.owned += 1
        return t.clone()

    def begin(self) -> None:
        pass

    def copy(self, host: torch.Tensor, t: torch.Tensor) -> None:
        self.pending.append((host, t))

    def finish(self):
        pending, self.pending = self.pending, []

        class Done:
            def synchronize(self) -> None:
                for host, t in pending:
                    host.copy_(t)

        return Done()


class InputRegistry:
    """SGLang 0.5.15's eager-runner input buffers: fixed, sliced per batch, refilled by the next."""

    def __init__(self, capacity: int = 256) -> None:
        self.input_ids = torch.zeros(capacity, dtype=torch.int64)
        self.positions = torch.zeros(capacity, dtype=torch.int64)

    def load_batch(self, tokens: torch.Tensor, start: int):
        n = tokens.numel()
        self.input_ids[:n] = tokens
        self.positions[:n] = torch.arange(start, start + n)
        return self.input_ids[:n], self.positions[:n]


def test_inputs_refilled_by_the_next_batch_are_staged_as_they_were():
    reg = InputRegistry()
    tokens_a = torch.arange(100, 140)
    ids, pos = reg.load_batch(tokens_a, start=0)
    final = torch.randn(40, H)
    stager = Stager(copier=DeferredCopier())
    staged = stager.stage({"final": final, "tokens": ids, "positions": pos}, inputs=("tokens", "positions"))
    reg.load_batch(torch.arange(900, 960), start=500)  # the next batch, before the copy ran
    staged.ready()
    assert torch.equal(staged.tensors["tokens"], tokens_a)
    assert torch.equal(staged.tensors["positions"], torch.arange(0, 40))
    assert torch.equal(staged.tensors["final"], final)


def test_a_state_in_a_larger_buffer_is_owned_and_a_fresh_one_is_not_copied_twice():
    out_buf = torch.zeros(256, H)  # e.g. a CUDA graph's static output buffer
    out_buf[:40] = torch.randn(40, H)
    want = out_buf[:40].clone()
    fresh = torch.randn(40, 3 * H)  # what the forward allocated for this step
    copier = DeferredCopier()
    staged = Stager(copier=copier).stage({"final": out_buf[:40], "aux": fresh})
    out_buf.zero_()
    staged.ready()
    assert torch.equal(staged.tensors["final"], want)
    assert copier.owned == 1  # only the view: the fresh 3H tensor is copied once, straight to the host
    assert may_be_refilled(out_buf[:40]) and not may_be_refilled(fresh)


def test_the_writer_stores_the_submitted_step_when_its_input_buffers_are_refilled(tmp_path):
    cfg = CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", layers=[1], fsync=False)
    w = ShardWriter(cfg, RankId(0, 0, 0), RankMeta(layers=[1], hidden_size=H), copier=DeferredCopier())
    w.start()
    reg = InputRegistry()
    want = {}
    for i, (rid, n) in enumerate((("a", 30), ("b", 50), ("c", 20))):
        tokens = torch.arange(1000 * (i + 1), 1000 * (i + 1) + n)
        ids, pos = reg.load_batch(tokens, start=0)
        final, aux = torch.randn(n, H), torch.randn(n, H)
        want[rid] = (tokens, final, aux)
        meta = step_line("EXTEND", n, n, "float32", [SeqEntry(rid, n, 0, 0)])
        w.submit(meta, {"final": final, "aux": aux, "tokens": ids, "positions": pos}, aux_layers=[1])
    reg.load_batch(torch.full((200,), 7), start=4000)  # a later batch refills before the writer copies
    assert w.close()
    samples = stitch(open_runs(str(tmp_path))[0])
    assert sorted(samples) == ["a", "b", "c"]
    for rid, (tokens, final, aux) in want.items():
        s = samples[rid]
        assert s.complete and np.array_equal(s.input_ids, tokens.numpy()), rid
        assert np.array_equal(s.final, final.numpy()) and np.array_equal(s.layers[1], aux.numpy()), rid


def test_the_pool_waits_for_a_buffer_at_its_cap_instead_of_pinning_in_the_forward():
    import threading
    import time

    from hs_capture.server.staging import HostBuffer, PinnedPool

    g = 1 << 20
    pool = PinnedPool(pin=False, cap=2 * g)
    a, _ = pool.take(g), pool.take(g)
    assert pool.hot_allocs == 2 and pool.pinned_bytes == 2 * g
    assert pool.take(g, block=False) is None  # the drop policy's answer
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take(g)))
    t.start()
    time.sleep(0.3)
    assert not got  # held: back-pressure, not a third pinned buffer
    pool.give(a)
    t.join(5)
    assert got and got[0] is a and pool.pinned_bytes == 2 * g and pool.waited_s > 0.2
    big = pool.take(3 * g, block=False)  # larger than any buffer made: pinned even at the cap
    assert big is not None and big.nbytes == 3 * g
    # what is counted is what is mapped: whole pages, no more (a cap is a cap)
    odd = PinnedPool(pin=False)
    buf = odd.take(g + 1)
    assert buf.nbytes == g + HostBuffer.PAGE and odd.pinned_bytes == buf.nbytes and len(buf.tensor) == buf.nbytes


@pytest.mark.parametrize("packed", [False, True], ids=["aux list (0.5.15)", "packed aux (0.5.23)"])
@pytest.mark.parametrize("prenorm", [False, True], ids=["final", "final and pre-norm"])
def test_the_buffers_pinned_ahead_hold_a_full_step_of_every_captured_state(packed, prenorm):
    from types import SimpleNamespace

    from hs_capture.server.capture import _step_bytes
    from hs_capture.server.staging import PinnedPool, step_buffer_bytes
    from hs_capture.server.step import take_step

    rows, layers = 512, [1, 3, 5]
    fb = SimpleNamespace(extend_seq_lens_cpu=[rows], extend_prefix_lens_cpu=[0], rids=["r"],
                         input_ids=torch.zeros(rows, dtype=torch.int64), positions=torch.arange(rows))
    state = lambda: torch.zeros(rows, H, dtype=torch.bfloat16)  # noqa: E731
    aux = torch.zeros(rows, H * len(layers), dtype=torch.bfloat16) if packed else [state() for _ in layers]
    _, tensors, _ = take_step(fb, "prefill", state(), aux, layers, layers, H, state() if prenorm else None)
    step = step_buffer_bytes([t.numel() * t.element_size() for t in tensors.values()])
    pinned = step_buffer_bytes(_step_bytes(rows, H, len(layers), SimpleNamespace(torch_dtype="bfloat16"), prenorm))
    # the prewarmed buffer is cut to the full step: it holds the step, with no more than rounding spare
    assert step <= pinned < step + 8 * 256
    assert PinnedPool().rounded(step) <= PinnedPool().rounded(pinned)


@pytest.mark.parametrize("flags,rows", [({"chunked_prefill_size": 8192, "max_prefill_tokens": 16384}, 8192),
                                        ({"chunked_prefill_size": -1, "max_prefill_tokens": 16384}, 16384),
                                        ({"max_prefill_tokens": 16384}, 16384), ({}, 0)])
def test_a_full_step_is_the_chunk_or_with_chunking_off_the_prefill_budget(flags, rows):
    from hs_capture.server.capture import full_step_rows

    assert full_step_rows(flags) == rows
