"""The bf16/fp16 rule of verify --reference, as pure arithmetic: a token is held to transformers'
own error at that token or at the tail of the state's tokens, and the state's median to
transformers' median. (The real CPU server's dumps against it: tests/test_reference_bf16.py.)"""

import numpy as np

from hs_capture.offline.verify.reference import NOISE_FACTOR, TAIL, _judge_noisy, _limits, _Noisy


def _heavy_tailed(n: int, seed: int) -> np.ndarray:
    """Per-token relative errors around 1% with a long upper tail, like a trained target's in bf16."""
    return 0.01 * np.exp(np.random.default_rng(seed).standard_normal(n) * 0.5)


def test_a_token_in_the_tail_of_the_state_passes_where_its_own_pairing_would_fail():
    noise = _heavy_tailed(1000, 0)
    rel = noise * 0.8  # the server a little better than transformers everywhere...
    row = int(np.argmin(np.abs(noise - np.median(noise))))
    rel[row] = 4.2 * noise[row]  # ...but one token, that transformers happened to round well, in its own tail
    lim = _limits([_Noisy("layer 5", "bfloat16", rel, noise)])[("layer 5", "bfloat16")]
    assert lim.floor == np.quantile(noise, 1 - TAIL) and lim.floor > 4.2 / NOISE_FACTOR * noise[row]
    j = _judge_noisy(_Noisy("layer 5", "bfloat16", rel, noise), lim, {})
    assert j.problem is None and j.ratio[row] < 1
    # the same token far past the tail (another sample's state: ~100% off) fails, named
    rel[row] = 1.0
    j = _judge_noisy(_Noisy("layer 5", "bfloat16", rel, noise), lim, {0: 3, 400: 7})
    assert j.row == row and j.ratio[row] > 5
    assert j.problem.startswith("layer 5: 1 of 1000 tokens") and f"token {row - 400} of the piece captured at step 7" \
        in j.problem and "at the 1%" in j.problem, j.problem


def test_the_floor_and_medians_pool_every_sample_of_a_state_and_keep_dtypes_apart():
    a, b = _heavy_tailed(300, 1), _heavy_tailed(50, 2)
    limits = _limits([_Noisy("layer 2", "bfloat16", a * 0.5, a), _Noisy("layer 2", "bfloat16", b * 2, b),
                      _Noisy("layer 2", "float16", b, b)])
    both = np.concatenate([a, b])
    bf = limits[("layer 2", "bfloat16")]
    assert bf.floor == np.quantile(both, 1 - TAIL)
    assert bf.median_rel == np.median(np.concatenate([a * 0.5, b * 2])) and bf.ref_median_rel == np.median(both)
    assert limits[("layer 2", "float16")].median_vs_ref == 1.0
    # a state whose reference came out exact (tiny noise) is floored at half the dtype's epsilon
    z = np.zeros(10)
    assert _limits([_Noisy("layer 1", "bfloat16", z, z)])[("layer 1", "bfloat16")].floor == 2.0 ** -9
