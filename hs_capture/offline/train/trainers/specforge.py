"""SpecForge 0.2 (`specforge train --config run.yaml`, EAGLE-3 offline) straight from a dump.

On a machine with NVIDIA GPUs (the target served with `hscap serve -d /data/hs --layers 2,30,58
-- --model-path /models/DeepSeek-V3 --tp 8`, bfloat16 states as SpecForge's target head takes,
the samples sent with `hscap send data.jsonl ... --dump-dir /data/hs`), run.yaml is SpecForge's
own run config with the dump where merge's output would be:

    model:
      target_model_path: /models/DeepSeek-V3
      aux_hidden_state_layer_ids: [1, 29, 57]   # the ids merge prints for 2,30,58 (docs/training.md)
      torch_dtype: bfloat16
    data:
      hidden_states_path: /data/hs              # the dump dir (or one run dir), not merge's output
      cache_dir: /data/sf-cache
    deployment:
      trainer:
        nproc_per_node: 8                       # SpecForge starts the 8 ranks itself (torchrun)
    training:
      batch_size: 1
      num_epochs: 1
    output_dir: /ckpt/sf

    hscap train specforge --dataset data.jsonl -- --config run.yaml
    # several nodes (deployment.trainer.nnodes, master_addr): on node i, add --node-rank i after run.yaml

`--dataset` gives the loss masks (without it every loss_mask is all ones, as merge writes it) and
checks each sample's token ids. Everything after `--` is `specforge train`'s own arguments
("train" may be left out); dotted overrides work as they do there (training.max_steps=100).

How SpecForge 0.2 reads offline data
    `launch.build_offline_runtime` asks the EAGLE-3 provider for an `OfflineManifestReader`, which
    turns `offline_reader.list_feature_files(path)` (every .ckpt under the path, sorted) into
    one `file://` SampleRef per file; `_shard_offline_refs` orders them per epoch as
    DistributedSampler would (`_distributed_sampler_indices`: randperm(seed + epoch), padded,
    every dp_size-th from dp_rank); the Trainer's `FeatureDataLoader` cuts that list into
    batches of training.batch_size (drop_last) and materializes each batch on one of
    data.dataloader_num_workers threads (EAGLE-3's default 4, batch k with batches k+1..k+N-1
    in flight) through `LocalFeatureStore.get` -> `feature_store.load_feature_file(path)`
    (torch.load), then its normalizer (`normalize_offline_sample`: max_length truncation, last
    loss_mask position zeroed) and collator (`DataCollatorWithPadding`). Before that,
    `assembly._ensure_offline_vocab_mapping` counts the loss-bearing token ids of every file
    (list_feature_files, load_feature_file) when the draft vocabulary is smaller than the
    target's, and keys the cached mapping by each file's os.stat.

When a path holds a dump, `instrument()` changes these points and nothing else:
  the listing     `offline_reader.list_feature_files` (and its binding in disagg_ingest, the
                  disaggregated producer) gives one name per whole sample, `<dump>#hscap-sample=<i>`
                  (i: its index in `DumpDataset`), in the order of the names merge gives their files,
                  as SpecForge lists those (so the samples' numbers and the vocab map are the same);
  the load        `load_feature_file` (feature_store's, and the bindings in offline_reader and
                  disagg_ingest) given such a name returns `DumpDataset(keys="specforge")[i]`,
                  exactly what torch.load of merge's .ckpt returns, so SpecForge's own store,
                  normalizer and collator run on it;
  the order       `launch._shard_offline_refs` over such refs takes `_distributed_sampler_indices`
                  from `DumpDataset.sampler` (training.seed, the epoch, SpecForge's own dp rank and
                  size, and the batch size and worker count `launch.build_offline_runtime` was
                  given); loader thread k mod N decodes into its own cache (`_Dump`), as a
                  DataLoader worker would, so each step file is decoded about once per epoch;
  the vocab map   `assembly._ensure_offline_vocab_mapping` counts through the patched listing
                  (token ids and loss masks only, from the dataset when given: no state decoded)
                  and keys the cached mapping by those counts instead of file stats;
  the launch      `launch_plan.build_launch_plan`, for a config whose data is a dump, starts its
                  worker processes (torchrun ranks, the disaggregated producer) through this
                  module (`python -m hs_capture.offline.train.trainers.specforge [--dataset JSONL] train
                  ...`), so they are patched too.

Any other path goes to SpecForge untouched.
"""

