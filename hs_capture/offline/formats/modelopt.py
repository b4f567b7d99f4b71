"""NVIDIA ModelOpt: {conversation_id}.pt, loadable with weights_only=True: conversation_id,
input_ids, hidden_states (T, H), aux_hidden_states (T, K*H), loss_mask, hidden_states_prenorm."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from hs_capture.offline.formats.base import PerSampleFormat, SampleRef, stored_width
from hs_capture.offline.formats.common import aux_of, check_dtypes, dtype_name, load_torch_dict, sample_file_stem, stem_of, \
    to_numpy
from hs_capture.offline.formats.merged_sample import MergedSample


class ModelOpt(PerSampleFormat):
    name = "modelopt"
    what = "ModelOpt: <id>-<hash>.pt, loadable with weights_only=True"
    pattern = "*.pt"
    served_by = "sglang"

    def file_name(self, rid: str, row: int) -> str:
        return sample_file_stem(rid) + ".pt"

    def identify(self, name: str):
        return stem_of(name, ".pt")

    def record(self, s, loss_mask) -> Dict[str, object]:
        import torch

        return {"conversation_id": s.rid, "input_ids": s.input_ids.clone(), "hidden_states": s.final.clone(),
                "aux_hidden_states": aux_of(s).contiguous(), "loss_mask": loss_mask.to(torch.int64),
                "hidden_states_prenorm": False}

    def load(self, ref: SampleRef, cache: Dict, as_torch: bool = False) -> MergedSample:
        d = load_torch_dict(ref.path)
        check_dtypes(d, {"input_ids": "int64", "loss_mask": "int64"})
        rid = d.get("conversation_id")
        fin = d["hidden_states"]
        stored_width(ref, fin.shape[-1])
        conv = (lambda t: t) if as_torch else to_numpy
        return MergedSample(str(rid) if rid is not None else None, conv(d["input_ids"]), conv(d["loss_mask"]),
                            conv(d["aux_hidden_states"]), conv(fin), None, fin.shape[-1], dtype_name(fin))

    def settings(self, ids: Optional[Sequence[int]], real_mask: bool) -> Dict[str, object]:
        # ModelOpt exports these ids into the drafter's config.json (eagle_config), where SGLang
        # reads them when it serves the drafter; offline training uses only how many there are
        return {"eagle_aux_hidden_state_layer_ids": ids,
                # its loss_mask is read only with answer_only_loss; else every token is trained on
                "answer_only_loss": real_mask}


FORMAT = ModelOpt()
