"""--reference: recompute samples with transformers and compare them with what was stored:
the end-to-end proof that the right layers, positions and tokens were captured.

Layer k of a dump is transformers' hidden_states[k] (the state entering layer k); the final
state is hidden_states[-1] (after the final norm); the pre-norm state is the final norm's input.

The tolerance follows the stored dtype. A float32 dump is held to fixed bounds (--atol,
--rtol; defaults 1e-4 and 0). A bfloat16/float16 dump differs from a float32 forward by its
own rounding, which grows through the layers and with each value's magnitude, so no fixed
number fits every state. Each token's relative error against transformers' float32 forward
is held to what transformers' own forward in that dtype, on the same weights and tokens, is
off by, in two ways:
- each token within NOISE_FACTOR x transformers' own error at that token, or at the level its
  worst TAIL of tokens reach in that state (over every sample compared; at least half the
  dtype's epsilon). The tail and not the token alone: bf16 error is heavy-tailed, and two bf16
  implementations (transformers', the server's kernels) round differently, so which tokens
  land in the tail differs between them. On a trained target on an H200 transformers' own
  worst token was 12x off its median, and the server's own tail token, paired with a token
  transformers happened to round well, stood at 4.2x that token's error alone.
- the state's median token within NOISE_FACTOR x transformers' own median: a fault that moves
  every token a little (a wrong norm, a coarser dtype) fails here whatever the tail.
Another batch's states, a shifted row or a wrong layer are off by ~100% of the value, tens of
times the tail; a right capture by ~1-2%, like the reference.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from hs_capture.offline.verify.report import Report

NOISE_FACTOR = 4.0  # a right capture's median token measured at 0.73-0.77x transformers' own bf16 error (H200)
TAIL = 0.01  # the floor: transformers' own error at its worst 1% of a state's tokens
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
    # the bf16/fp16 rule (every token of every sample compared in the state): the medians of the
    # stored and of transformers' own error, and their ratio (how the server's rounding compares
    # with transformers'); transformers' own error at its worst TAIL of tokens (the rule's floor);
    # the worst token over its bound (1.0 is the rule's limit)
    median_rel: Optional[float] = None
    ref_median_rel: Optional[float] = None
    median_vs_ref: Optional[float] = None
    ref_tail_rel: Optional[float] = None
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
    """One state of one sample under the bf16/fp16 rule."""

    ratio: np.ndarray  # per token, its error over the rule's limit
    problem: Optional[str] = None  # None: the state passes
    row: Optional[int] = None  # the first token out of the rule


@dataclass
class _Noisy:
    """One state of one sample under the bf16/fp16 rule, kept until every sample is in: the
    rule's floor is the tail of transformers' own error over all the tokens compared."""

    what: str
    dtype: str
    rel: np.ndarray  # per token: |stored - float32| / |float32|
    noise: np.ndarray  # per token: |transformers in the stored dtype - float32| / |float32|


@dataclass
class _Limit:
    """A state's bf16/fp16 rule, from every token compared in it."""

    floor: float  # transformers' own error at its worst TAIL of tokens (at least half an epsilon)
    median_rel: float
    ref_median_rel: float

    @property
    def median_vs_ref(self) -> float:
        return self.median_rel / max(self.ref_median_rel, np.finfo(np.float32).tiny)


