"""--reference: recompute samples with transformers and compare them with what was stored:
the end-to-end proof that the right layers, positions and tokens were captured.

Layer k of a dump is transformers' hidden_states[k] (the state entering layer k); the final
state is hidden_states[-1] (after the final norm); the pre-norm state is the final norm's input.

The tolerance follows the stored dtype. A float32 dump is held to fixed bounds (--atol,
--rtol; defaults 1e-4 and 0). A bfloat16/float16 dump differs from a float32 forward by its
own rounding, which grows through the layers and with each value's magnitude, so no fixed
number fits every state: each token's state is instead compared with transformers' float32
forward, and its relative error must stay within NOISE_FACTOR times what transformers' own
forward in that dtype, on the same weights and tokens, is off by for that token (floored at
the state's median and at half the dtype's epsilon). Another batch's states, a shifted row or
a wrong layer are off by ~100% of the value; a right capture by ~1-2%, like the reference.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from hs_capture.offline.verify.report import Report

NOISE_FACTOR = 4.0  # a right capture measured at 0.8-1.0x transformers' own bf16 error (H200, sglang 0.5.15)
FLOAT_DTYPES = ("float32", "float64")
_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@dataclass
class Stored:
    """A sample as the dump or the merged output stores it, states as float32 copies by layer:
    the one shape the reference comparison reads, whichever side it came from."""

    rid: str
    path: Optional[str]
    input_ids: np.ndarray
    layers: Dict[int, np.ndarray]
    final: Optional[np.ndarray]
    prenorm: Optional[np.ndarray]
    dtype: str = "float32"  # what the server stored (the arrays above are float32 copies)
    # the dump's pieces: first position -> the step (forward pass) that captured it; a finding
    # at a piece's first token points at the server's chunked-prefill boundary, not the capture
    pieces: Dict[int, int] = field(default_factory=dict)


@dataclass
class Tolerance:
    """Fixed bounds (atol/rtol given, or a float32 dump) or the reference's own noise."""

    atol: Optional[float] = None
    rtol: Optional[float] = None

    def fixed(self, dtype: str) -> Optional[Tuple[float, float]]:
        if self.atol is not None or self.rtol is not None:
            return (self.atol or 0.0, self.rtol or 0.0)
        if dtype in FLOAT_DTYPES or dtype not in _EPS:
            return (1e-4, 0.0)
        return None


@dataclass
class StateStats:
    """Per state (layer, final, pre-norm), worst over the samples compared."""

    max_abs: float = 0.0  # stored vs transformers float32
    max_rel: float = 0.0  # worst token: |stored - fp32| / |fp32| (L2 over the hidden dim)
    ref_max_abs: Optional[float] = None  # transformers in the stored dtype vs float32, same tokens
    ref_max_rel: Optional[float] = None
    vs_ref_max_abs: Optional[float] = None  # stored vs transformers in the stored dtype
    # the margin of the bf16/fp16 rule: a token's error over transformers' own for that token
    # (the median token, of the worst sample: how the server's rounding compares with
    # transformers'), and over its bound (the worst token: 1.0 is the rule's limit)
    median_vs_ref: Optional[float] = None
    worst_vs_bound: Optional[float] = None


class Reference:
    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr stays readable next to --json
        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self._low: Dict[str, object] = {}  # the same weights in a lower dtype, made on first need

    def _model(self, dtype: str):
        if dtype == "float32":
            return self.model
        if dtype not in self._low:
            self._low[dtype] = copy.deepcopy(self.model).to(getattr(self.torch, dtype)).eval()
        return self._low[dtype]

    def states(self, input_ids: np.ndarray, prenorm: bool, dtype: str = "float32"):
        """transformers' hidden states (float32 numpy, whatever `dtype` the forward ran in)."""
        torch = self.torch
        model = self._model(dtype)
        seen = {}
        norm = getattr(getattr(model, "model", model), "norm", None)
        handle = None
        if prenorm and norm is not None:
            handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre", a[0][0].detach().clone()))
        try:
            with torch.no_grad():
                # a copy: merged files are read-only maps, which torch warns about
                ids = torch.as_tensor(np.array(input_ids, dtype=np.int64), device=self.device)[None]
                out = model(ids, output_hidden_states=True)
        finally:
            if handle is not None:
                handle.remove()
        hs = [h[0].float().cpu().numpy() for h in out.hidden_states]
        return hs, (seen["pre"].float().cpu().numpy() if "pre" in seen else None)


