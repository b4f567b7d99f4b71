"""Capture sustained for minutes at a saturated prefill step, at the DEFAULT settings (no sglang
needed: on an offline GPU machine, `bash benchmarks/gpu/device.sh offline python3
benchmarks/gpu/sustained.py ...` puts hs_capture's dependencies on the path).

A "forward" of 112 bf16 matmuls [8192, 7168] x [7168, 7168] (~140 ms: one TP-8 H200's share
of an 8192-token DeepSeek-V3 prefill) produces SGLang 0.5.23's packed aux [8192, 3 x 7168]
+ the final state + ids/positions: 470 MB a step, ~3.4 GB/s. Each step waits for its compute
stream, as a server's scheduler does (SGLang waits on the batch's own stream/event, never on the
whole device: torch.cuda.synchronize() would also wait for capture's copy stream, which runs off
the critical path). Phases, one process, one target dir each:
  off (no capture) -> on (ShardWriter at the defaults: codec, level, threads, fsync,
  in-flight budget, backlog policy) for --seconds -> off again.
A janitor deletes each step's files once its index line is written, so minutes of states
fit the target (a disk, or tmpfs). Reported: mean step time on vs off (over every
step, and over the steady state after --settle-s), produced vs written GB/s, the compression
ratio achieved, steps written raw by the backlog policy, drops, forwards held, and the
writer's own disk-bound report. Before each target's run a probe measures the rate the target
takes in the writer's pattern (threads writing whole files with fsync): the step time it
allows is the figure a disk-bound run is held to.

usage: python benchmarks/gpu/sustained.py [--dirs /dev/shm /root/hscap-sustained]
                                          [--seconds 150] [--off-seconds 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from capture import H, K, STEP_SIZES, T, prewarm_and_wait, write_results  # noqa: E402  (beside this file)
from hs_capture.server import config  # noqa: E402
from hs_capture.dump.paths import RankId, index_path  # noqa: E402
from hs_capture.server.writer import ShardWriter  # noqa: E402
from hs_capture.dump.schema import RankMeta, SeqEntry, step_line

LAYERS, MATMULS = [2, 30, 58], 112
assert K == len(LAYERS)


class Janitor(threading.Thread):
    """Deletes the files of every indexed step (the writer indexes a step only once all its
    files are durable), so a long run needs no more space than the steps in flight."""

    def __init__(self, run_dir: str, rank: RankId) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.index = run_dir, index_path(run_dir, rank)
        self.stop = threading.Event()
        self.deleted_bytes = 0
        self._pos = 0

    def sweep(self) -> None:
        if not os.path.exists(self.index):
            return
        with open(self.index) as f:
            f.seek(self._pos)
            for line in f:
                if not line.endswith("\n"):
                    break  # being appended
                self._pos += len(line.encode())
                for part in json.loads(line).get("files", {}).values():
                    path = os.path.join(self.run_dir, part["path"])
                    self.deleted_bytes += os.path.getsize(path)
                    os.remove(path)

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.sweep()
        self.sweep()


def disk_rate(target: str, threads: int, file_bytes: int, total_bytes: int) -> float:
    """GB/s the target takes in the writer's own pattern (threads writing whole files with
    fsync, each deleted behind): what "the disk allows" is measured against."""
    block = os.urandom(1 << 24)
    per_thread = max(1, total_bytes // (threads * file_bytes))

    def work(k: int) -> None:
        for i in range(per_thread):
            path = os.path.join(target, f"probe-{k}-{i}")
            with open(path, "wb") as f:
                for _ in range(max(1, file_bytes // len(block))):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            os.remove(path)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    written = threads * per_thread * max(1, file_bytes // len(block)) * len(block)
    return written / 1e9 / (time.perf_counter() - t0)


def forward_fn():
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ws = [torch.randn(H, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H ** 0.5 for _ in range(8)]
    marks = {MATMULS // 4, MATMULS // 2, 3 * MATMULS // 4}
    ids = torch.randint(0, 100000, (T,), device="cuda", generator=gen)
    pos = torch.arange(T, device="cuda")

    def forward() -> Dict[str, torch.Tensor]:
        x = a
        outs = []
        for i in range(MATMULS):
            x = x @ ws[i % len(ws)]
            if i in marks:
                outs.append(x)
        return {"aux": torch.cat(outs, dim=-1), "final": x, "tokens": ids.clone(), "positions": pos.clone()}

    return forward


def phase(forward, seconds: float, writer=None) -> List[float]:
    """Synchronized steps for `seconds`; each step's wall time (s)."""
    times: List[float] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        out = forward()
        if writer is not None:
            writer.submit(step_line("EXTEND", T, T, "bfloat16", [SeqEntry(f"r{i}", T, 0, 0)]), out,
                          aux_layers=LAYERS)
        torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t0)
        i += 1
    return times


def mean(xs: List[float]) -> float:
    return sum(xs) / max(1, len(xs))


