"""The value checks on their own: the bfloat16 bit-pattern path agrees with the float path."""

import numpy as np
import torch

from hs_capture.offline.verify.values import as_array, identical_pairs, value_problems


def both(t):
    f32 = value_problems(t.float().numpy())
    bits = value_problems(as_array(t.contiguous().view(torch.uint8).numpy().tobytes(), "bfloat16", t.shape), True)
    assert [c for c, _ in bits] == [c for c, _ in f32]
    return bits


def test_clean_states_pass_and_each_fault_is_named():
    x = torch.randn(6, 32).to(torch.bfloat16)
    assert both(x) == []
    y = x.clone()
    y[2, 3], y[4, 1], y[4, 2] = float("nan"), float("inf"), float("-inf")
    (p,) = both(y)
    assert p == ("nonfinite", "1 NaN and 2 Inf values (first in row 2)")
    z = x.clone()
    z[5] = 0
    z[1] = -0.0
    assert both(z) == [("degenerate", "2 of 6 rows are all zeros (first: row 1)")]
    assert both(torch.zeros(3, 4, dtype=torch.bfloat16)) == [("degenerate", "the tensor is all zeros")]
    assert both(torch.full((3, 4), 1.5, dtype=torch.bfloat16)) == [("degenerate", "the tensor is constant")]


def test_identical_pairs_by_bytes():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert identical_pairs({"L01": a, "L03": a.copy(), "final": a + 1}) == [("L01", "L03")]
    assert identical_pairs({"L01": a, "empty": a[:0], "e2": a[:0]}) == []
