"""--reference: recompute samples with transformers (float32, CPU) and compare them with what
was stored: the end-to-end proof that the right layers, positions and tokens were captured.

Layer k of a dump is transformers' hidden_states[k] (the state entering layer k); the final
state is hidden_states[-1] (after the final norm); the pre-norm state is the final norm's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional

import numpy as np

from .report import Report


@dataclass
class Stored:
    rid: str
    path: Optional[str]
    input_ids: np.ndarray
    layers: Dict[int, np.ndarray]
    final: Optional[np.ndarray]
    prenorm: Optional[np.ndarray]


class Reference:
    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr stays readable next to --json
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_layers = int(self.model.config.num_hidden_layers)

    def states(self, input_ids: np.ndarray, prenorm: bool):
        torch = self.torch
        seen = {}
        norm = getattr(getattr(self.model, "model", self.model), "norm", None)
        handle = None
        if prenorm and norm is not None:
            handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre", a[0][0].detach().clone()))
        try:
            with torch.no_grad():
                out = self.model(torch.as_tensor(input_ids, dtype=torch.long)[None], output_hidden_states=True)
        finally:
            if handle is not None:
                handle.remove()
        hs = [h[0].numpy() for h in out.hidden_states]
        return hs, (seen["pre"].numpy() if "pre" in seen else None)


def compare(report: Report, ref: Reference, samples: Iterable[Stored], atol: float, rtol: float) -> Dict[str, float]:
    """Each stored sample against the recomputed one; returns rid -> worst max |difference|."""
    worst: Dict[str, float] = {}
    for s in samples:
        report.looked("reference")
        hs, pre = ref.states(s.input_ids, prenorm=s.prenorm is not None)
        pairs = [(f"layer {k}", got, hs[k] if 0 <= k < len(hs) else None) for k, got in sorted(s.layers.items())]
        if s.final is not None:
            pairs.append(("final (post-norm)", s.final, hs[-1]))
        if s.prenorm is not None:
            pairs.append(("final (pre-norm)", s.prenorm, pre))
        w = 0.0
        for what, got, want in pairs:
            if want is None or got.shape != want.shape:
                report.add("reference", f"{what}: stored {list(got.shape)}, reference "
                                        f"{None if want is None else list(want.shape)}", path=s.path, rid=s.rid)
                w = float("inf")
                continue
            diff = np.abs(got.astype(np.float32) - want)
            m = float(diff.max()) if diff.size else 0.0
            w = max(w, m)
            bad = diff > atol + rtol * np.abs(want)
            if bad.any():
                row = int(np.argwhere(bad)[0][0])
                report.add("reference", f"{what}: max |stored - transformers| = {m:.3g} exceeds atol={atol:g} "
                                        f"rtol={rtol:g} at {int(bad.sum())} values (first at position {row})",
                           path=s.path, rid=s.rid)
        worst[s.rid] = w
    if worst:
        report.stats["reference_max_abs_diff"] = max(worst.values())
        report.stats["reference_samples"] = len(worst)
    return worst
