"""Does capture's device-to-host copy delay the server's own small result copy?

A model of SGLang's overlap scheduler in plain torch (no SGLang): each step launches a forward
(matmuls for about FWD ms on the default stream), then the server's small device-to-host copy
of the step's result (as SGLang's `copy_to_cpu`) and its event; the host then waits for the
PREVIOUS step's event and spends CPU ms in Python (the scheduler's own work). With capture, the
forward also clones BYTES of states on its stream and a side stream copies the clone into pinned
memory, as hs_capture's staging does (`whole`: one copy; `chunks`: 4 MiB copies). Reported:
steps/s with capture against without, and the small copy's latency (event to host, p50/p99).

The second part is launch-bound, as a small model's scheduler is: each step launches LAUNCHES
small kernels from Python, and with capture a waiter thread (as the writer's hand-off thread)
waits for each step's copy event: `spin` with a default event (the CUDA driver may spin-wait
for it), `blocking` with an event made `blocking=True` (the thread sleeps in the driver).

usage: python benchmarks/gpu/copy_contention.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

MiB = 1 << 20


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def calibrate(a: torch.Tensor, fwd_ms: float) -> int:
    """Matmuls of `a` per forward to take about fwd_ms on the GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 50 * 1e3
    return max(1, round(fwd_ms / per))


def run(steps: int, fwd_ms: float, cpu_ms: float, nbytes: int, mode: str, a: torch.Tensor, reps: int) -> dict:
    side = torch.cuda.Stream()
    states = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(4)] if mode != "off" else []
    ring_ev = [None] * len(ring)
    result = torch.empty(256, dtype=torch.int64, device="cuda")
    lat = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prev = None
    for i in range(steps):
        for _ in range(reps):
            a @ a
        if mode != "off":
            k = i % len(ring)
            if ring_ev[k] is not None:
                ring_ev[k].synchronize()  # the writer has the buffer back
            c = states.clone()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if mode == "whole":
                    ring[k].copy_(c, non_blocking=True)
                else:
                    for s in range(0, nbytes, 4 * MiB):
                        ring[k][s:s + 4 * MiB].copy_(c[s:s + 4 * MiB], non_blocking=True)
                c.record_stream(side)
                ev = torch.cuda.Event()
                ev.record(side)
                ring_ev[k] = ev
        host = result.to("cpu", non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        if prev is not None:
            t = time.perf_counter()
            prev.synchronize()
            lat.append((time.perf_counter() - t) * 1e3)
        spin(cpu_ms)
        prev = done
        del host
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    lat.sort()
    return {"steps_per_s": round(steps / wall, 2), "wait_p50_ms": round(statistics.median(lat), 3),
            "wait_p99_ms": round(lat[int(len(lat) * 0.99) - 1], 3)}


def launch_bound(steps: int, launches: int, nbytes: int, mode: str) -> dict:
    import queue
    import threading

    side = torch.cuda.Stream()
    x = torch.zeros(64, device="cuda")
    states = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    free = queue.Queue()
    for k in range(len(ring)):
        free.put(k)
    handed: "queue.Queue" = queue.Queue()

    def waiter() -> None:
        while True:
            item = handed.get()
            if item is None:
                return
            ev, k = item
            ev.synchronize()
            free.put(k)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        for _ in range(launches):
            x.add_(1)
        if mode != "off":
            k = free.get()
            c = states.clone()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ring[k].copy_(c, non_blocking=True)
                c.record_stream(side)
                ev = torch.cuda.Event(blocking=mode == "blocking")
                ev.record(side)
            handed.put((ev, k))
        x[:1].to("cpu", non_blocking=True)
        torch.cuda.current_stream().synchronize()
    handed.put(None)
    t.join()
    torch.cuda.synchronize()
    return {"steps_per_s": round(steps / (time.perf_counter() - t0), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--launch-bound-only", action="store_true", help="only the second part")
    args = ap.parse_args()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for fwd_ms, cpu_ms, mb in () if args.launch_bound_only else ((20, 18, 73), (10, 12, 36), (20, 5, 73)):
        reps = calibrate(a, fwd_ms)
        row = {"fwd_ms": fwd_ms, "cpu_ms": cpu_ms, "capture_mib": mb}
        for mode in ("off", "whole", "chunks", "off"):
            r = run(args.steps, fwd_ms, cpu_ms, mb * MiB, mode, a, reps)
            row.setdefault(mode, []).append(r) if mode == "off" else row.__setitem__(mode, r)
        offs = [r["steps_per_s"] for r in row["off"]]
        base = sum(offs) / len(offs)
        row["whole_over_off"] = round(row["whole"]["steps_per_s"] / base, 4)
        row["chunks_over_off"] = round(row["chunks"]["steps_per_s"] / base, 4)
        print(json.dumps(row), flush=True)
        results.append(row)
    for launches, mb in ((2000, 73), (4000, 73)):
        row = {"launches": launches, "capture_mib": mb}
        for mode in ("off", "spin", "blocking", "off", "spin", "blocking"):
            row.setdefault(mode, []).append(launch_bound(args.steps, launches, mb * MiB, mode)["steps_per_s"])
        base = sum(row["off"]) / 2
        row["spin_over_off"] = round(sum(row["spin"]) / 2 / base, 4)
        row["blocking_over_off"] = round(sum(row["blocking"]) / 2 / base, 4)
        print(json.dumps(row), flush=True)
        results.append(row)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
