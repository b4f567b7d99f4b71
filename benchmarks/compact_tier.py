"""The compact tier's bytes and speed on real activations: every state file of a lossless
dump, stored again as the server would store it with `--store fp8` (FP8 e4m3, one scale per
token, then hs_capture's default codec), beside the lossless file and the raw bfloat16 bytes.

Per state (each captured layer, the final state, the pre-norm state) and in all: bytes per
token of raw bfloat16, of the lossless file and of the fp8 file (scale included), and, one
core each, how fast the fp8 bytes are entropy-coded and decoded (MB/s of bfloat16-equivalent
states, what the server produces) and how fast a CPU quantizes (on a GPU the server does it
on the device). The relative error per token of the fp8 states is given too.

Data: a lossless dump given with --dump (a GPU server's, e.g. benchmarks/gpu/purpose.py's
trained target), or, without it, the real CPU SGLang server on the tests' tiny random
DeepSeek-V3 (6 layers, H=256; the CPU server computes in float32), fed random token ids.

usage: python benchmarks/compact_tier.py [--dump DIR] [--files N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from hs_capture.dump import hst, quant  # noqa: E402
from hs_capture.offline.read.reader import open_runs  # noqa: E402

torch.set_num_threads(1)


def cpu_dump(work: str, samples: int) -> str:
    """The real CPU server on the tiny DeepSeek-V3 in bfloat16, capturing layers 2,3,5 and the
    pre-norm state of `samples` random texts of 200-600 tokens."""
    from tests.sglang_cpu.harness import make_tiny_deepseek, serve_and_send, server_env, write_jsonl

    model = make_tiny_deepseek(os.path.join(work, "model"), dtype="bfloat16")
    rng = random.Random(0)
    rows = [{"id": f"s{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(rng.randint(200, 600))]}
            for i in range(samples)]
    data = write_jsonl(os.path.join(work, "data.jsonl"), rows)
    dump = os.path.join(work, "dump")
    serve_and_send(model, server_env(dump, HSCAP_LAYERS="2,3,5", HSCAP_PRENORM="1"), work,
                   ["--chunked-prefill-size", "512", "--disable-radix-cache"], data, len(rows), concurrency=4)
    return dump


def state_files(dump: str) -> List[str]:
    out = []
    for run in open_runs(dump):
        for rank in run.ranks:
            for line in run.index(rank):
                out += [os.path.join(run.path, f.path) for f in (line.files or {}).values()]
    return out


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(path: str) -> Dict[str, object]:
    with hst.opened(path) as (f, header):
        part = header.metadata.get("part", "?")
        e = header.tensors["hidden"]
        if e.scale:
            raise SystemExit(f"{path}: already fp8; give a lossless dump")
        x = hst.to_torch(hst.read_tensor_bytes(f, header, "hidden"), e.dtype, e.shape)
        lossless = e.end - e.begin
    tokens, h = x.shape
    bf16 = tokens * h * 2
    q, s = quant.quantize(x)
    tensors = [hst.RawTensor("hidden", quant.STORED_DTYPE, [tokens, h], memoryview(q.view(torch.uint8).numpy()),
                             scale="hidden_scale"),
               hst.RawTensor("hidden_scale", "float32", [tokens], memoryview(s.numpy()))]
    encode = lambda: hst.encode_file(tensors, {"part": part}, "bytegroup", 1)  # noqa: E731
    blob = b"".join(bytes(c) for c in encode())
    import io

    def decode():
        b = io.BytesIO(blob)
        return hst.read_tensors(b, hst.read_header(b, len(blob)))

    back = decode()["hidden"].float()
    xf = x.float()
    rel = ((back - xf).norm(dim=1) / xf.norm(dim=1)).numpy()
    return {"part": part, "tokens": tokens, "hidden": h, "dtype": e.dtype, "bf16_bytes": bf16,
            "lossless_bytes": lossless, "fp8_bytes": len(blob), "rel_error_median": float(np.median(rel)),
            "rel_error_p99": float(np.quantile(rel, 0.99)),
            "quantize_s": timed(lambda: quant.quantize(x)), "encode_s": timed(encode), "decode_s": timed(decode)}


def summarize(rows: List[dict]) -> dict:
    def agg(rs: List[dict]) -> dict:
        tok = sum(r["tokens"] for r in rs)
        bf16, ll, f8 = (sum(r[k] for r in rs) for k in ("bf16_bytes", "lossless_bytes", "fp8_bytes"))
        mbps = lambda k: round(bf16 / 1e6 / sum(r[k] for r in rs), 1)  # noqa: E731
        return {"files": len(rs), "tokens": tok, "bf16_bytes_per_token": round(bf16 / tok, 1),
                "lossless_bytes_per_token": round(ll / tok, 1), "fp8_bytes_per_token": round(f8 / tok, 1),
                "lossless_over_bf16": round(ll / bf16, 4), "fp8_over_bf16": round(f8 / bf16, 4),
                "fp8_over_lossless": round(f8 / ll, 4),
                "encode_mb_per_s_per_core": mbps("encode_s"), "decode_mb_per_s_per_core": mbps("decode_s"),
                "quantize_cpu_mb_per_s_per_core": mbps("quantize_s"),
                "rel_error_median": round(float(np.median([r["rel_error_median"] for r in rs])), 5),
                "rel_error_p99_worst": round(max(r["rel_error_p99"] for r in rs), 5)}

    parts = sorted({r["part"] for r in rows})
    return {"all": agg(rows), "by_state": {p: agg([r for r in rows if r["part"] == p]) for p in parts}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", help="a lossless dump (default: capture one from the CPU server)")
    p.add_argument("--samples", type=int, default=48, help="texts the CPU server captures (without --dump)")
    p.add_argument("--files", type=int, default=200, help="state files measured at most (spread over the dump)")
    p.add_argument("--label", default="", help="what the data is, for the results")
    p.add_argument("--out", default=os.path.join(HERE, "compact_tier.cpu2.results.json"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        dump = a.dump or cpu_dump(work, a.samples)
        files = state_files(dump)
        step = max(1, len(files) // a.files)
        rows = [measure(f) for f in files[::step][:a.files]]
    res = {"data": a.label or (a.dump and f"the lossless dump {os.path.basename(os.path.normpath(a.dump))}")
           or "the real CPU SGLang server (it computes in float32), tiny random DeepSeek-V3 (H=256), random token ids",
           "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "torch": torch.__version__, "note": __doc__.split("\n\n")[1].replace("\n", " "), **summarize(rows)}
    print(json.dumps(res, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