def run_target(target: str, forward, seconds: float, off_seconds: float, settle_s: float, probe_bytes: int) -> dict:
    root = os.path.join(target, f"hscap-sustained-{os.getpid()}")
    overrides = {k: v for k, v in os.environ.items() if k.startswith("HSCAP_")}  # none: the defaults
    env = {**overrides, "HSCAP_DIR": root, "HSCAP_RUN_ID": "run-sustained", "HSCAP_LAYERS": ",".join(map(str, LAYERS))}
    cfg = config.load(env)  # every performance setting at its default unless overridden above
    os.makedirs(cfg.run_dir, exist_ok=True)
    probe_GBps = disk_rate(cfg.run_dir, config.default_writer_threads(), 80 << 20, probe_bytes)
    off1 = phase(forward, off_seconds)
    w = ShardWriter(cfg, RankId(), RankMeta(layers=LAYERS, hidden_size=H), expected_rows=T, step_sizes=STEP_SIZES)
    cfg = w.cfg  # the auto settings (threads, budget) as the writer resolved them
    w.start()
    prewarm_and_wait(w, cfg.max_inflight_bytes, 60)  # what the hook does at model load
    janitor = Janitor(cfg.run_dir, RankId())
    janitor.start()
    t0 = time.monotonic()
    on = phase(forward, seconds, w)
    on_wall = time.monotonic() - t0
    w.close()
    drain_s = time.monotonic() - t0 - on_wall
    janitor.stop.set()
    janitor.join()
    off2 = phase(forward, off_seconds)
    with open(os.path.join(cfg.run_dir, "ranks", RankId().tag + ".json")) as f:
        meta = json.load(f)
    shutil.rmtree(root, ignore_errors=True)
    st = meta["stats"]
    elapsed, steady = 0.0, []
    for t in on:
        elapsed += t
        if elapsed >= settle_s:
            steady.append(t)
    off = off1 + off2
    step_raw = T * 4 * H * 2 + 2 * T * 8  # aux + final bf16, ids + positions int64
    ratio = st["raw_bytes"] / max(1, st["file_bytes"])
    # the slowest step the target allows: the step's files at the probed rate, or the GPU's own
    allowed = max(mean(off), step_raw / ratio / 1e9 / probe_GBps)
    return {
        "target": target, "overrides": overrides, "settings": {"codec": cfg.codec, "level": cfg.level, "writer_threads": cfg.writer_threads,
                                       "fsync": cfg.fsync, "inflight_GiB": round(cfg.max_inflight_bytes / 2 ** 30, 1),
                                       "on_full": cfg.on_full, "on_backlog": cfg.on_backlog},
        "seconds_on": round(on_wall, 1), "steps_on": len(on), "steps_off": len(off),
        "step_ms_off_mean": round(mean(off) * 1e3, 2), "step_ms_on_mean": round(mean(on) * 1e3, 2),
        "ratio_on_off_mean": round(mean(on) / mean(off), 4),
        "steady_after_s": settle_s, "step_ms_on_steady_mean": round(mean(steady) * 1e3, 2),
        "ratio_on_off_steady_mean": round(mean(steady) / mean(off), 4),
        "step_ms_on_max": round(max(on) * 1e3, 1),
        "produced_GBps": round(len(on) * step_raw / on_wall / 1e9, 2),
        "written_raw_GBps": round(st["raw_bytes"] / (on_wall + drain_s) / 1e9, 2),
        "to_disk_GBps": round(st["file_bytes"] / (on_wall + drain_s) / 1e9, 2),
        "compression_ratio": round(ratio, 3),
        "target_probe_GBps": round(probe_GBps, 2), "step_ms_allowed_by_target": round(allowed * 1e3, 1),
        "ratio_on_allowed_steady_mean": round(mean(steady) / allowed, 4),
        "steps_written": st["steps_written"], "steps_written_raw": st["steps_written_raw"],
        "steps_dropped": st["steps_dropped"], "steps_failed": st["steps_failed"],
        "forward_waited_s": st["forward_waited_s"], "peak_inflight_GB": round(st["peak_inflight_bytes"] / 1e9, 2),
        "drain_after_last_step_s": round(drain_s, 1), "disk_bound": meta.get("disk_bound"),
        "pinned_allocs_in_forward": st["pinned_allocs_in_forward"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirs", nargs="+", default=["/dev/shm", "/root/hscap-sustained"])
    p.add_argument("--seconds", type=float, default=150)
    p.add_argument("--off-seconds", type=float, default=20)
    p.add_argument("--settle-s", type=float, default=30, help="steady state: on-steps after this many seconds")
    p.add_argument("--probe-gb", type=float, default=6, help="bytes the target's write-rate probe writes (deleted behind)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    forward = forward_fn()
    phase(forward, 3)  # warm up cuBLAS
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "usable_cores": config.usable_cores(),
           "date": time.strftime("%Y-%m-%d"), "step": f"aux [{T}, 3x{H}] + final [{T}, {H}] bf16 + ids/positions",
           "runs": []}
    for d in a.dirs:
        os.makedirs(d, exist_ok=True)
        r = run_target(d, forward, a.seconds, a.off_seconds, a.settle_s, int(a.probe_gb * 1e9))
        res["runs"].append(r)
        print(json.dumps(r), flush=True)
    write_results(res, a.out)


if __name__ == "__main__":
    main()