def _row_rel(diff: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per token: |diff| / |want| over the hidden dim (L2)."""
    scale = np.linalg.norm(want, axis=-1)
    return np.linalg.norm(diff, axis=-1) / np.maximum(scale, np.finfo(np.float32).tiny)


def _where(row: int, pieces: Dict[int, int]) -> str:
    """A position, and the forward pass it was captured in when the dump says."""
    starts = [p for p in pieces if p <= row]
    if not starts:
        return f"position {row}"
    start = max(starts)
    first = "the first token" if start == row else f"token {row - start}"
    return f"position {row}, {first} of the piece captured at step {pieces[start]}"


@dataclass
class Judged:
    """One state of one sample against the reference."""

    max_abs: float
    problem: Optional[str] = None  # None: the state passes
    ratio: Optional[np.ndarray] = None  # per token, its error over the bf16/fp16 rule's limit
    row: Optional[int] = None  # the first token out of the rule


def _judge(what: str, got: np.ndarray, want: np.ndarray, low: Optional[np.ndarray], dtype: str,
           tol: Tolerance, stats: StateStats, pieces: Optional[Dict[int, int]] = None) -> Judged:
    """How `got` compares with transformers' `want`. Updates the state's stats."""
    diff = got.astype(np.float32) - want
    m = float(np.abs(diff).max()) if diff.size else 0.0
    rel = _row_rel(diff, want) if diff.size else np.zeros(0)
    stats.max_abs = max(stats.max_abs, m)
    stats.max_rel = max(stats.max_rel, float(rel.max()) if rel.size else 0.0)
    fixed = tol.fixed(dtype)
    if low is not None:
        noise_diff = low - want
        noise = _row_rel(noise_diff, want) if diff.size else np.zeros(0)
        stats.ref_max_abs = max(stats.ref_max_abs or 0.0, float(np.abs(noise_diff).max()) if diff.size else 0.0)
        stats.ref_max_rel = max(stats.ref_max_rel or 0.0, float(noise.max()) if noise.size else 0.0)
        stats.vs_ref_max_abs = max(stats.vs_ref_max_abs or 0.0, float(np.abs(got - low).max()) if diff.size else 0.0)
    if fixed is not None:
        atol, rtol = fixed
        bad = np.abs(diff) > atol + rtol * np.abs(want)
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            return Judged(m, f"{what}: max |stored - transformers| = {m:.3g} exceeds atol={atol:g} rtol={rtol:g} "
                             f"at {int(bad.sum())} values (first at position {row})")
        return Judged(m)
    if not rel.size:
        return Judged(m)
    floor = max(float(np.median(noise)), _EPS[dtype] / 2)
    bound = NOISE_FACTOR * np.maximum(noise, floor)
    ratio = rel / bound
    stats.worst_vs_bound = max(stats.worst_vs_bound or 0.0, float(ratio.max()))
    med = float(np.median(rel / np.maximum(noise, _EPS[dtype] / 2)))
    stats.median_vs_ref = med if stats.median_vs_ref is None else max(stats.median_vs_ref, med)
    bad_rows = ratio > 1.0
    if bad_rows.any():
        row = int(np.argmax(bad_rows))
        return Judged(m, f"{what}: {int(bad_rows.sum())} of {rel.size} tokens differ from transformers float32 by "
                         f"more than {NOISE_FACTOR:g}x transformers' own {dtype} error (first at "
                         f"{_where(row, pieces or {})}: {rel[row]:.3g} vs {noise[row]:.3g} relative; the sample's "
                         f"median token is off by {med:.2g}x transformers' own)", ratio, row)
    return Judged(m, None, ratio)


def _through_the_states(row: int, judged: Dict[str, Judged]) -> str:
    """One token's error over the rule's limit at every state compared, in layer order: growing
    through the layers reads as arithmetic parting; one state far off alone, as a capture fault."""
    parts = [f"{what} {j.ratio[row]:.2f}" for what, j in judged.items() if j.ratio is not None and row < j.ratio.size]
    return "; that token, each state's error over the limit: " + ", ".join(parts) if len(parts) > 1 else ""


def compare(report: Report, ref: Reference, samples: Iterable[Stored], tol: Tolerance) -> Dict[str, float]:
    """Each stored sample against the recomputed one; returns rid -> worst max |difference|.
    Per-state figures go to report.stats["reference_states"]."""
    worst: Dict[str, float] = {}
    per_state: Dict[str, StateStats] = {}
    dtypes: List[str] = []
    for s in samples:
        report.looked("reference")
        prenorm = s.prenorm is not None
        hs, pre = ref.states(s.input_ids, prenorm=prenorm)
        low_hs, low_pre = (None, None)
        if s.dtype in _EPS:  # the reference in the stored dtype: its noise (and the per-state figures)
            low_hs, low_pre = ref.states(s.input_ids, prenorm=prenorm, dtype=s.dtype)
        if s.dtype not in dtypes:
            dtypes.append(s.dtype)

        def pick(states, k):
            return None if states is None or not 0 <= k < len(states) else states[k]

        pairs = [(f"layer {k}", got, pick(hs, k), pick(low_hs, k)) for k, got in sorted(s.layers.items())]
        if s.prenorm is not None:  # the final norm's input, before its output: the states in order
            pairs.append(("final (pre-norm)", s.prenorm, pre, low_pre))
        if s.final is not None:
            pairs.append(("final (post-norm)", s.final, hs[-1], None if low_hs is None else low_hs[-1]))
        w = 0.0
        judged: Dict[str, Judged] = {}
        for what, got, want, low in pairs:
            if want is None or got.shape != want.shape:
                report.add("reference", f"{what}: stored {list(got.shape)}, reference "
                                        f"{None if want is None else list(want.shape)}", path=s.path, rid=s.rid)
                w = float("inf")
                continue
            stats = per_state.setdefault(what, StateStats())
            judged[what] = j = _judge(what, got, want, low, s.dtype, tol, stats, s.pieces)
            w = max(w, j.max_abs)
        for j in judged.values():
            if j.problem:
                trail = _through_the_states(j.row, judged) if j.row is not None else ""
                report.add("reference", j.problem + trail, path=s.path, rid=s.rid)
        worst[s.rid] = w
    if worst:
        report.stats["reference_max_abs_diff"] = max(worst.values())
        report.stats["reference_samples"] = len(worst)
        report.stats["reference_dtypes"] = dtypes
        report.stats["reference_states"] = {k: asdict(v) for k, v in per_state.items()}
    return worst