def _judge_fixed(what: str, diff: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Optional[str]:
    bad = np.abs(diff) > atol + rtol * np.abs(want)
    if not bad.any():
        return None
    row = int(np.argwhere(bad)[0][0])
    return (f"{what}: max |stored - transformers| = {float(np.abs(diff).max()):.3g} exceeds atol={atol:g} "
            f"rtol={rtol:g} at {int(bad.sum())} values (first at position {row})")


def _measure(what: str, got: np.ndarray, want: np.ndarray, low: Optional[np.ndarray], dtype: str,
             stats: StateStats) -> Tuple[np.ndarray, float, Optional[np.ndarray]]:
    """got - want, its max |.|, and transformers' own per-token error in `dtype` (low given).
    Updates the state's stats."""
    diff = got.astype(np.float32) - want
    m = float(np.abs(diff).max()) if diff.size else 0.0
    stats.max_abs = max(stats.max_abs, m)
    if diff.size:
        stats.max_rel = max(stats.max_rel, float(_row_rel(diff, want).max()))
    noise = None
    if low is not None:
        noise = _row_rel(low - want, want)
        if diff.size:
            stats.ref_max_abs = max(stats.ref_max_abs or 0.0, float(np.abs(low - want).max()))
            stats.ref_max_rel = max(stats.ref_max_rel or 0.0, float(noise.max()))
            stats.vs_ref_max_abs = max(stats.vs_ref_max_abs or 0.0, float(np.abs(got - low).max()))
    return diff, m, noise


def _limits(noisy: Iterable[_Noisy]) -> Dict[Tuple[str, str], _Limit]:
    """Per (state, dtype): the floor and the medians, over every token of every sample compared."""
    pooled: Dict[Tuple[str, str], Tuple[List[np.ndarray], List[np.ndarray]]] = {}
    for n in noisy:
        rels, noises = pooled.setdefault((n.what, n.dtype), ([], []))
        rels.append(n.rel)
        noises.append(n.noise)
    out = {}
    for (what, dtype), (rels, noises) in pooled.items():
        rel, noise = np.concatenate(rels), np.concatenate(noises)
        if not rel.size:
            continue
        out[(what, dtype)] = _Limit(max(float(np.quantile(noise, 1 - TAIL)), _EPS[dtype] / 2),
                                    float(np.median(rel)), float(np.median(noise)))
    return out


def _judge_noisy(n: _Noisy, limit: _Limit, pieces: Dict[int, int]) -> Judged:
    """Each token within NOISE_FACTOR x transformers' own error at that token, or at the tail."""
    ratio = n.rel / (NOISE_FACTOR * np.maximum(n.noise, limit.floor))
    bad = ratio > 1.0
    if not bad.any():
        return Judged(ratio)
    row = int(np.argmax(bad))
    return Judged(ratio, f"{n.what}: {int(bad.sum())} of {n.rel.size} tokens differ from transformers float32 by more "
                       f"than {NOISE_FACTOR:g}x transformers' own {n.dtype} error at that token or at its worst "
                       f"{TAIL:.0%} of tokens (first at {_where(row, pieces)}: {n.rel[row]:.3g} vs {n.noise[row]:.3g} "
                       f"at that token, {limit.floor:.3g} at the {TAIL:.0%})", row)


def _through_the_states(row: int, judged: Dict[str, Judged]) -> str:
    """One token's error over the rule's limit at every state compared, in layer order: growing
    through the layers reads as arithmetic parting; one state far off alone, as a capture fault."""
    parts = [f"{what} {j.ratio[row]:.2f}" for what, j in judged.items() if row < j.ratio.size]
    return "; that token, each state's error over the limit: " + ", ".join(parts) if len(parts) > 1 else ""


def compare(report: Report, ref: Reference, samples: Iterable[Stored], tol: Tolerance) -> Dict[str, float]:
    """Each stored sample against the recomputed one; returns rid -> worst max |difference|.
    Per-state figures go to report.stats["reference_states"].

    Two passes: every sample is recomputed first, as the bf16/fp16 rule's floor is the tail of
    transformers' own error over all the tokens compared in a state, then each is judged."""
    worst: Dict[str, float] = {}
    per_state: Dict[str, StateStats] = {}
    dtypes: List[str] = []
    seen: List[Tuple[Stored, Dict[str, str], List[_Noisy]]] = []  # sample, fixed-rule problems, noisy states
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
        fixed_problems: Dict[str, str] = {}
        noisy: List[_Noisy] = []
        for what, got, want, low in pairs:
            if want is None or got.shape != want.shape:
                report.add("reference", f"{what}: stored {list(got.shape)}, reference "
                                        f"{None if want is None else list(want.shape)}", path=s.path, rid=s.rid)
                w = float("inf")
                continue
            diff, m, noise = _measure(what, got, want, low, s.dtype, per_state.setdefault(what, StateStats()))
            w = max(w, m)
            fixed = tol.fixed(s.dtype)
            if fixed is not None:
                problem = _judge_fixed(what, diff, want, *fixed)
                if problem:
                    fixed_problems[what] = problem
            elif diff.size and noise is not None:
                noisy.append(_Noisy(what, s.dtype, _row_rel(diff, want), noise))
        worst[s.rid] = w
        seen.append((s, fixed_problems, noisy))

    limits = _limits(n for _, _, noisy in seen for n in noisy)
    for (what, dtype), lim in limits.items():
        st = per_state[what]
        st.median_rel, st.ref_median_rel, st.ref_tail_rel = lim.median_rel, lim.ref_median_rel, lim.floor
        st.median_vs_ref = lim.median_vs_ref
        if lim.median_vs_ref > NOISE_FACTOR:  # the bulk moved: a systematic fault, whatever the tail
            report.add("reference", f"{what}: the median token differs from transformers float32 by "
                                    f"{lim.median_vs_ref:.2g}x transformers' own {dtype} median error "
                                    f"({lim.median_rel:.3g} vs {lim.ref_median_rel:.3g} relative, every "
                                    f"sample compared): more than {NOISE_FACTOR:g}x")
    for s, fixed_problems, noisy in seen:
        for what, problem in fixed_problems.items():
            report.add("reference", problem, path=s.path, rid=s.rid)
        judged = {n.what: _judge_noisy(n, limits[(n.what, n.dtype)], s.pieces) for n in noisy}
        for what, j in judged.items():
            st = per_state[what]
            st.worst_vs_bound = max(st.worst_vs_bound or 0.0, float(j.ratio.max()))
            if j.problem:
                trail = _through_the_states(j.row, judged) if j.row is not None else ""
                report.add("reference", j.problem + trail, path=s.path, rid=s.rid)
    if worst:
        report.stats["reference_max_abs_diff"] = max(worst.values())
        report.stats["reference_samples"] = len(worst)
        report.stats["reference_dtypes"] = dtypes
        report.stats["reference_states"] = {k: asdict(v) for k, v in per_state.items()}
    return worst
