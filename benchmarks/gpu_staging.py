"""The writer's CUDA path on a real GPU (run with the device tool on the H200).

1. correctness: prefill-shaped bf16 captures (8192 x 7168, SGLang's packed [T, 3H] aux +
   the final state + ids/positions) go through ShardWriter.submit and come back from disk
   bit-exact, although the forward frees them and the allocator hands the memory to new
   tensors filled with garbage right after submit (record_stream must hold it).
2. critical-path cost: host microseconds of submit() for one step.
3. device-to-host bandwidth achieved by the side-stream copy vs pinned peak.
4. a matmul "forward" loop with capture on vs off in one run: the slowdown ratio.

usage: python benchmarks/gpu_staging.py [--out DIR] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hs_capture.config import CaptureConfig  # noqa: E402
from hs_capture.layout import RankId  # noqa: E402
from hs_capture.reader import open_runs  # noqa: E402
from hs_capture.writer import ShardWriter  # noqa: E402

T, H, K = 8192, 7168, 3


def llm_like(t: int, h: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 with the heavy-tailed outlier channels of LLM residual streams."""
    x = torch.randn(t, h, device="cuda", generator=gen)
    scale = torch.ones(h, device="cuda")
    scale[torch.randperm(h, device="cuda", generator=gen)[:16]] = 50.0
    return (x * scale).to(torch.bfloat16)


def make_writer(root: str, threads: int, codec: str = "zstd") -> ShardWriter:
    cfg = CaptureConfig(dump_dir=root, run_id="run-gpu", layers=[2, 30, 58], codec=codec,
                        writer_threads=threads, max_inflight_bytes=4 << 30, fsync=False)
    w = ShardWriter(cfg, RankId(), {"layers": [2, 30, 58], "hidden_size": H}, expected_rows=T)
    w.start()
    sizes = [T * K * H * 2, T * H * 2, T * 8, T * 8]  # what capture.setup_model asks for at model init
    w.prewarm(sizes)
    deadline = time.time() + 30  # at model init there is ample time before the first request
    while w.pinned_pool.pinned_bytes < (4 << 30) // sum(sizes) * sum(sizes) and time.time() < deadline:
        time.sleep(0.1)
    return w


def step_tensors(gen):
    aux = torch.cat([llm_like(T, H, gen) for _ in range(K)], dim=-1)  # packed like sglang 0.5.23
    final = llm_like(T, H, gen)
    ids = torch.randint(0, 100000, (T,), device="cuda", generator=gen)
    pos = torch.arange(T, device="cuda")
    return {"aux": aux, "final": final, "tokens": ids, "positions": pos}


def meta(i):
    return {"mode": "EXTEND", "num_tokens": T, "seqs": [{"rid": f"r{i}", "len": T, "prefix": 0, "offset": 0}]}


def correctness(root: str, steps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = make_writer(root, threads=8)
    expected = []
    submit_us = []
    for i in range(steps):
        t = step_tensors(gen)
        expected.append({k: v.cpu() for k, v in t.items()})  # reference, taken before submit
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.submit(meta(i), t, aux_layers=[2, 30, 58])
        submit_us.append((time.perf_counter() - t0) * 1e6)
        del t  # the forward's tensors die; the allocator may reuse the memory at once...
        junk = [torch.full((T, K * H), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        del junk  # ...and garbage lands there while our copies may still be running
    assert w.close()
    (run,) = open_runs(root)
    bad = 0
    for line in run.index("dp0-tp0-pp0"):
        i = int(line["seqs"][0]["rid"][1:])
        parts = {p: run.read_part(line, p) for p in line["files"]}
        exp = expected[i]
        for j, layer in enumerate([2, 30, 58]):
            got = torch.from_numpy(parts[f"L{layer:02d}"]["hidden"].copy()).to(torch.bfloat16)
            bad += not torch.equal(got, exp["aux"][:, j * H:(j + 1) * H])
        bad += not torch.equal(torch.from_numpy(parts["final"]["hidden"].copy()).to(torch.bfloat16), exp["final"])
        bad += not torch.equal(torch.from_numpy(parts["final"]["input_ids"].copy()), exp["tokens"])
    rest = sorted(submit_us[1:])
    return {"steps": steps, "mismatched_tensors": bad, "submit_us_first_step": round(submit_us[0]),
            "submit_us_median_after_first": round(rest[len(rest) // 2]), "submit_us_max_after_first": round(rest[-1]),
            "pinned_allocs_in_forward": w.pinned_pool.hot_allocs,
            "raw_bytes": w.stats["raw_bytes"], "file_bytes": w.stats["file_bytes"]}


def bandwidth() -> dict:
    src = torch.empty(T, 4 * H, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    side = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 10
    with torch.cuda.stream(side):
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
    side.synchronize()
    peak = n * src.numel() * 2 / (time.perf_counter() - t0) / 1e9
    return {"pinned_peak_GBps": round(peak, 1), "bytes_per_step": src.numel() * 2}


def overlap(root: str, steps: int, matmuls: int) -> dict:
    """A 'forward' of bf16 matmuls producing one prefill step; capture on vs off, same run.
    ~112 matmuls of [8192, 7168] x [7168, 7168] take ~130 ms: about what one H200 of a TP-8
    DeepSeek-V3 spends on an 8192-token prefill (37 B active parameters)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ws = [torch.randn(H, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H ** 0.5 for _ in range(8)]
    marks = {matmuls // 4, matmuls // 2, 3 * matmuls // 4}

    def forward():
        x = a
        outs = []
        for i in range(matmuls):
            x = x @ ws[i % len(ws)]
            if i in marks:
                outs.append(x)
        return {"aux": torch.cat(outs, dim=-1), "final": x,
                "tokens": torch.zeros(T, dtype=torch.int64, device="cuda"), "positions": torch.arange(T, device="cuda")}

    def run(writer):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            t = forward()
            if writer is not None:
                writer.submit(meta(i), t, aux_layers=[2, 30, 58])
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    run(None)  # warm up
    w = make_writer(root, threads=8, codec="raw")  # measure the GPU side, not compression
    run(w)
    off = [run(None) for _ in range(3)]
    on = [run(w) for _ in range(3)]
    t_close = time.perf_counter()
    w.close()
    return {"matmuls": matmuls, "step_ms_off": round(min(off) * 1e3, 2), "step_ms_on": round(min(on) * 1e3, 2),
            "ratio_on_off": round(min(on) / min(off), 4), "writer_drain_s": round(time.perf_counter() - t_close, 1),
            "pinned_allocs_in_forward": w.pinned_pool.hot_allocs, "pinned_GB": round(w.pinned_pool.pinned_bytes / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="hscap-gpu-")
    try:
        res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "shape": f"{K}+1 x [{T}, {H}] bf16"}
        res["correctness"] = correctness(os.path.join(root, "c"), a.steps)
        res["bandwidth"] = bandwidth()
        res["overlap_realistic_step"] = overlap(os.path.join(root, "o"), a.steps, 112)
        res["overlap_short_step"] = overlap(os.path.join(root, "s"), a.steps, 8)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
