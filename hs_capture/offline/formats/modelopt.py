"""NVIDIA ModelOpt: {conversation_id}.pt, loadable with weights_only=True: conversation_id,
input_ids, hidden_states (T, H), aux_hidden_states (T, K*H), loss_mask, hidden_states_prenorm."""

from __future__ import annotations

from hs_capture.dump.files import atomic_file
from hs_capture.offline.formats.common import aux_of, check_dtypes, dtype_name, load_torch_dict, sample_file_stem, stem_of, \
    to_numpy
from hs_capture.offline.formats.merged_sample import MergedSample


def write(path: str, s, loss_mask) -> int:
    import torch

    data = {"conversation_id": s.rid, "input_ids": s.input_ids.clone(), "hidden_states": s.final.clone(),
            "aux_hidden_states": aux_of(s).contiguous(), "loss_mask": loss_mask.to(torch.int64),
            "hidden_states_prenorm": False}
    return atomic_file(path, lambda p: torch.save(data, p))


def load(path: str, key, headers) -> MergedSample:
    d = load_torch_dict(path)
    check_dtypes(d, {"input_ids": "int64", "loss_mask": "int64"})
    rid = d.get("conversation_id")
    fin = d["hidden_states"]
    return MergedSample(str(rid) if rid is not None else None, to_numpy(d["input_ids"]), to_numpy(d["loss_mask"]),
                  to_numpy(d["aux_hidden_states"]), to_numpy(fin), None, fin.shape[-1], dtype_name(fin))


def settings(ids, real_mask: bool) -> dict:
    # ModelOpt exports these ids into the drafter's config.json (eagle_config), where SGLang
    # reads them when it serves the drafter; offline training uses only how many there are
    return {"eagle_aux_hidden_state_layer_ids": ids,
            # its loss_mask is read only with answer_only_loss; else every token is trained on
            "answer_only_loss": real_mask}


def _format():
    from hs_capture.offline.formats import TrainingFormat

    return TrainingFormat("modelopt", "ModelOpt: <id>-<hash>.pt, loadable with weights_only=True",
                          lambda rid, row: sample_file_stem(rid) + ".pt", lambda name: stem_of(name, ".pt"),
                          write, load, served_by="sglang", settings=settings)


FORMAT = _format()
