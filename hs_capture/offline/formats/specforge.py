"""SpecForge offline EAGLE-3: one torch.save dict per sample, *.ckpt (globbed recursively):
input_ids (T,), loss_mask (T,) int64, aux_hidden_state (1, T, K*H), hidden_state (1, T, H)
post-norm; read with torch.load(mmap=True)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from hs_capture.dump.hst import TensorInvalidInfo
from hs_capture.offline.formats.base import PerSampleFormat, SampleRef, stored_width
from hs_capture.offline.formats.common import aux_of, check_dtypes, dtype_name, load_torch_dict, sample_file_stem, stem_of, \
    to_numpy
from hs_capture.offline.formats.merged_sample import MergedSample


class SpecForge(PerSampleFormat):
    name = "specforge"
    what = "SpecForge: <id>-<hash>.ckpt, one torch.save dict per sample"
    pattern = "*.ckpt"
    served_by = "sglang"
    # 0.2.0's TargetHead casts the target's lm_head to bf16 whatever model.torch_dtype says,
    # and multiplies the stored final state by it
    state_dtypes = (("bfloat16",), "SpecForge 0.2.0's target head is bfloat16")

    def file_name(self, rid: str, row: int) -> str:
        return sample_file_stem(rid) + ".ckpt"

    def identify(self, name: str):
        return stem_of(name, ".ckpt")

    def record(self, s, loss_mask) -> Dict[str, object]:
        import torch

        return {"input_ids": s.input_ids.clone(), "loss_mask": loss_mask.to(torch.int64),
                "aux_hidden_state": aux_of(s).unsqueeze(0).contiguous(), "hidden_state": s.final.unsqueeze(0).clone()}

    def load(self, ref: SampleRef, cache: Dict, as_torch: bool = False) -> MergedSample:
        d = load_torch_dict(ref.path)
        ids, aux, fin = d["input_ids"], d["aux_hidden_state"], d["hidden_state"]
        if aux.dim() != 3 or aux.shape[0] != 1 or fin.dim() != 3 or fin.shape[0] != 1:
            raise TensorInvalidInfo(f"aux_hidden_state {list(aux.shape)} / hidden_state {list(fin.shape)} "
                                    "are not (1, T, *)")
        check_dtypes(d, {"input_ids": "int64", "loss_mask": "int64"})
        stored_width(ref, fin.shape[-1])
        conv = (lambda t: t) if as_torch else to_numpy
        return MergedSample(None, conv(ids), conv(d["loss_mask"]), conv(aux[0]), conv(fin[0]), None, fin.shape[-1],
                            dtype_name(fin))

    def settings(self, ids: Optional[Sequence[int]], real_mask: bool) -> Dict[str, object]:
        # SGLang serves the drafter on the ids its draft config carries (eagle_config, copied into
        # the exported config.json); the run config's own key names the same layers. The loss mask
        # is read per sample.
        return {"model.aux_hidden_state_layer_ids": ids, "eagle_config.eagle_aux_hidden_state_layer_ids": ids}


FORMAT = SpecForge()
