"""Verify which samples of a dump are whole, by the one rule send and merge use (planning's
plan, coverage.whole_chain): samples not whole, samples a damaged step breaks, and pieces
captured again beside a whole capture (warnings)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from hs_capture.dump import hst
from hs_capture.offline.read.borrowed import mismatch, read_tokens
from hs_capture.offline.read.coverage import Span, describe_extra
from hs_capture.offline.read.planning import MixedRuns, Plan, plan
from hs_capture.offline.read.reader import DumpError
from hs_capture.offline.verify.index import Step
from hs_capture.offline.verify.report import WARNING, Report


def check_samples(paths: Sequence[str], steps: List[Step], report: Report,
                  lengths: Optional[Dict[str, int]]) -> Optional[Plan]:
    """Returns merge's plan of the samples (None when the runs cannot be planned together)."""
    try:
        p = plan(paths, lengths, strict=False)
    except MixedRuns:
        return None  # reported by the config check; coverage over a mix means nothing
    except DumpError as e:
        report.add("coverage", f"cannot plan the samples: {e}")
        return None
    report.looked("coverage", len(p.samples) + len(p.incomplete))
    for rid, reason in sorted(p.incomplete.items()):
        report.add("coverage", reason, rid=rid)
    damaged = {st.key for st in steps if st.damaged}
    lost = 0
    for rid, pieces in sorted(p.samples.items()):
        bad = [pc for pc in pieces if (os.path.basename(p.runs[pc.run].path), pc.rank, pc.step) in damaged]
        if bad:
            lost += 1
            report.add("coverage", f"step {bad[0].step} of {bad[0].rank} is damaged (see the file findings): "
                                   "merge cannot assemble this sample", rid=rid)
    files: Dict[str, object] = {}
    for rid, borrows in sorted(p.borrows.items()):
        if any((os.path.basename(p.runs[pc.run].path), pc.rank, pc.step) in damaged for pc in p.samples[rid]):
            continue  # counted above
        try:
            why = mismatch(borrows, read_tokens(p, p.samples[rid], max(b.length for b in borrows), files))
        except (OSError, hst.FormatError, KeyError) as e:
            why = f"the token ids of its joined prefix cannot be read: {type(e).__name__}: {e}"
        if why:
            lost += 1
            report.add("coverage", why, rid=rid)
        if len(files) > 4096:
            files.clear()
    for rid, extra in sorted(p.extras.items()):
        for pc in extra[:3]:
            where = f"step {pc.step} of {pc.rank}, {os.path.basename(p.runs[pc.run].path)}"
            report.add("coverage", describe_extra(Span(pc.prefix, pc.prefix + pc.length), where), WARNING, rid=rid)
    report.stats.update(samples_complete=len(p.samples) - lost, samples_incomplete=len(p.incomplete) + lost,
                        samples_left_out=len(p.left_out),
                        tokens=sum(pc.length for pcs in p.samples.values() for pc in pcs))
    return p