from __future__ import annotations

import contextvars
import copy
import importlib
import importlib.metadata
import inspect
import json
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hs_capture.offline.train.trainers.patching import Point, TrainerPatch, worker_main

NAME = "specforge"
SUPPORTED = ("0.2.",)  # releases whose offline data path is OfflineManifestReader + LocalFeatureStore
MARK = "#hscap-sample="  # the listed name of sample i of a dump: <dump>#hscap-sample=<i>

# every place SpecForge 0.2 binds what instrument() wraps, and the method that wraps it
_POINTS = (
    Point("specforge.runtime.data_plane.feature_store", "load_feature_file", "_load"),
    Point("specforge.runtime.data_plane.offline_reader", "load_feature_file", "_load"),
    Point("specforge.runtime.data_plane.offline_reader", "list_feature_files", "_list"),
    Point("specforge.runtime.data_plane.disagg_ingest", "load_feature_file", "_load"),
    Point("specforge.runtime.data_plane.disagg_ingest", "list_feature_files", "_list"),
    Point("specforge.launch", "build_offline_runtime", "_runtime"),
    Point("specforge.launch", "_shard_offline_refs", "_shard"),
    Point("specforge.launch", "_distributed_sampler_indices", "_indices"),
    Point("specforge.training.assembly", "_ensure_offline_vocab_mapping", "_vocab_mapping"),
    Point("specforge.launch_plan", "build_launch_plan", "_launch_plan"),
)


def check() -> Optional[str]:
    try:
        version = importlib.metadata.version("specforge")
        modules = {p.module: importlib.import_module(p.module) for p in _POINTS}
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        return f"SpecForge's training code cannot be imported: {e}"
    if not version.startswith(SUPPORTED):
        return (f"specforge {version} is not supported: the dump patch knows "
                f"{', '.join(v + 'x' for v in SUPPORTED)} (whose offline data is listed by "
                "list_feature_files and loaded by load_feature_file, one file per sample)")
    missing = [f"{m}.{a}" for m, a, _, _ in _POINTS if not callable(getattr(modules[m], a, None))]
    if missing:
        return f"specforge {version}: no {', '.join(missing)} to patch"
    wanted = {"build_offline_runtime": {"hidden_states_path", "batch_size", "dataloader_num_workers"},
              "_distributed_sampler_indices": {"dp_rank", "dp_size", "seed", "epoch", "shuffle"},
              "build_launch_plan": {"worker_prefix", "torchrun_prefix"}}
    for m, a, _, _ in _POINTS:
        lacks = wanted.get(a, set()) - set(inspect.signature(getattr(modules[m], a)).parameters)
        if lacks:
            return f"specforge {version}: {m}.{a} takes no {', '.join(sorted(lacks))}"
    return None


