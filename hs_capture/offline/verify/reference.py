"""--reference: recompute samples with transformers and compare them with what was stored:
the end-to-end proof that the right layers, positions and tokens were captured.

Layer k of a dump is transformers' hidden_states[k] (the state entering layer k); the final
state is hidden_states[-1] (after the final norm); the pre-norm state is the final norm's input.

The tolerance follows the stored dtype. A float32 dump is held to fixed bounds (--atol,
--rtol; defaults 1e-4 and 0). A bfloat16/float16 dump differs from a float32 forward by its
own rounding, which grows through the layers and with each value's magnitude, so no fixed
number fits every state. Each token's relative error against transformers' float32 forward
is held to what transformers' own forward in that dtype, on the same weights and tokens, is
off by:
- each token within NOISE_FACTOR x transformers' own error at that token (floored at the
  sample's median and at half the dtype's epsilon): the pairing;
- except its tail: bf16 error is heavy-tailed, and two bf16 implementations (transformers',
  the server's kernels) round differently, so which tokens land in the tail differs between
  them (transformers against itself with another attention kernel fails the pairing on a
  few tokens: benchmarks/README.md, reference_rule.py). So up to TAIL of a sample's tokens (at
  least one) may instead be within NOISE_FACTOR x the level transformers' own error reaches
  at its worst TAIL of the state's tokens, over every sample compared: the server may have
  as many tail tokens as transformers has, no more and no further out.
Another batch's states, a shifted row or a wrong layer are off by far more than the tail's
bound, on more tokens than the tail; a right capture by about what the reference is (the
margins both ways: benchmarks/README.md, reference_rule.py).

A dump in the compact tier (FP8 e4m3, dump/quant.py; a merged sample whose states are exact
FP8 values, quant.on_grid) holds states the server computed in bfloat16 and then
quantized: each token's bound (the pairing's and the tail's) is the bf16 rule's plus
QUANT_FACTOR x that token's storage error, measured by quantizing transformers' float32 state
itself (quant.rel_error). Both errors are of the token's own values: the server's state
rounds to nearly the same FP8 values as the reference's (margins: tests/test_verify_fp8.py).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from hs_capture.dump import quant
from hs_capture.offline.verify.report import WARNING, Report

# a right capture's typical token is within transformers' own bf16 error (benchmarks/README.md,
# reference_rule.py)
NOISE_FACTOR = 4.0
# the tail a bf16 implementation may put elsewhere than transformers': by definition 1% of
# transformers' own tokens lie beyond its 99th percentile
TAIL = 0.01
# how much of the reference's own FP8 storage error a token may carry: the server quantizes its
# bf16 state, which rounds to the FP8 values of the reference's but near a rounding midpoint
# (measured on tiny Llama and DeepSeek-V3 targets: the stored token's storage error at most 1.24x
# the reference's; a right capture's worst token at 0.50 of its bound, faults at 5.6x and more)
QUANT_FACTOR = 1.5
_STORE = "fp8"  # how messages name the compact tier
FLOAT_DTYPES = ("float32", "float64")
_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# a quantized stored dtype -> what the server computed in (its noise's dtype): quant.py's
# states are bf16 quantized on the device
_COMPUTED = {quant.STORED_DTYPE: quant.DEQUANT_DTYPE}


def computed(dtype: str) -> str:
    """The dtype the server computed a state stored as `dtype` in."""
    return _COMPUTED.get(dtype, dtype)


def quantized(dtype: str) -> bool:
    """Stored in the compact tier (its storage error is allowed on top of the server's)."""
    return dtype in _COMPUTED


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
    # what the server stored (the arrays above are float32 copies): quant.STORED_DTYPE for the
    # compact tier, whose states readers hand out dequantized to bfloat16
    dtype: str = "float32"
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
        if dtype in FLOAT_DTYPES or computed(dtype) not in _EPS:
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
    # the bf16/fp16 rule: the medians of the stored and of transformers' own error over every
    # token compared, and their ratio (how the server's rounding compares with transformers');
    # transformers' own error at its worst TAIL of tokens (the tail's level: its bound is
    # NOISE_FACTOR x this); the tokens over their pairing (the tail, of all compared); the worst
    # token's error over its bound (1.0 is the rule's limit; a token in a sample's tail is held to
    # the tail's bound, every other to its pairing)
    median_rel: Optional[float] = None
    ref_median_rel: Optional[float] = None
    median_vs_ref: Optional[float] = None
    ref_tail_rel: Optional[float] = None
    tail_tokens: Optional[int] = None
    worst_vs_bound: Optional[float] = None
    # the compact tier only: the FP8 storage error of transformers' float32 state, per token
    # (its median and worst over every token compared), and the factor the bound allows of it
    quant_median_rel: Optional[float] = None
    quant_max_rel: Optional[float] = None
    quant_factor: Optional[float] = None


_QUANT_STATS = ("quant_median_rel", "quant_max_rel", "quant_factor")


def _stats_doc(st: StateStats) -> Dict[str, object]:
    """A state's figures for the report: the compact tier's only where it applies."""
    return {k: v for k, v in asdict(st).items() if v is not None or k not in _QUANT_STATS}


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

    def states(self, input_ids: np.ndarray, prenorm: bool,
               dtype: str = "float32") -> Tuple[List[np.ndarray], Optional[np.ndarray]]:
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

    pairing: np.ndarray  # per token, its error over 4x transformers' own at that token (+ the FP8 term)
    ratio: np.ndarray  # per token, over its bound: the pairing's, or for a token over it the tail's
    tail_tokens: int  # tokens over the pairing
    problem: Optional[str] = None  # None: the state passes
    row: Optional[int] = None  # the first token out of the rule


@dataclass
class _Noisy:
    """One state of one sample under the bf16/fp16 rule, kept until every sample is in: the
    tail's level is transformers' own error over all the tokens compared in the state."""

    what: str
    dtype: str
    rel: np.ndarray  # per token: |stored - float32| / |float32|
    noise: np.ndarray  # per token: |transformers in the computed dtype - float32| / |float32|
    quant: Optional[np.ndarray] = None  # the compact tier: per token, quant.rel_error of float32

    def bound(self, own: np.ndarray) -> np.ndarray:
        """Per token: NOISE_FACTOR x `own` (transformers' error, floored), plus in the compact
        tier the FP8 storage error of that token."""
        if self.quant is None:
            return NOISE_FACTOR * own
        return NOISE_FACTOR * own + QUANT_FACTOR * self.quant


@dataclass
class _Limit:
    """A state's figures over every token compared in it."""

    tail: float  # transformers' own error at its worst TAIL of tokens (at least half an epsilon)
    median_rel: float
    ref_median_rel: float  # at least half an epsilon, as the per-token floor
    quant_median_rel: Optional[float] = None  # the compact tier's storage error of float32
    quant_max_rel: Optional[float] = None

    @property
    def median_vs_ref(self) -> float:
        return self.median_rel / self.ref_median_rel


def _judge_fixed(what: str, diff: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Optional[str]:
    """A float32 dump (or --atol/--rtol given): every value within atol + rtol x |value|."""
    bad = ~(np.abs(diff) <= atol + rtol * np.abs(want))  # NaN is out of bounds too
    if not bad.any():
        return None
    row = int(np.argwhere(bad)[0][0])
    return (f"{what}: max |stored - transformers| = {float(np.nanmax(np.abs(diff))):.3g} exceeds atol={atol:g} "
            f"rtol={rtol:g} at {int(bad.sum())} values (first at position {row})")


def _measure(got: np.ndarray, want: np.ndarray, low: Optional[np.ndarray],
             stats: StateStats) -> Tuple[np.ndarray, float, Optional[np.ndarray]]:
    """got - want, its max |.| (inf where a value is not finite), and transformers' own
    per-token error in the stored dtype (low given). Updates the state's stats."""
    diff = got.astype(np.float32) - want
    m = float(np.abs(diff).max()) if diff.size else 0.0
    m = m if np.isfinite(m) else float("inf")
    stats.max_abs = max(stats.max_abs, m)
    if diff.size:
        stats.max_rel = max(stats.max_rel, float(np.nan_to_num(_row_rel(diff, want), nan=np.inf).max()))
    noise = None
    if low is not None:
        noise = _row_rel(low - want, want)
        if diff.size:
            stats.ref_max_abs = max(stats.ref_max_abs or 0.0, float(np.abs(low - want).max()))
            stats.ref_max_rel = max(stats.ref_max_rel or 0.0, float(noise.max()))
            stats.vs_ref_max_abs = max(stats.vs_ref_max_abs or 0.0, float(np.abs(got - low).max()))
    return diff, m, noise


def _limits(noisy: Iterable[_Noisy]) -> Dict[Tuple[str, str], _Limit]:
    """Per (state, dtype): the tail's level and the medians, over every token of every sample."""
    pooled: Dict[Tuple[str, str], Tuple[List[np.ndarray], List[np.ndarray], List[np.ndarray]]] = {}
    for n in noisy:
        rels, noises, quants = pooled.setdefault((n.what, n.dtype), ([], [], []))
        rels.append(n.rel)
        noises.append(n.noise)
        if n.quant is not None:
            quants.append(n.quant)
    out = {}
    for (what, dtype), (rels, noises, quants) in pooled.items():
        rel, noise = np.concatenate(rels), np.concatenate(noises)
        noise = noise[np.isfinite(noise)]  # tokens transformers' own forward lost are not judged (compare)
        if rel.size:
            half_eps = _EPS[computed(dtype)] / 2
            tail, med = (float(np.quantile(noise, 1 - TAIL)), float(np.median(noise))) if noise.size else (0.0, 0.0)
            lim = _Limit(max(tail, half_eps), float(np.median(np.nan_to_num(rel, nan=np.inf))), max(med, half_eps))
            if quants:
                q = np.concatenate(quants)
                lim.quant_median_rel, lim.quant_max_rel = float(np.median(q)), float(q.max())
            out[(what, dtype)] = lim
    return out


def tail_allowed(tokens: int) -> int:
    """How many of a sample's tokens may be over the pairing (within the tail's bound)."""
    return max(1, int(np.ceil(TAIL * tokens)))


def _judge_noisy(n: _Noisy, limit: _Limit, pieces: Dict[int, int]) -> Judged:
    """Each token within the pairing, but up to tail_allowed of them within the tail's bound.
    A token whose reference in the stored dtype is not finite is not judged (compare says so)."""
    known = np.isfinite(n.noise)
    med = float(np.median(n.noise[known])) if known.any() else 0.0
    own = np.maximum(np.where(known, n.noise, np.inf), max(med, _EPS[computed(n.dtype)] / 2))
    pairing = n.rel / n.bound(own)
    tail = n.rel / n.bound(np.maximum(own, limit.tail))
    over = ~(pairing <= 1.0)  # NaN is over
    beyond = ~(tail <= 1.0)
    count, allowed = int(over.sum()), tail_allowed(n.rel.size)
    # each token over its bound: the tail's where the tail takes it, else the pairing's
    ratio = np.where(over, tail, pairing) if count <= allowed else pairing
    if not beyond.any() and count <= allowed:
        return Judged(pairing, ratio, count)
    row = int(np.argmax(beyond)) if beyond.any() else int(np.argmax(over))
    dtype = computed(n.dtype)
    plus = "" if n.quant is None else f" plus the {_STORE} storage error at that token"
    why = (f"{int(beyond.sum())} of {n.rel.size} tokens differ from transformers float32 by more than "
           f"{NOISE_FACTOR:g}x even the level transformers' own {dtype} error reaches at its worst {TAIL:.0%} "
           f"of tokens{plus}" if beyond.any() else
           f"{count} of {n.rel.size} tokens differ from transformers float32 by more than {NOISE_FACTOR:g}x "
           f"transformers' own {dtype} error{plus or ' at that token'}, where {allowed} may (the tail)")
    store = "" if n.quant is None else f", {_STORE} storage {n.quant[row]:.3g} x{QUANT_FACTOR:g}"
    return Judged(pairing, ratio, count,
                  f"{n.what}: {why} (first at {_where(row, pieces)}: {n.rel[row]:.3g} vs {n.noise[row]:.3g} at that "
                  f"token, {limit.tail:.3g} at the worst {TAIL:.0%}{store})", row)


def _through_the_states(row: int, judged: Dict[str, Judged], stored: bool = False) -> str:
    """One token's error over 4x transformers' own at that token (`stored`: plus its FP8
    storage error), at every state compared, in layer order: growing through the layers reads
    as arithmetic parting; one state far off alone, as a capture fault."""
    parts = [f"{what} {j.pairing[row]:.2f}" for what, j in judged.items() if row < j.pairing.size]
    over = f"transformers' own x4 plus the {_STORE} storage error" if stored else "transformers' own x4"
    return f"; that token, each state's error over {over}: " + ", ".join(parts) if len(parts) > 1 else ""


def _storage_error(want: np.ndarray) -> np.ndarray:
    """Per token, the FP8 storage error of transformers' float32 state (a zero token has none)."""
    return np.nan_to_num(quant.rel_error(want), nan=0.0)


def compare(report: Report, ref: Reference, samples: Iterable[Stored], tol: Tolerance) -> Dict[str, float]:
    """Each stored sample against the recomputed one; returns rid -> worst max |difference|.
    Per-state figures go to report.stats["reference_states"].

    Two passes: every sample is recomputed first, as the bf16/fp16 tail's level is transformers'
    own error over all the tokens compared in a state, then each is judged."""
    worst: Dict[str, float] = {}
    per_state: Dict[Tuple[str, str], StateStats] = {}  # (state, stored dtype): judged apart
    dtypes: List[str] = []
    # per sample, what judging it needs: where it is, its fixed-rule problems, its noisy states
    seen: List[Tuple[Optional[str], str, Dict[int, int], List[str], List[_Noisy]]] = []
    for s in samples:
        report.looked("reference")
        prenorm = s.prenorm is not None
        hs, pre = ref.states(s.input_ids, prenorm=prenorm)
        low_hs, low_pre = (None, None)
        if computed(s.dtype) in _EPS:  # the reference in the dtype computed in: its noise (and the figures)
            low_hs, low_pre = ref.states(s.input_ids, prenorm=prenorm, dtype=computed(s.dtype))
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
        fixed_problems: List[str] = []
        noisy: List[_Noisy] = []
        fixed = tol.fixed(s.dtype)
        for what, got, want, low in pairs:
            if want is None or got.shape != want.shape:
                report.add("reference", f"{what}: stored {list(got.shape)}, reference "
                                        f"{None if want is None else list(want.shape)}", path=s.path, rid=s.rid)
                w = float("inf")
                continue
            diff, m, noise = _measure(got, want, low, per_state.setdefault((what, s.dtype), StateStats()))
            w = max(w, m)
            if fixed is not None:
                problem = _judge_fixed(what, diff, want, *fixed)
                if problem:
                    fixed_problems.append(problem)
            elif diff.size:  # a noisy dtype always has its reference in that dtype (above)
                noisy.append(_Noisy(what, s.dtype, _row_rel(diff, want), noise,
                                    _storage_error(want) if quantized(s.dtype) else None))
        worst[s.rid] = w
        seen.append((s.path, s.rid, s.pieces, fixed_problems, noisy))  # not the states: one sample's in memory

    limits = _limits(n for *_, noisy in seen for n in noisy)
    for key, lim in limits.items():
        st = per_state[key]
        st.median_rel, st.ref_median_rel, st.ref_tail_rel = lim.median_rel, lim.ref_median_rel, lim.tail
        st.median_vs_ref = lim.median_vs_ref
        if lim.quant_median_rel is not None:
            st.quant_median_rel, st.quant_max_rel = lim.quant_median_rel, lim.quant_max_rel
            st.quant_factor = QUANT_FACTOR
    for path, rid, pieces, fixed_problems, noisy in seen:
        for problem in fixed_problems:
            report.add("reference", problem, path=path, rid=rid)
        judged = {n.what: _judge_noisy(n, limits[(n.what, n.dtype)], pieces) for n in noisy}
        for n in noisy:
            lost = int((~np.isfinite(n.noise)).sum())
            if lost:  # the reference's own failure, not the capture's: said, not held against it
                report.add("reference", f"{n.what}: transformers' own {computed(n.dtype)} forward is not finite at "
                                        f"{lost} of {n.noise.size} tokens: those are not judged", WARNING,
                           path=path, rid=rid)
            j, st = judged[n.what], per_state[(n.what, n.dtype)]
            st.worst_vs_bound = max(st.worst_vs_bound or 0.0, float(np.nan_to_num(j.ratio, nan=np.inf).max()))
            st.tail_tokens = (st.tail_tokens or 0) + j.tail_tokens
            if j.problem:
                report.add("reference", j.problem + _through_the_states(j.row, judged, n.quant is not None),
                           path=path, rid=rid)
    if worst:
        report.stats["reference_max_abs_diff"] = max(worst.values())
        report.stats["reference_samples"] = len(worst)
        report.stats["reference_dtypes"] = dtypes
        # a state's name alone, unless the dump holds samples of more than one dtype
        report.stats["reference_states"] = {(what if len(dtypes) == 1 else f"{what} ({dtype})"): _stats_doc(v)
                                            for (what, dtype), v in per_state.items()}
    return worst
