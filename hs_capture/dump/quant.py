"""The compact storage tier (part of the dump contract): a state stored as FP8 e4m3 with one
power-of-two scale per token, `x ~= q * scale[:, None]`.

Why a power of two: dividing by it is exact in bfloat16, so the device quantizes without a
float32 copy of the state; `q * scale` is exactly a bfloat16, so dequantizing gives the same
values on every reader; and a relative error of e4m3 (3 mantissa bits) does not depend on the
scale's mantissa anyway. The scale puts the token's largest |value| in (224, 448], e4m3's top
binade: the rounding error is at most 2^-4 of a value for every |value| >= 64 x scale, 2^-3
below that (those values keep 2 mantissa bits: COARSE_BELOW), and below 2^-6 x scale e4m3's
subnormals are steps of 2^-9 x scale.

Torch is imported by the functions that need it, so the file format stays importable without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence, Tuple

if TYPE_CHECKING:
    import numpy as np
    import torch

SCHEME = "fp8_e4m3"  # what a .hst entry's "quant" names; the run metadata's "store"
STORED_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
SCALE_TENSOR = "hidden_scale"  # a state file's scale, beside its `hidden`
DEQUANT_DTYPE = "bfloat16"  # what readers hand out
FP8_MAX = 448.0
# Values quantized at a time (8192 tokens of a 7168-wide state): bounds the temporaries on the
# device. A step's states that fit in it together are quantized in one pass (`quantize_parts`):
# each pass is ~18 kernel launches, which the forward waits for.
_ELEMS = 8192 * 7168
# Values below this (in units of the scale: 1/3.5 to 1/7 of the token's largest) are rounded to
# 2 mantissa bits instead of 3. They hold little of a token's L2 norm, so its error barely moves
# (benchmarks/README.md, "The compact tier"), while their last mantissa bit, close to noise, is
# what kept e4m3 bytes above 40% of bfloat16 after entropy coding.
COARSE_BELOW = 64.0


def read_dtype(stored: str) -> str:
    """The dtype readers hand out a state stored as `stored` in (what decoding sizes follow)."""
    return DEQUANT_DTYPE if stored == STORED_DTYPE else stored


def quantize(x: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
    """x [T, H] (any float dtype, on any device) -> (q [T, H] float8_e4m3fn, scale [T] float32).
    Runs on x's device and stream. A row that is all zeros gets scale 1; a row holding NaN or
    Inf comes back NaN (verify's non-finite check still sees it)."""
    import torch

    if x.dim() != 2:
        raise ValueError(f"quantize takes [T, H] states, not {tuple(x.shape)}")
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    step = max(1, _ELEMS // max(1, x.shape[1]))
    for a in range(0, x.shape[0], step):
        rows = x[a:a + step]
        amax = torch.linalg.vector_norm(rows, float("inf"), dim=-1, dtype=torch.float32)
        # 2^ceil(log2(amax / 448)): the largest value lands in (224, 448]; `amax - amax` is NaN
        # for a row holding Inf or NaN, whose scale (and so its values) comes back NaN
        s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)) - (amax - amax))
        s = torch.where(amax == 0, 1.0, s)
        scale[a:a + step] = s
        y = rows / s.to(rows.dtype)[:, None]  # exact: a power of two
        # the small values on e5m2's grid (one mantissa bit fewer), which e4m3 holds exactly
        q[a:a + step] = torch.where(y.abs() < COARSE_BELOW, y.to(torch.float8_e5m2).to(y.dtype), y)
    return q, scale


def quantize_parts(parts: Sequence["torch.Tensor"]) -> List[Tuple["torch.Tensor", "torch.Tensor"]]:
    """`quantize` of each [T_i, H] tensor (views and strided column blocks taken as they are),
    in one pass over their rows stacked when they fit in its bound: the same values, and one
    pass's kernel launches for a step's states instead of one pass each."""
    import torch

    if len(parts) > 1 and len({(p.shape[1], p.dtype) for p in parts}) == 1 and sum(p.numel() for p in parts) <= _ELEMS:
        q, scale = quantize(torch.cat(list(parts)))
        out, at = [], 0
        for p in parts:
            out.append((q[at:at + p.shape[0]], scale[at:at + p.shape[0]]))
            at += p.shape[0]
        return out
    return [quantize(p) for p in parts]


def dequantize(q: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """q [T, H] float8_e4m3fn, scale [T] float32 -> [T, H] bfloat16 (exact: see the module)."""
    import torch

    return (q.to(torch.float32) * scale[:, None]).to(torch.bfloat16)


def on_grid(x: "np.ndarray") -> bool:
    """Whether every finite row of x [T, H] (float32 copies of what a reader handed out) is
    exactly a stored FP8 row dequantized, as states read from the compact tier are (quantizing
    gives them back unchanged). A lossless bf16 state is not: most of its values carry more
    than 3 mantissa bits. False when no row is finite and nonzero (nothing to tell by)."""
    import numpy as np
    import torch

    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        return False
    x = x[np.isfinite(x).all(axis=1) & (x != 0).any(axis=1)]
    if not len(x):
        return False
    t = torch.from_numpy(np.ascontiguousarray(x))
    return bool(torch.equal(dequantize(*quantize(t)).float(), t))


def rel_error(x: "np.ndarray") -> "np.ndarray":
    """Per token (row of x [T, H], float32 numpy), the relative L2 error of storing x in this
    scheme and reading it back: what verify allows on top of the server's own rounding."""
    import numpy as np
    import torch

    x = np.ascontiguousarray(x, dtype=np.float32)
    if not x.size:
        return np.zeros(x.shape[:1], np.float32)
    t = torch.from_numpy(x)
    back = dequantize(*quantize(t)).float().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.linalg.norm(back - x, axis=-1) / np.linalg.norm(x, axis=-1)).astype(np.float32)
