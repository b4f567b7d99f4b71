"""The bf16/fp16 rule of verify --reference, as arithmetic: each token within 4x transformers'
own error at that token, but a sample's tail (1% of its tokens, at least one) within 4x the
level transformers' own worst 1% reach. Here transformers' states are made-up arrays with a
heavy-tailed bf16 error; the real CPU server's dumps against the rule: test_reference_bf16.py,
and on a trained target, benchmarks/reference_rule.py."""

from typing import Dict, List

import numpy as np
import pytest

from hs_capture.offline.verify.reference import (NOISE_FACTOR, TAIL, Stored, Tolerance, _judge_noisy, _limits,
                                                 _Noisy, compare, tail_allowed)
from hs_capture.offline.verify.report import Report

H = 64


def _heavy_tailed(n: int, seed: int) -> np.ndarray:
    """Per-token relative errors around 1% with a long upper tail, like a trained target's in bf16."""
    return 0.01 * np.exp(np.random.default_rng(seed).standard_normal(n) * 0.5)


def _moved(h: np.ndarray, rel: np.ndarray, seed: int) -> np.ndarray:
    """h with each token moved by rel x its norm, in a random direction."""
    d = np.random.default_rng(seed).standard_normal(h.shape).astype(np.float32)
    return h + d * (rel * np.linalg.norm(h, axis=-1) / np.linalg.norm(d, axis=-1))[:, None]


class Made:
    """transformers' side: float32 states (embeddings, layer 1, layer 2 = final), and its bf16
    states off by a heavy-tailed per-token error."""

    def __init__(self) -> None:
        self.made: Dict[int, tuple] = {}

    def get(self, ids: np.ndarray) -> tuple:
        key = int(ids[0])
        if key not in self.made:
            r = np.random.default_rng(key)
            hs = [r.standard_normal((ids.size, H)).astype(np.float32) for _ in range(3)]
            noise = [_heavy_tailed(ids.size, key * 10 + k) for k in range(3)]
            self.made[key] = (hs, [_moved(h, n, key * 10 + k) for k, (h, n) in enumerate(zip(hs, noise))], noise)
        return self.made[key]

    def states(self, ids, prenorm: bool, dtype: str = "float32"):
        hs, low, _ = self.get(ids)
        return (hs if dtype == "float32" else low), None


