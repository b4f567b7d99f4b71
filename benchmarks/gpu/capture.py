"""The capture path on a real GPU (no sglang needed: on an offline GPU machine,
`bash benchmarks/gpu/device.sh offline python3 benchmarks/gpu/capture.py`). Steps are
prefill-shaped: 8192 tokens x 7168 bf16 x 4 tensors (SGLang's packed [T, 3H] aux + the final
state) + ids/positions, 470 MB a step.

1. correctness: steps go through ShardWriter.submit and come back from disk bit-exact,
   although the forward frees them and the allocator hands the memory to new tensors
   filled with garbage right after submit (record_stream must hold it).
2. critical-path cost: host microseconds of submit() for one step.
3. device-to-host bandwidth achieved through the Stager vs the measured pinned peak.
4. sustained writer throughput (bytegroup codec, tmpfs, no fsync) by compression threads,
   against the rate the GPU produces states.
5. a matmul "forward" loop with capture on vs off in one run: the slowdown ratio.
6. CUDA graphs: the forward wrapper run under torch.cuda.graph capture neither breaks the
   graph nor records anything; the same wrapper outside a graph captures exactly.

usage: python benchmarks/gpu/capture.py [--out FILE] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hs_capture.server.config import CaptureConfig  # noqa: E402
from hs_capture.dump.paths import RankId  # noqa: E402
from hs_capture.offline.read.reader import open_runs  # noqa: E402
from hs_capture.server.staging import step_buffer_bytes  # noqa: E402
from hs_capture.server.writer import ShardWriter  # noqa: E402
from hs_capture.dump.schema import RankMeta, SeqEntry, step_line

T, H, K = 8192, 7168, 3
STEP_SIZES = [T * K * H * 2, T * H * 2, T * 8, T * 8]  # what capture.setup_model computes at model init


def llm_like(t: int, h: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 with the heavy-tailed outlier channels of LLM residual streams."""
    x = torch.randn(t, h, device="cuda", generator=gen)
    scale = torch.ones(h, device="cuda")
    scale[torch.randperm(h, device="cuda", generator=gen)[:16]] = 50.0
    return (x * scale).to(torch.bfloat16)


def make_writer(root: str, threads: int, codec: str = "bytegroup", level: int = 1,
                inflight: int = 4 << 30) -> ShardWriter:
    cfg = CaptureConfig(dump_dir=root, run_id="run-gpu", layers=[2, 30, 58], codec=codec, level=level,
                        writer_threads=threads, max_inflight_bytes=inflight, fsync=False)
    w = ShardWriter(cfg, RankId(), RankMeta(layers=[2, 30, 58], hidden_size=H), expected_rows=T)
    w.start()
    prewarm_and_wait(w, inflight, 30)
    return w


def prewarm_and_wait(w: ShardWriter, inflight: int, timeout_s: float, sizes: Optional[List[int]] = None) -> None:
    """Pin the pool for full steps (default STEP_SIZES) as capture.setup_model does at model
    init, and wait until the in-flight budget is pinned (there is ample time before the first request)."""
    sizes = STEP_SIZES if sizes is None else sizes
    w.prewarm(sizes)
    deadline = time.time() + timeout_s
    step = w.pinned_pool.rounded(step_buffer_bytes(sizes))  # what prewarm pins: whole steps, one buffer each
    while w.pinned_pool.pinned_bytes < inflight // step * step and time.time() < deadline:
        time.sleep(0.1)


def write_results(res: dict, out) -> None:
    """Print the results and, with --out, keep them in a file."""
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def step_tensors(gen):
    aux = torch.cat([llm_like(T, H, gen) for _ in range(K)], dim=-1)  # packed like sglang 0.5.23
    final = llm_like(T, H, gen)
    ids = torch.randint(0, 100000, (T,), device="cuda", generator=gen)
    pos = torch.arange(T, device="cuda")
    return {"aux": aux, "final": final, "tokens": ids, "positions": pos}


def meta(i):
    return step_line("EXTEND", T, T, "bfloat16", [SeqEntry(f"r{i}", T, 0, 0)])


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
        i = int(line.seqs[0].rid[1:])
        parts = {p: run.read_part(line, p) for p in line.files}
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


def staged_bandwidth(steps: int = 6) -> dict:
    """Device-to-host through our own path: Stager.stage (side stream, pinned pool) until ready."""
    from hs_capture.server.staging import Stager

    gen = torch.Generator(device="cuda").manual_seed(2)
    t = step_tensors(gen)
    nbytes = sum(v.numel() * v.element_size() for v in t.values())
    st = Stager(T, 4 << 30, 2)
    st.pool.prewarm([step_buffer_bytes([v.numel() * v.element_size() for v in t.values()])] * 2)
    best = float("inf")
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        staged = st.stage(t)
        staged.ready()
        best = min(best, time.perf_counter() - t0)
        st.release(staged)
    return {"staged_GBps": round(nbytes / best / 1e9, 1), "bytes_per_step": nbytes}


