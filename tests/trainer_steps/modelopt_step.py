"""Training steps of nvidia-modelopt 0.47.0's own EAGLE-3 model on `hscap merge --format modelopt`
output, on the CPU, with the settings merge wrote (trainer_settings.json): its
load_vlm_or_llm(use_offline_training=True) -> mtsp.convert(eagle, eagle_offline) ->
OfflineSupervisedDataset -> EagleOfflineDataCollator -> forward, backward, AdamW step.
Run by the ModelOpt overlay venv (.venvs/modelopt: its draft needs transformers < 5.19).
Prints one JSON line: the losses of each step on one batch, and how many trainable tensors the
first step changed.

usage: python modelopt_step.py MERGED_DIR TARGET_MODEL_DIR [--steps 3] [--samples 6]
"""

import argparse
import copy
import glob
import json
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("merged")
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=6, help="the batch: the first N samples")
    a = p.parse_args()
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from transformers import AutoConfig

    torch.manual_seed(0)
    settings = json.load(open(os.path.join(a.merged, "trainer_settings.json")))["settings"]
    target = AutoConfig.from_pretrained(a.model)
    model = load_vlm_or_llm(a.model, use_offline_training=True, dtype="auto", device_map="cpu")
    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_offline"] = True
    heads = target.num_attention_heads
    cfg["eagle_architecture_config"].update({  # a draft the size of this tiny target
        "eagle_aux_hidden_state_layer_ids": settings["eagle_aux_hidden_state_layer_ids"],
        "draft_vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
        "intermediate_size": 2 * target.hidden_size, "num_attention_heads": heads, "num_key_value_heads": heads,
        "head_dim": target.hidden_size // heads, "torch_dtype": "float32"})
    mtsp.convert(model, [("eagle", cfg)])
    files = sorted(glob.glob(os.path.join(a.merged, "*.pt")))
    ds = OfflineSupervisedDataset(files, answer_only_loss=settings["answer_only_loss"])
    items = [ds[i] for i in range(min(a.samples, len(ds)))]
    batch = EagleOfflineDataCollator(train_len=max(len(x["input_ids"]) for x in items))(items)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    losses, changed = [], None
    for step in range(a.steps):
        before = [q.detach().clone() for q in params] if step == 0 else None
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if before is not None:
            changed = sum(not torch.equal(b, q.detach()) for b, q in zip(before, params))
    print(json.dumps({"samples": len(ds), "batch": len(items), "trainable": len(params), "changed_by_first_step": changed,
                      "losses": losses}))


if __name__ == "__main__":
    main()
