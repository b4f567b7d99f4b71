"""A real dump's samples in the one shape verify's reference comparison reads (Stored), and
that comparison's findings: what the tests that plant wrong states into a right dump share."""

from typing import Dict, Iterable, List, Optional

import numpy as np

from hs_capture.offline.read.assemble import Assembler
from hs_capture.offline.read.planning import plan
from hs_capture.offline.verify.reference import Reference, Stored, Tolerance, compare
from hs_capture.offline.verify.report import Report


def stored_samples(dump: str, dtype: str) -> Dict[str, Stored]:
    """Every sample of `dump`, states as float32 copies; `dtype`: what the server stored."""
    p = plan([dump])
    asm = Assembler(p)
    out = {}
    for rid in sorted(p.samples):
        s = asm.sample(rid)
        out[rid] = Stored(rid, None, s.input_ids.numpy(), {k: v.float().numpy() for k, v in s.layers.items()},
                          s.final.float().numpy(), None, dtype, {pc.prefix: pc.step for pc in p.samples[rid]})
    return out


def changed(s: Stored, layers: Optional[Dict[int, np.ndarray]] = None, final: Optional[np.ndarray] = None,
            pieces: bool = False) -> Stored:
    """`s` with some of its states replaced (the planted fault), its arrays copied; `pieces`: keep
    where the dump's pieces start (findings then name a piece's first token)."""
    return Stored(s.rid, None, s.input_ids, {k: v.copy() for k, v in {**s.layers, **(layers or {})}.items()},
                  s.final if final is None else final, None, s.dtype, dict(s.pieces) if pieces else {})


def reference_findings(ref: Reference, samples: Iterable[Stored]) -> List[str]:
    """The reference check's findings on `samples`, with verify's default tolerance."""
    report = Report(["x"])
    compare(report, ref, list(samples), Tolerance())
    return [f.message for f in report.findings if f.check == "reference"]
