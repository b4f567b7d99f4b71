"""Training straight from the dump: what DumpDataset delivers through a torch DataLoader, beside
reading `hscap merge --format specforge`'s output of the same dump from the same disk.

The dump is written by the real ShardWriter at the real shapes (benchmarks/merge.py's
synthetic_dump: H = 7168, 3 captured layers + final, bf16, 8192-token steps of mixed sample
lengths that continue across steps, as chunked prefill packs them). For each worker count:
one epoch through DumpDataset(keys="specforge") read in the order of its own sampler, at the
default settings (window 256 MiB, runs of 8 windows), and one epoch over the merged .ckpt
files in a shuffled order (torch.load with mmap, every byte touched, as a trainer's reader
does). Figures per epoch, worker start-up included:
  samples/s and raw GB/s delivered (the bytes of the items' tensors),
  decode amplification = raw bytes the workers decoded / raw bytes delivered,
  peak RSS of the main process and of the largest worker,
  the disk used: the dump alone, against the dump + merge's copy.

usage: python benchmarks/dump_dataset.py [--steps 12] [--workers 2 4 8] [--dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from merge import synthetic_dump  # noqa: E402

from hs_capture import DumpDataset  # noqa: E402


def _hwm() -> int:
    """This process's peak RSS in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def _nbytes(item) -> int:
    return sum(v.numel() * v.element_size() for v in item.values() if isinstance(v, torch.Tensor))


class _Measured(torch.utils.data.Dataset):
    """Each item with what its worker decoded for it, the worker's peak RSS and its id."""

    def __init__(self, ds: DumpDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        before = self.ds.bytes_decoded
        item = self.ds[i]
        info = torch.utils.data.get_worker_info()
        return item, self.ds.bytes_decoded - before, _hwm(), info.id if info else 0


class _Merged(torch.utils.data.Dataset):
    def __init__(self, files) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        d = torch.load(self.files[i], map_location="cpu", mmap=True, weights_only=True)
        item = {k: v.clone() for k, v in d.items()}  # every byte read from the file
        info = torch.utils.data.get_worker_info()
        return item, 0, _hwm(), info.id if info else 0


def _epoch(dataset, workers: int, sampler=None, shuffle: bool = False) -> dict:
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=workers, sampler=sampler,
                                         shuffle=shuffle if sampler is None else False, collate_fn=lambda b: b[0],
                                         prefetch_factor=2 if workers else None,
                                         generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    n = delivered = decoded = 0
    peak = {}
    for item, dec, hwm, wid in loader:  # the items cross to this process, as a trainer's do
        n += 1
        delivered += _nbytes(item)
        decoded += dec
        peak[wid] = max(peak.get(wid, 0), hwm)
    dt = time.perf_counter() - t0
    return {"samples": n, "seconds": round(dt, 2), "samples_per_s": round(n / dt, 1),
            "raw_gb_per_s": round(delivered / dt / 1e9, 3), "raw_gb": round(delivered / 1e9, 2),
            "decode_amplification": round(decoded / delivered, 3) if decoded else None,
            "peak_rss_worker_gb": round(max(peak.values()) / 1e9, 2), "peak_rss_main_gb": round(_hwm() / 1e9, 2)}


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--dir", default=None, help="where the dump and merge's output go (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "dump_dataset.cpu2.results.json"))
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hscap-dsbench-", dir=a.dir)
    try:
        dump, merged = os.path.join(root, "dump"), os.path.join(root, "sf")
        t0 = time.perf_counter()
        whole = synthetic_dump(dump, a.steps)
        written = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hs_capture.cli", "merge", dump, "-o", merged, "--format", "specforge",
                        "-j", str(min(4, os.cpu_count() or 1))], check=True, capture_output=True)
        merge_s = time.perf_counter() - t0
        files = sorted(glob.glob(os.path.join(merged, "*.ckpt")))
        ds = DumpDataset(dump, keys="specforge")
        assert len(ds) == len(files) >= whole, (len(ds), len(files), whole)
        rows = []
        for w in a.workers:
            rows.append({"reader": "DumpDataset (dump)", "workers": w,
                         **_epoch(_Measured(ds), w, sampler=ds.sampler(batch_size=1, num_workers=w, seed=0))})
            print(json.dumps(rows[-1]), flush=True)
            rows.append({"reader": "merged .ckpt files", "workers": w, **_epoch(_Merged(files), w, shuffle=True)})
            print(json.dumps(rows[-1]), flush=True)
        dump_bytes, merged_bytes = _du(dump), _du(merged)
        result = {
            "what": "one epoch through a torch DataLoader: DumpDataset(keys='specforge') with its sampler, beside "
                    "the merged SpecForge .ckpt files of the same dump, shuffled (benchmarks/dump_dataset.py)",
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "shape": {"hidden": 7168, "layers": 3, "final": True, "dtype": "bfloat16", "step_tokens": 8192,
                      "steps": a.steps, "samples": len(ds)},
            "settings": "DumpDataset defaults: window 256 MiB, runs of 8 windows; batch_size 1, prefetch_factor 2",
            "dump_written_s": round(written, 1), "merge_s": round(merge_s, 1),
            "disk": {"dump_gb": round(dump_bytes / 1e9, 2), "merged_specforge_gb": round(merged_bytes / 1e9, 2),
                     "from_dump_gb": round(dump_bytes / 1e9, 2),
                     "with_merge_gb": round((dump_bytes + merged_bytes) / 1e9, 2)},
            "runs": rows}
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({k: result[k] for k in ("disk", "merge_s")}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