def writer_threads(root: str, steps: int, threads_list, level: int = 1) -> list:
    """Sustained raw GB/s the writer turns into bytegroup files on tmpfs, by thread count."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    t = step_tensors(gen)
    nbytes = sum(v.numel() * v.element_size() for v in t.values())
    out = []
    for n in threads_list:
        d = os.path.join(root, f"w{n}")
        # a thread writes one step at a time: let the budget hold a step per thread and more
        w = make_writer(d, threads=n, level=level, inflight=max(4 << 30, 2 * n * nbytes))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n_steps = max(steps, 4 * n)  # a thread writes whole steps: give every thread several
        for i in range(n_steps):
            w.submit(meta(i), t, aux_layers=[2, 30, 58])
        assert w.close()
        wall = time.perf_counter() - t0
        out.append({"level": level, "threads": n, "steps": n_steps, "inflight_GB": round(w.cfg.max_inflight_bytes / 1e9, 1), "raw_GBps": round(n_steps * nbytes / wall / 1e9, 2),
                    "ratio": round(w.stats["raw_bytes"] / w.stats["file_bytes"], 3)})
        shutil.rmtree(d, ignore_errors=True)
    return out


def graph_safety(root: str) -> dict:
    """ModelCapture.forward (the wrapper's logic) around a small CUDA 'model' whose forward
    returns (hidden, packed aux) the way SGLang 0.5.23 does; once under torch.cuda.graph
    capture (as a prefill graph would run it), once eagerly."""
    from types import SimpleNamespace

    from hs_capture.server.capture import ModelCapture

    h, rows = 1024, 256
    w = make_writer(os.path.join(root, "g"), threads=2)
    gen = torch.Generator(device="cuda").manual_seed(4)
    weights = [torch.randn(h, h, device="cuda", generator=gen) / h ** 0.5 for _ in range(4)]
    model = SimpleNamespace(layers_to_capture=[])
    class CausalLM:  # weak-referenceable, as the real one is
        capture_aux_hidden_states = True

    parent = CausalLM()
    cap = ModelCapture([1, 2, 3], [], h, w, parent)

    def forward(input_ids, positions, forward_batch):
        x = torch.nn.functional.embedding(input_ids, weights[0])
        aux = []
        for i, wt in enumerate(weights):
            if i in model.layers_to_capture:
                aux.append(x)
            x = torch.tanh(x @ wt)
        return x, (torch.cat(aux, dim=-1) if aux else None)

    ids = torch.randint(0, h, (rows,), device="cuda", generator=gen)
    pos = torch.arange(rows, device="cuda")
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), extend_seq_lens_cpu=[rows],
                         extend_prefix_lens_cpu=[0], rids=["g0"], input_ids=ids, positions=pos)
    steps_before = cap.steps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up as torch.cuda.graph requires
        cap.forward(forward, model, (ids, pos, fb), {})
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    warm_steps = cap.steps
    g = torch.cuda.CUDAGraph()
    error = None
    try:
        with torch.cuda.graph(g):
            static_out = cap.forward(forward, model, (ids, pos, fb), {})
    except Exception as e:  # the graph broke
        error = f"{type(e).__name__}: {e}"
    replay_ok = False
    if error is None:
        g.replay()
        torch.cuda.synchronize()
        eager = forward(ids, pos, fb)[0]
        replay_ok = torch.equal(static_out[0] if isinstance(static_out, tuple) else static_out, eager)
    graph_steps = cap.steps - warm_steps
    assert w.close()
    lines = list(open_runs(os.path.join(root, "g"))[0].index("dp0-tp0-pp0"))
    return {"graph_capture_error": error, "replay_equals_eager": replay_ok,
            "steps_recorded_during_graph_capture": graph_steps, "graph_skips_logged": cap._graph_skips,
            "eager_steps_recorded": warm_steps - steps_before, "index_lines": len(lines),
            "layers_in_graph": "host's only (none)"}


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
    p.add_argument("--only", nargs="*", default=None, help="sections to run (default: all)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="hscap-gpu-")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d"), "shape": f"{K}+1 x [{T}, {H}] bf16"}

    def writer_sweep():
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else root
        tdir = tempfile.mkdtemp(prefix="hscap-gpu-w-", dir=shm)
        try:
            return (writer_threads(tdir, a.steps, [1, 2, 4, 8, 12, 16], level=1)
                    + writer_threads(tdir, a.steps, [1, 8, 16], level=2))
        finally:
            shutil.rmtree(tdir, ignore_errors=True)

    sections = {
        "correctness": lambda: correctness(os.path.join(root, "c"), a.steps),
        "bandwidth": lambda: {**bandwidth(), **staged_bandwidth()},
        "graph_safety": lambda: graph_safety(root),
        "overlap_realistic_step": lambda: overlap(os.path.join(root, "o"), a.steps, 112),
        "writer_threads": writer_sweep,
        "overlap_short_step": lambda: overlap(os.path.join(root, "s"), a.steps, 8),
    }
    try:
        for name, fn in sections.items():
            if a.only is None or name in a.only:
                res[name] = fn()
                print(json.dumps({name: res[name]}), flush=True)  # partial results survive a crash
        if "overlap_realistic_step" in res:
            step_s = res["overlap_realistic_step"]["step_ms_off"] / 1e3
            res["gpu_produces_GBps_per_gpu"] = round((K + 1) * T * H * 2 / step_s / 1e9, 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_results(res, a.out)


if __name__ == "__main__":
    main()