def _right(ref: Made, n: int, i: int, **moved_by) -> Stored:
    """A right bf16 capture (off by 0.8x transformers' own error at each token), with layer 1
    moved by `moved_by["layer1"]` instead where given."""
    ids = np.arange(n) + 1000 * (i + 1)
    hs, _, noise = ref.get(ids)
    layer1 = _moved(hs[1], moved_by.get("layer1", 0.8 * noise[1]), 7 + i)
    return Stored(f"s{i}", f"file{i}", ids, {1: layer1}, _moved(hs[2], 0.8 * noise[2], 9 + i), None, "bfloat16",
                  {0: 3, n // 2: 4})


def _compared(ref: Made, samples: List[Stored], tol: Tolerance = Tolerance()) -> Report:
    rep = Report(["x"])
    rep.stats["worst"] = compare(rep, ref, samples, tol)
    return rep


def _findings(ref: Made, samples: List[Stored], tol: Tolerance = Tolerance()) -> List[str]:
    return [f"{f.rid} {f.message}" for f in _compared(ref, samples, tol).findings if f.check == "reference"]


def test_a_token_in_the_tail_passes_where_its_own_pairing_fails_but_not_far_beyond_the_tail():
    noise = _heavy_tailed(1000, 0)
    rel = noise * 0.8  # the server a little better than transformers everywhere...
    row = int(np.argmin(np.abs(noise - np.median(noise))))
    rel[row] = 4.2 * noise[row]  # ...but one token, that transformers happened to round well, in its own tail
    lim = _limits([_Noisy("layer 5", "bfloat16", rel, noise)])[("layer 5", "bfloat16")]
    assert lim.tail > 4.2 / NOISE_FACTOR * noise[row]
    j = _judge_noisy(_Noisy("layer 5", "bfloat16", rel, noise), lim, {})
    assert j.problem is None and j.tail_tokens == 1 and j.pairing[row] > 1 and j.ratio[row] < 1
    rel[row] = 1.0  # another sample's state: ~100% off, far beyond the tail's bound
    j = _judge_noisy(_Noisy("layer 5", "bfloat16", rel, noise), lim, {0: 3, 400: 7})
    assert j.row == row and j.ratio[row] > 5
    assert j.problem.startswith("layer 5: 1 of 1000 tokens") and "even the level" in j.problem
    assert f"token {row - 400} of the piece captured at step 7" in j.problem, j.problem


def test_more_tokens_over_the_pairing_than_the_tail_allows_fail_even_within_the_tails_level():
    noise = _heavy_tailed(1000, 1)
    lim = _limits([_Noisy("layer 2", "bfloat16", noise * 0.8, noise)])[("layer 2", "bfloat16")]
    low = np.argsort(noise)[:tail_allowed(1000) + 1]  # the best-rounded tokens, each pushed just over its pairing
    for k, expect_ok in ((tail_allowed(1000), True), (tail_allowed(1000) + 1, False)):
        rel = noise * 0.8
        rel[low[:k]] = 1.1 * NOISE_FACTOR * np.maximum(noise[low[:k]], np.median(noise))
        j = _judge_noisy(_Noisy("layer 2", "bfloat16", rel, noise), lim, {})
        assert (j.problem is None) == expect_ok and j.tail_tokens == k, (k, j.problem)
        # within the allowance each is held to the tail's bound; past it, to its pairing
        assert (float(j.ratio.max()) < 1) == expect_ok
    assert "11 of 1000 tokens" in j.problem and "where 10 may (the tail)" in j.problem, j.problem
    assert "even the level" not in j.problem  # each within the tail's level: the count is what fails
    assert tail_allowed(1) == tail_allowed(100) == 1 and tail_allowed(101) == 2 and TAIL == 0.01


def test_a_right_capture_passes_and_the_figures_pool_every_sample():
    ref = Made()
    samples = [_right(ref, n, i) for i, n in enumerate([300, 310, 320, 40])]
    rep = _compared(ref, samples)
    assert rep.findings == []
    st = rep.stats["reference_states"]["layer 1"]
    noise = np.concatenate([ref.get(s.input_ids)[2][1] for s in samples])
    assert st["ref_tail_rel"] == pytest.approx(np.quantile(noise, 1 - TAIL), rel=1e-5)
    assert st["ref_median_rel"] == pytest.approx(np.median(noise), rel=1e-5)
    assert 0.7 < st["median_vs_ref"] < 0.9 and st["worst_vs_bound"] < 1 and st["tail_tokens"] == 0


def test_a_dump_of_two_dtypes_gives_each_its_own_figures():
    ref = Made()
    samples = [_right(ref, n, i) for i, n in enumerate([300, 310, 320])]
    samples[2].dtype = "float16"  # a server restarted with another --dtype, into the same dump
    rep = _compared(ref, samples)
    assert rep.findings == [] and rep.stats["reference_dtypes"] == ["bfloat16", "float16"]
    states = rep.stats["reference_states"]
    assert "layer 1" not in states
    for dtype, ss in (("bfloat16", samples[:2]), ("float16", samples[2:])):
        noise = np.concatenate([ref.get(s.input_ids)[2][1] for s in ss])
        st = states[f"layer 1 ({dtype})"]
        assert st["ref_tail_rel"] == pytest.approx(np.quantile(noise, 1 - TAIL), rel=1e-5), dtype
        assert st["ref_max_rel"] == pytest.approx(noise.max(), rel=1e-4), dtype


def test_the_tails_level_is_pooled_over_every_sample_compared():
    narrow = np.full(300, 0.01)  # a sample transformers rounds evenly...
    heavy = _heavy_tailed(1200, 3)  # ...beside others with a long tail
    rel = narrow * 0.8
    rel[10] = 1.5 * NOISE_FACTOR * 0.01  # one token at 1.5x its pairing
    pooled = _limits([_Noisy("layer 1", "bfloat16", rel, narrow), _Noisy("layer 1", "bfloat16", heavy, heavy)])
    alone = _limits([_Noisy("layer 1", "bfloat16", rel, narrow)])
    assert _judge_noisy(_Noisy("layer 1", "bfloat16", rel, narrow), pooled[("layer 1", "bfloat16")], {}).problem is None
    assert _judge_noisy(_Noisy("layer 1", "bfloat16", rel, narrow), alone[("layer 1", "bfloat16")], {}).problem


@pytest.mark.parametrize("what, moved_by_median", [
    ("a whole sample off by 6x transformers' median error, among right ones", 6),
    ("its later piece off by 8x", 8),
    ("one token off by 100%", None),
])
def test_faults_on_part_of_the_tokens_fail_where_they_are(what, moved_by_median):
    ref = Made()
    samples = [_right(ref, n, i) for i, n in enumerate([300, 330, 310, 320])]
    hs, _, noise = ref.get(samples[1].input_ids)
    rel = 0.8 * noise[1]
    if moved_by_median is None:
        rel = rel.copy()
        rel[200] = 1.0
    elif what.startswith("its later piece"):
        rel = np.where(np.arange(330) >= 165, moved_by_median * np.median(noise[1]), rel)
    else:
        rel = np.full(330, moved_by_median * np.median(noise[1]))
    samples[1] = _right(ref, 330, 1, layer1=rel)
    rep = _compared(ref, samples)
    found = [f for f in rep.findings if f.check == "reference"]
    assert found and all((f.rid, f.path) == ("s1", "file1") and f.message.startswith("layer 1:") for f in found), \
        (what, [f.line() for f in found])
    where = {None: "position 200, token 35 of the piece captured at step 4",
             8: "of the piece captured at step 4"}.get(moved_by_median, "position")
    assert where in found[0].message, found[0].message


def test_tokens_in_the_tail_are_counted_over_every_sample():
    ref = Made()
    samples = []
    for i, n in enumerate([300, 310, 320]):
        noise = ref.get(np.arange(n) + 1000 * (i + 1))[2][1]
        rel = 0.8 * noise
        if i < 2:  # one token each, at 1.2x its pairing: in the tail
            k = int(np.argmin(noise))
            rel[k] = 1.2 * NOISE_FACTOR * max(noise[k], np.median(noise))
        samples.append(_right(ref, n, i, layer1=rel))
    rep = _compared(ref, samples)
    assert rep.findings == [] and rep.stats["reference_states"]["layer 1"]["tail_tokens"] == 2


def test_a_state_transformers_cannot_compute_in_bf16_is_said_and_the_rest_judged():
    ref = Made()
    s = _right(ref, 300, 0)
    ref.get(s.input_ids)[1][1][5] = np.nan  # transformers' own bf16 state of token 5
    rep = _compared(ref, [s])
    assert [(f.severity, f.rid) for f in rep.findings] == [("warning", "s0")] and rep.ok
    assert "not finite at 1 of 300 tokens" in rep.findings[0].message
    s.layers[1][7] += 1.0  # a wrong token beside it still fails
    assert any("position 7" in f for f in _findings(ref, [s]))


def test_a_state_of_another_shape_fails_and_counts_as_infinitely_off():
    ref = Made()
    s = _right(ref, 300, 0)
    s.layers[1] = s.layers[1][:, :32]
    rep = _compared(ref, [s])
    assert rep.stats["worst"] == {"s0": float("inf")} and [f.message for f in rep.findings] == \
        ["layer 1: stored [300, 32], reference [300, 64]"]


def test_a_non_finite_value_fails_under_both_rules():
    ref = Made()
    s = _right(ref, 300, 0)
    s.layers[1][17, 3] = np.nan
    assert any("layer 1: 1 of 300 tokens" in f and "position 17" in f for f in _findings(ref, [s])), _findings(ref, [s])
    found = _findings(ref, [s], Tolerance(atol=1.0))
    assert any(f.startswith("s0 layer 1:") and "at 1 values (first at position 17)" in f for f in found), found


def test_the_fixed_bound_judges_values_not_the_noise():
    ref = Made()
    s = _right(ref, 300, 0)
    assert any(f.startswith("s0 layer 1: max |stored - transformers|") for f in _findings(ref, [s], Tolerance(atol=1e-4)))
    assert _findings(ref, [s], Tolerance(atol=10.0)) == []
