"""Training steps of nvidia-modelopt 0.47.0's own EAGLE-3 model on the CPU:
load_vlm_or_llm(use_offline_training=True) -> mtsp.convert(eagle, eagle_offline) ->
OfflineSupervisedDataset -> EagleOfflineDataCollator -> forward, backward, AdamW step.
Run by the ModelOpt overlay venv (.venvs/modelopt: its draft needs transformers < 5.19).
Prints one JSON line.

On `hscap merge --format modelopt` output, with the settings merge wrote (trainer_settings.json):
the losses of each step on one batch, and how many trainable tensors the first step changed.

    python modelopt_step.py MERGED_DIR TARGET_MODEL_DIR [--steps 3] [--samples 6]

--from-dump: straight from a dump, no merged file anywhere, through hscap's ModelOpt patch
(hs_capture.offline.train.trainers.modelopt, instrumented): the dataset and collator are ModelOpt's own,
built by the patch's stand-in for the checkout's make_speculative_data_module, and a
transformers Trainer (what ModelOpt's EagleTrainerWithAccLog is) runs --steps optimizer steps on
batches the patched sampler picks: the losses, the trainer's step count, how many trainable tensors
the steps changed, and what the dataset's file list and the Trainer's sampler are. With --same-as
MERGED_DIR it also collates every sample of the dump and of merge's output with ModelOpt's
collator and says whether the batches are equal (--steps 0: only that).

    python modelopt_step.py DUMP_DIR TARGET_MODEL_DIR --from-dump --dataset JSONL --aux-ids 1,2,4
        [--steps 3] [--batch 2] [--workers 1] [--train-len 256] [--same-as MERGED_DIR]
"""

import argparse
import copy
import glob
import json
import os
import tempfile
import types

import torch


def eagle_model(model_dir: str, aux_ids: list):
    """The target loaded for offline training and converted to a draft the size of this tiny target."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(model_dir)
    model = load_vlm_or_llm(model_dir, use_offline_training=True, dtype="auto", device_map="cpu")
    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_offline"] = True
    heads = target.num_attention_heads
    cfg["eagle_architecture_config"].update({
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "draft_vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
        "intermediate_size": 2 * target.hidden_size, "num_attention_heads": heads, "num_key_value_heads": heads,
        "head_dim": target.hidden_size // heads, "torch_dtype": "float32"})
    mtsp.convert(model, [("eagle", cfg)])
    return model


def from_merged(a) -> dict:
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    settings = json.load(open(os.path.join(a.data, "trainer_settings.json")))["settings"]
    model = eagle_model(a.model, settings["eagle_aux_hidden_state_layer_ids"])
    files = sorted(glob.glob(os.path.join(a.data, "*.pt")))
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
    return {"samples": len(ds), "batch": len(items), "trainable": len(params), "changed_by_first_step": changed,
            "losses": losses}


def same(x, y) -> bool:
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y


def same_as_merged(train_dataset, merged: str) -> dict:
    """Every dump sample and its merged file, through ModelOpt's own dataset and collator, padded to the
    longest sample and truncated to half of it."""
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    by_rid = {torch.load(f, weights_only=True)["conversation_id"]: f for f in glob.glob(os.path.join(merged, "*.pt"))}
    rids = train_dataset.dumped_files.dump.rids
    files = OfflineSupervisedDataset([by_rid[r] for r in rids], answer_only_loss=train_dataset.answer_only_loss)
    ours = [train_dataset[i] for i in range(len(train_dataset))]
    theirs = [files[i] for i in range(len(files))]
    longest = max(len(x["input_ids"]) for x in theirs)
    batches = [(EagleOfflineDataCollator(train_len=n)(ours), EagleOfflineDataCollator(train_len=n)(theirs))
               for n in (longest, longest // 2)]
    return {"samples": len(ours), "merged_files": len(by_rid), "items_equal": all(map(same, ours, theirs)),
            "batches_equal": all(same(x, y) for x, y in batches)}


def from_dump(a) -> dict:
    from transformers import Trainer, TrainingArguments

    from hs_capture.offline.train.trainers import modelopt as patch

    inst = patch.ModelOptPatch()
    inst.instrument(a.dataset)
    data_args = types.SimpleNamespace(mode="offline", offline_data_path=a.data, sample_size=-1)
    module = inst.data_module(None, data_args, train_len=a.train_len, answer_only_loss=True)
    ds = module["train_dataset"]
    out = {"samples": len(ds), "dataset": type(ds).__module__ + "." + type(ds).__name__,
           "dumped_files": type(ds.dumped_files).__name__}
    if a.same_as:
        out["same_as_merged"] = same_as_merged(ds, a.same_as)
    if not a.steps:
        return out

    class EagleTrainer(Trainer):
        def compute_loss(self, *args, **kwargs):  # as ModelOpt's EagleTrainerWithAccLog: its forward takes no count
            kwargs.pop("num_items_in_batch", None)
            return super().compute_loss(*args, **kwargs)

    torch.manual_seed(0)
    model = eagle_model(a.model, [int(x) for x in a.aux_ids.split(",")])
    params = {n: q.detach().clone() for n, q in model.named_parameters() if q.requires_grad}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, use_cpu=True, max_steps=a.steps, per_device_train_batch_size=a.batch,
                                 dataloader_num_workers=a.workers, learning_rate=1e-3, lr_scheduler_type="constant",
                                 save_strategy="no", logging_steps=1, report_to="none", remove_unused_columns=False,
                                 dataloader_drop_last=True, disable_tqdm=True, seed=0)
        trainer = EagleTrainer(model=model, args=args, **module)
        sampler = trainer.get_train_dataloader().batch_sampler.sampler
        trainer.train()
    now = dict(model.named_parameters())
    out.update({"sampler": type(sampler).__module__ + "." + type(sampler).__name__,
                "steps": trainer.state.global_step, "trainable": len(params),
                "changed": sum(not torch.equal(b, now[n].detach()) for n, b in params.items()),
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data", help="merge's output dir, or with --from-dump the dump dir")
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=6, help="merged: the batch is the first N samples")
    p.add_argument("--from-dump", action="store_true")
    p.add_argument("--dataset", help="from a dump: the JSONL sent (its loss masks)")
    p.add_argument("--aux-ids", default="1,2,4", help="from a dump: the draft's eagle_aux_hidden_state_layer_ids")
    p.add_argument("--batch", type=int, default=2, help="from a dump: per_device_train_batch_size")
    p.add_argument("--workers", type=int, default=1, help="from a dump: dataloader_num_workers")
    p.add_argument("--train-len", type=int, default=256, help="from a dump: the collator's training_seq_len")
    p.add_argument("--same-as", help="from a dump: merge's output of it, to compare the collated batches with")
    a = p.parse_args()
    torch.manual_seed(0)
    print(json.dumps(from_dump(a) if a.from_dump else from_merged(a)))


if __name__ == "__main__":
    main()