class _Dump:
    """One dump as SpecForge reads it. The FeatureDataLoader materializes batch k on a thread
    while batches k+1..k+N-1 are in flight, so batch k goes to view k mod N, each a DumpDataset
    with its own decode cache, as DataLoader worker k mod N would (what ds.sampler orders for)."""

    def __init__(self, ds: Any, tokens_only: "contextvars.ContextVar[bool]") -> None:
        self.ds = ds
        self.tokens_only = tokens_only  # set while the vocab map is counted: no state decoded
        # listed in the order SpecForge lists merge's files (by name), so its sample numbering
        # and its vocab map (whose ties fall in listing order) are those merge's output gets
        name = [ds.format.file_name(rid, ds.row_of(rid)) for rid in ds.rids]
        self.listing = sorted(range(len(ds)), key=name.__getitem__)
        self.position = {i: j for j, i in enumerate(self.listing)}
        self.batch_size, self.num_workers = 1, 0  # the loader's, from build_offline_runtime
        self.views: List[Any] = [ds]
        self.locks: List[threading.Lock] = [threading.Lock()]
        self.view_of: Dict[int, int] = {}  # sample -> view, for this rank's current epoch

    def order(self, seed: int, epoch: int, shuffle: bool, rank: int, world_size: int) -> List[int]:
        sampler = self.ds.sampler(batch_size=self.batch_size, num_workers=self.num_workers, shuffle=shuffle,
                                  seed=seed, drop_last=False, rank=rank, world_size=world_size)
        sampler.set_epoch(epoch)
        order = sampler.indices()
        n = max(1, self.num_workers)
        while len(self.views) < n:
            self.views.append(copy.copy(self.ds))  # as a DataLoader worker's: the plan, a cache of its own
            self.locks.append(threading.Lock())
        self.view_of = {i: (p // self.batch_size) % n for p, i in enumerate(order)}
        return order

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if self.tokens_only.get() and self.ds.inputs is not None:
            return self.tokens(i)
        v = self.view_of.get(i, 0)
        with self.locks[v]:  # a view's cache is not thread-safe; in order each is used by one thread
            return self.views[v][i]

    def tokens(self, i: int) -> Dict[str, Any]:
        """input_ids and loss_mask of sample i from the dataset (whose ids the dump's must equal)."""
        import torch

        rid = self.ds.rids[i]
        ids, mask = self.ds.inputs.ids[rid], self.ds.inputs.masks[rid]
        return {"input_ids": torch.tensor(ids, dtype=torch.int64),
                "loss_mask": torch.tensor(mask if mask is not None else [1] * len(ids), dtype=torch.int64)}


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


class SpecForgePatch(TrainerPatch):
    """The patch's state, which the wrappers below read: the dumps it opened (once each) and two
    context flags, the dump whose refs SpecForge is sharding now, and whether it is counting
    the vocab map's tokens (token ids only, no state decoded)."""

    NAME = NAME
    POINTS = _POINTS

    def __init__(self) -> None:
        super().__init__()
        self.dumps: Dict[str, _Dump] = {}  # abspath of a dump -> its samples
        self.sharding: "contextvars.ContextVar[Optional[_Dump]]" = contextvars.ContextVar("hscap_sharding",
                                                                                            default=None)
        self.tokens_only: "contextvars.ContextVar[bool]" = contextvars.ContextVar("hscap_tokens_only",
                                                                                   default=False)

    def _uninstrument(self) -> None:
        self.dumps.clear()
        super()._uninstrument()

    def open(self, path: Optional[str]) -> Optional[_Dump]:
        """The dump at `path` (opened once), or None when the path holds no dump."""
        from hs_capture.dump.paths import holds_dump

        if not path or not holds_dump(str(path)):
            return None
        key = os.path.abspath(str(path))
        if key not in self.dumps:
            from hs_capture.offline.train.dump_dataset import DumpDataset
            from hs_capture.offline.read.reader import DumpError

            ds = DumpDataset(key, self.dataset, keys="specforge")
            if not len(ds):
                raise DumpError(f"no whole sample in the dump {path} ({len(ds.incomplete)} incomplete: "
                                "hscap verify names them)")
            self.dumps[key] = _Dump(ds, self.tokens_only)
        return self.dumps[key]

    def sample(self, path: Any) -> Optional[Tuple[_Dump, int]]:
        """(dump, index) for a name _list gave, else None."""
        if not isinstance(path, str):
            return None
        base, mark, index = path.rpartition(MARK)
        if not mark or base not in self.dumps or not index.isdigit():
            return None
        return self.dumps[base], int(index)

    # -------------------------------------------------------------- the wrappers
    def _list(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> List[str]:
        dump = self.open(_arg(args, kwargs, 0, "path"))
        if dump is None:
            return wrapped(*args, **kwargs)
        base = os.path.abspath(str(_arg(args, kwargs, 0, "path")))
        return [f"{base}{MARK}{i}" for i in dump.listing]

    def _load(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        found = self.sample(_arg(args, kwargs, 0, "path"))
        if found is None:
            return wrapped(*args, **kwargs)
        dump, i = found
        return dump[i]

    def _runtime(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        for path in (a["hidden_states_path"], a.get("eval_hidden_states_path")):
            dump = self.open(path)
            if dump is not None:  # the sampler must cut the batches the loader cuts
                dump.batch_size, dump.num_workers = a["batch_size"], a["dataloader_num_workers"]
        return wrapped(*args, **kwargs)

    def _dump_of(self, refs: Sequence[Any]) -> Optional[_Dump]:
        """The dump when refs are exactly its samples as listed (the sampler's order maps onto them)."""
        found = [self.sample(str(getattr(r, "feature_store_uri", ""))[len("file://"):]) for r in refs]
        if not found or found[0] is None:
            return None
        dump = found[0][0]
        if len(refs) != len(dump.ds) or any(f != (dump, i) for f, i in zip(found, dump.listing)):
            return None
        return dump

    def _shard(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        refs = list(_arg(args, kwargs, 0, "refs"))
        rest = {k: v for k, v in kwargs.items() if k != "refs"}
        token = self.sharding.set(self._dump_of(refs))  # SpecForge resolves the dp rank, then asks _indices
        try:
            return wrapped(refs, *args[1:], **rest)
        finally:
            self.sharding.reset(token)

    def _indices(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> List[int]:
        dump = self.sharding.get()
        if dump is None:
            return wrapped(*args, **kwargs)
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        order = dump.order(seed=int(a["seed"]), epoch=int(a["epoch"]), shuffle=bool(a["shuffle"]),
                           rank=int(a["dp_rank"]), world_size=int(a["dp_size"]))
        return [dump.position[i] for i in order]  # the places of those samples among the refs

    def _vocab_mapping(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> None:
        cfg, bundle, algorithm = (_arg(args, kwargs, i, n) for i, n in enumerate(("cfg", "bundle", "algorithm")))
        path = cfg.data.hidden_states_path
        if self.open(path) is None:
            return wrapped(*args, **kwargs)
        from specforge.algorithms.contracts import FeatureMode
        from specforge.training.assembly import _install_dataset_vocab_mapping
        from specforge.training.vocab_mapping import count_effective_feature_tokens

        # the original's own conditions: it would return before counting
        if (FeatureMode.OFFLINE not in algorithm.providers.vocab_mapping_modes or cfg.model.vocab_mapping_path
                or bundle.draft_vocab_size == bundle.target_vocab_size):
            return None
        token = self.tokens_only.set(True)
        try:
            counts = count_effective_feature_tokens(path, max_length=cfg.data.max_length,
                                                    target_vocab_size=bundle.target_vocab_size)
        finally:
            self.tokens_only.reset(token)
        # the original keys its cache by file stats; a dump's samples are no files, and the map is
        # a function of these counts in their order (ties fall in listing order)
        identity = json.dumps({"kind": "hscap-dump-v1", "counts": list(counts.items()),
                               "max_length": cfg.data.max_length})
        _install_dataset_vocab_mapping(cfg, bundle, counts=counts, dataset_identity=identity)
        return None

    def _launch_plan(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        from hs_capture.dump.paths import holds_dump

        data = _arg(args, kwargs, 0, "cfg").data
        if kwargs.get("worker_prefix") or kwargs.get("torchrun_prefix") or not any(
                p and holds_dump(p) for p in (data.hidden_states_path, data.eval_hidden_states_path)):
            return wrapped(*args, **kwargs)
        # the workers run this module, which patches them as instrument() did here; torchrun is
        # told the entry is a program (--no-python), the way SpecForge passes a custom prefix
        prefix = (sys.executable, "-m", __spec__.name, *(("--dataset", self.dataset) if self.dataset else ()))
        kwargs = {**kwargs, "worker_prefix": prefix,
                  "torchrun_prefix": (sys.executable, "-m", "torch.distributed.run", "--no-python")}
        return wrapped(*args, **kwargs)


PATCH = SpecForgePatch


def main(argv: List[str]) -> None:
    from specforge.cli import main as specforge_main

    code = specforge_main(argv if argv[:1] == ["train"] else ["train", *argv])
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    # a SpecForge worker process started by the patched launch plan: [--dataset JSONL] train ...
    worker_main(sys.modules[__name__])
