"""Does a step larger than the buffers pinned ahead hold the forwards? (no sglang needed: on an
offline GPU machine, `bash benchmarks/gpu/device.sh offline python3 benchmarks/gpu/pinned_pool.py`).

gpu/purpose.py's hooked server with `--prenorm` ran prefill at 0.30 of the plain one on the
H200: the hook pinned its buffers ahead for a step of the captured layers and the final state,
without the pre-norm state, so every full step was larger than every buffer but one, and waited
for that one (`held_by_pinned_s`, "1 of 63 in flight"). This replays that server's steps at the
DEFAULT writer settings, a tmpfs dump (the disk out of the picture) and a fixed "forward" of
matmuls, in one run:
  sized_right   buffers pinned ahead for the whole step (what the hook does now)
  sized_short   pinned ahead without the pre-norm state (the hook before): every full step
                waits for the one buffer big enough
Each against the forward alone (off): mean step time on / off, forwards held and by what.

usage: python benchmarks/gpu/pinned_pool.py [--tokens 8192] [--hidden 1024] [--seconds 20]
                                            [--step-ms 70] [--dir /dev/shm] [--out FILE]
On a CPU (`--cpu`, a small shape): the same loop with unpinned buffers, to check the script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from types import SimpleNamespace
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

from capture import prewarm_and_wait, write_results  # noqa: E402  (beside this file)
from sustained import Janitor, mean  # noqa: E402
from hs_capture.server import config, staging  # noqa: E402
from hs_capture.server.capture import _step_bytes  # noqa: E402
from hs_capture.server.writer import ShardWriter  # noqa: E402
from hs_capture.dump.paths import PRENORM, RankId  # noqa: E402
from hs_capture.dump.schema import RankMeta, SeqEntry, step_line  # noqa: E402

LAYERS = [2, 3, 5]  # purpose.py's


class HostCopier:
    """--cpu: copies into the pool's (unpinned) buffers at once, so the pool is exercised."""

    pin_memory = False

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def begin(self) -> None:
        pass

    def copy(self, host: torch.Tensor, t: torch.Tensor) -> None:
        host.copy_(t)

    def finish(self) -> None:
        return None


def forward_fn(tokens: int, hidden: int, matmuls: int, device: str):
    """A fixed "forward": `matmuls` [T, H] x [H, H] bf16, its states taken along the way."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    ws = [torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16, generator=gen) / hidden ** 0.5
          for _ in range(4)]
    ids = torch.randint(0, 100000, (tokens,), device=device, generator=gen)
    pos = torch.arange(tokens, device=device)

    def forward() -> Dict[str, torch.Tensor]:
        x, outs = a, []
        for i in range(max(5, matmuls)):
            x = x @ ws[i % len(ws)]
            if i < 5:
                outs.append(x)
        return {"aux": torch.cat(outs[:3], dim=-1), "final": outs[4], PRENORM: outs[3],
                "tokens": ids.clone(), "positions": pos.clone()}

    return forward


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.current_stream().synchronize()  # the scheduler waits on its batch's stream


def phase(forward, seconds: float, device: str, tokens: int, writer=None) -> List[float]:
    times: List[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        out = forward()
        if writer is not None:
            rid = f"r{len(times)}"
            writer.submit(step_line("EXTEND", tokens, tokens, "bfloat16", [SeqEntry(rid, tokens, 0, 0)]), out,
                          aux_layers=LAYERS)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def calibrate(tokens: int, hidden: int, step_ms: float, device: str) -> int:
    """How many matmuls make one forward take about step_ms."""
    f = forward_fn(tokens, hidden, 50, device)
    phase(f, 1.0, device, tokens)
    t = phase(f, 2.0, device, tokens)
    return max(5, int(50 * step_ms / 1e3 / (sum(t) / len(t))))


def run_case(name: str, forward, a, device: str, prenorm_counted: bool) -> dict:
    root = os.path.join(a.dir, f"hscap-pinned-pool-{os.getpid()}-{name}")
    cfg = config.load({"HSCAP_DIR": root, "HSCAP_RUN_ID": "run-pool", "HSCAP_LAYERS": ",".join(map(str, LAYERS)),
                       "HSCAP_PRENORM": "1"})  # every performance setting at its default
    os.makedirs(cfg.run_dir, exist_ok=True)
    sizes = _step_bytes(a.tokens, a.hidden, len(LAYERS), SimpleNamespace(torch_dtype="bfloat16"), prenorm_counted)
    w = ShardWriter(cfg, RankId(), RankMeta(layers=LAYERS, hidden_size=a.hidden, prenorm=True),
                    expected_rows=a.tokens, step_sizes=sizes, copier=HostCopier() if device == "cpu" else None)
    w.start()
    step = w.pinned_pool.rounded(staging.step_buffer_bytes(sizes))
    if device == "cpu":  # the writer pins ahead only on a GPU: the same buffers, unpinned
        w.pinned_pool.prewarm([step] * (w.cfg.max_inflight_bytes // step))
    prewarm_and_wait(w, w.cfg.max_inflight_bytes, 60, sizes)  # what the hook does at model load
    pinned_ahead = w.pinned_pool.buffers
    janitor = Janitor(cfg.run_dir, RankId())
    janitor.start()
    off = phase(forward, a.off_seconds, device, a.tokens)
    on = phase(forward, a.seconds, device, a.tokens, w)
    w.close()
    janitor.stop.set()
    janitor.join()
    st = w.run_meta.stats
    shutil.rmtree(root, ignore_errors=True)
    return {"case": name, "prenorm_counted_in_buffers": prenorm_counted,
            "buffers_pinned_ahead": pinned_ahead, "buffer_bytes": step,
            "step_bytes": sum(t.numel() * t.element_size() for t in forward().values()),
            "writer_threads": w.cfg.writer_threads, "inflight_GiB": round(w.cfg.max_inflight_bytes / 2 ** 30, 2),
            "steps_on": len(on), "step_ms_off_mean": round(mean(off) * 1e3, 2),
            "step_ms_on_mean": round(mean(on) * 1e3, 2), "ratio_on_off": round(mean(on) / mean(off), 3),
            **{k: st.get(k) for k in ("forward_waited_s", "held_by_budget_s", "held_by_pinned_s", "pinned_buffers",
                                      "pinned_bytes", "pinned_allocs_in_forward", "steps_written",
                                      "steps_dropped", "steps_written_raw")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="rows of a full step (the chunked-prefill size)")
    p.add_argument("--hidden", type=int, default=1024, help="purpose.py's target: 1024")
    p.add_argument("--step-ms", type=float, default=70.0, help="the forward's time (purpose.py's plain server: ~70)")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--off-seconds", type=float, default=5)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--cpu", action="store_true", help="check the script on a CPU (unpinned buffers)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = "cpu" if a.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("pinned_pool.py: no CUDA device (use --cpu to check the script)")
    matmuls = calibrate(a.tokens, a.hidden, a.step_ms, device)
    forward = forward_fn(a.tokens, a.hidden, matmuls, device)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "step": f"aux [{a.tokens}, 3x{a.hidden}] + final + pre-norm bf16 + ids/positions",
           "matmuls_per_forward": matmuls, "dump": a.dir, "runs": []}
    for name, counted in (("sized_right", True), ("sized_short", False)):
        r = run_case(name, forward, a, device, counted)
        res["runs"].append(r)
        print(r, flush=True)
    write_results(res, a.out)


if __name__ == "__main__":
    main()
