"""What runs in merge's worker processes (or in merge's own, at -j 1): cut samples out of
the decoded steps and write them. The only part of merge that imports torch; merge.py plans
and hands out work without it (procs.py)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from hs_capture.offline.read.assemble import AssembledSample, Assembler, TokensDiffer, with_loss_mask
from hs_capture.offline.formats import FORMATS, Output
from hs_capture.offline.formats.common import dtype_name
from hs_capture.offline.workers.heap import keep_large_buffers
from hs_capture.offline.read.inputs import Inputs
from hs_capture.offline.merge.merge_result import MergeResult
from hs_capture.offline.read.planning import Plan
from hs_capture.offline.workers import procs
from hs_capture.offline.read.reader import DumpError


def _checked_sample(asm: Assembler, rid: str, ds: Optional[Inputs], res: MergeResult):
    """The assembled sample and its loss mask, or None (recorded in res.incomplete)."""
    try:
        return with_loss_mask(asm, rid, ds)
    except TokensDiffer as e:
        res.incomplete[rid] = str(e)
    except DumpError as e:  # a file gone or corrupt since indexing: this sample only
        res.incomplete[rid] = f"unreadable: {e}"
    return None


# What every task of a worker process shares, set once by init (the plan is large: it is
# sent to each process once, not with every task), and its Assembler, whose cache carries
# over from one task to the next.
_W: Dict[str, object] = {}


def init(p: Plan, out_dir: str, fmt_name: str, ds: Optional[Inputs], cache_bytes: int, jobs: int = 1) -> None:
    keep_large_buffers()
    if jobs > 1:  # N workers each with torch's default (every core) oversubscribe the host N-fold
        torch.set_num_threads(max(1, procs.cores() // jobs))
    _W.update(plan=p, out_dir=out_dir, fmt=fmt_name, ds=ds, asm=Assembler(p, cache_bytes))


def clear() -> None:
    """Drop the plan and the decoded steps (a -j 1 merge runs in the caller's process)."""
    _W.clear()


def _count(res: MergeResult, s: AssembledSample) -> None:
    """A sample written: its tokens, bytes and stored dtype in the result."""
    res.written += 1
    res.tokens += len(s.input_ids)
    res.raw_bytes += s.raw_bytes
    name = dtype_name(s.final)
    if name not in res.dtypes:
        res.dtypes.append(name)


def write(outputs: List[Output]) -> MergeResult:
    """Write planned outputs through the format (a file per sample, or shards of many); an
    output that exists is done (writes are atomic), and counts all its samples as skipped."""
    asm, ds = _W["asm"], _W["ds"]
    f = FORMATS[_W["fmt"]]
    res = MergeResult(f.name)
    read0 = asm.bytes_read
    for out in outputs:
        path = os.path.join(_W["out_dir"], out.path)
        if os.path.exists(path):
            res.skipped_existing += len(out.rows)
            continue
        samples = []
        for row, rid in out.rows:
            got = _checked_sample(asm, rid, ds, res)
            if got is not None:
                samples.append((row, *got))
        if samples:
            res.bytes_out += f.write(path, samples)
            for _row, s, _mask in samples:
                _count(res, s)
    res.bytes_in = asm.bytes_read - read0
    res.worker_peak_rss_bytes = procs.peak_rss_bytes()
    return res
