"""vLLM speculators 0.9 (`speculators train`) straight from a dump.

Pointing it at a dump
    `--data-path DATA` stays speculators' own prepared dataset (`speculators prepare-data`: token
    ids, loss masks, lengths, token frequencies); the dump stands where speculators looks for its
    hidden-state files: `--hidden-states-path DUMP` (its file backend's own flag), or a dump at
    DATA/hidden_states itself. Row k of DATA is the sample with id "k" (what `hscap send DATA`
    sends); when the samples were sent from a JSONL instead, `hscap train --dataset JSONL` names
    it, its lines in DATA's row order.

Training from a dump on a machine with NVIDIA GPUs (speculators trains on the pre-norm final
state, so capture with --prenorm; vLLM serves the drafter, so the ids are the captured layers):

    speculators prepare-data --model /models/target --data raw.jsonl --output /data/sp
    hscap serve -d /data/hs --layers 2,30,58 --prenorm -- --model-path /models/target --port 30000 &
    hscap send /data/sp --url http://127.0.0.1:30000 -c 64      # row k as id "k"
    kill %1; wait                                               # SIGTERM: the run is flushed and closed
    hscap train speculators -- --verifier-name-or-path /models/target --data-path /data/sp \
        --hidden-states-path /data/hs --target-layer-ids 2 30 58 --save-path /ckpt/sp
    # one process per GPU, as `torchrun -m speculators.train` would run it:
    torchrun --nproc_per_node 8 -m hs_capture.cli train speculators -- <the same arguments>

How speculators 0.9 reads offline data
    `create_train_val_loaders` builds two `ArrowDataset`s over DATA (train and val split); each
    item's states come from `self.transfer.get_cached(row)`, which for the file backend is
    `safetensors.load_file(HS_DIR/hs_<row>.safetensors)`; `_get_raw_data` checks the token ids
    against DATA's and splits off the pre-norm state, `shift_batch` and `CollateFn` pack a batch.
    `_setup_dataloader` hands `DataLoader(spawn workers)` a `MultipackDistributedBatchSamplerV2`
    whose `_generate_batches(epoch)` shuffles every index (seed + epoch) and packs them into
    batches of at most --total-seq-len tokens per data-parallel rank.

`instrument()` changes two points and nothing else:
  the files     after `ArrowDataset.__init__`, a file transfer whose directory holds a dump is
                replaced by a `DumpTransfer`: `get_cached(row)` returns
                `DumpDataset(keys="speculators")` of that row, exactly what load_file of merge's
                hs_<row>.safetensors returns, so speculators' own per-item code, token-id check,
                shift and collator run on it (it pickles into the spawned workers as it is);
  the sampler   `speculators.train.dataloader.DataLoader`, given such a dataset, gets its multipack
                sampler with `_generate_batches` replaced by `_DumpBatches`: the same token budget,
                seed, data-parallel rank and max_batches, the indices packed in `DumpDataset.sampler`'s
                order for that rank and each DataLoader worker given a contiguous run of the
                batches, so each step file is decoded about once.

Any other path or dataset goes to speculators untouched.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hs_capture.offline.train.step_sampler import deal
from hs_capture.offline.train.trainers.patching import Point, TrainerPatch, Unsupported

NAME = "speculators"
SUPPORTED = ("0.9.",)  # releases whose ArrowDataset reads states through transfer.get_cached(row)

log = logging.getLogger(__name__)


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("speculators")


def check() -> Optional[str]:
    try:
        version = _version()
        from hs_connectors.transfer import FileTransfer
        from speculators.train import dataloader
        from speculators.train.data import ArrowDataset
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    except ImportError as e:
        return f"speculators' training code cannot be imported: {e}"
    if not version.startswith(SUPPORTED):
        return (f"speculators {version} is not supported: the dump patch knows "
                f"{', '.join(v + 'x' for v in SUPPORTED)} (whose ArrowDataset reads each row's states "
                "through its transfer's get_cached)")
    if "transfer" not in inspect.signature(ArrowDataset.__init__).parameters:
        return f"speculators {version}: ArrowDataset takes no hidden-states transfer"
    if "hidden_states_path" not in inspect.signature(FileTransfer.__init__).parameters:
        return f"speculators {version}: the file transfer has no hidden_states_path"
    if not callable(getattr(dataloader, "DataLoader", None)):
        return f"speculators {version}: speculators.train.dataloader builds no DataLoader"
    if not callable(getattr(MultipackDistributedBatchSamplerV2, "_generate_batches", None)):
        return f"speculators {version}: its batch sampler has no _generate_batches to reorder"
    return None


class DumpTransfer:
    """speculators' hidden-states transfer over a dump: `get_cached(row)` is what load_file of
    merge's hs_<row>.safetensors returns, None for a row the dump does not hold whole (then
    speculators' own --on-missing applies). A plain class, so spawned workers unpickle it."""

    def __init__(self, files: Any, dump: Any) -> None:
        self.files = files  # the file transfer it stands for: on-demand generation still goes there
        self.dump = dump
        self.row_at = [dump.row_of(rid) for rid in dump.rids]  # DumpDataset index -> DATA row
        self.index_of = {row: i for i, row in enumerate(self.row_at)}

    def setup(self) -> None:
        self.files.setup()

    def get_cached(self, file_idx: int) -> Optional[Dict[str, Any]]:
        i = self.index_of.get(file_idx)
        return None if i is None else self.dump[i]

    def get_generated(self, hs_transfer_params: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        return self.files.get_generated(hs_transfer_params)

    def delete(self, handle: str) -> None:
        self.files.delete(handle)


def _pack(indices: Sequence[int], lengths: Any, budget: int) -> List[List[int]]:
    """Consecutive indices into batches of at most `budget` tokens (lengths already clipped to it)."""
    batches: List[List[int]] = []
    fill = budget + 1  # no batch open yet
    for i in indices:
        if fill + lengths[i] > budget:
            batches.append([])
            fill = 0
        batches[-1].append(i)
        fill += lengths[i]
    return batches


class _DumpBatches:
    """A multipack sampler's `_generate_batches` for an ArrowDataset read from a dump. Each
    data-parallel rank takes its `DumpDataset.sampler` share (windows of steps, shuffled by seed
    and epoch), keeps this split's rows, packs them in that order into batches of at most the
    token budget, and deals each DataLoader worker a contiguous run of them: a window's step
    files are decoded by one worker. Every rank is cut to the fewest batches any rank has, as
    each step is a collective."""

    # what of the multipack sampler's own state this reads or sets (private: checked at first use)
    NEEDS = ("seed", "num_replicas", "rank", "lengths", "batch_max_length", "max_batches", "valid_indices",
             "_cached_generated_batches")

    def __init__(self, sampler: Any, dataset: Any, num_workers: int) -> None:
        missing = [a for a in self.NEEDS if not hasattr(sampler, a)]
        if missing:
            raise Unsupported(f"speculators {_version()}: its batch sampler has no {', '.join(missing)}: "
                              "the dump patch cannot order it")
        self.sampler, self.workers = sampler, max(1, num_workers)
        self.transfer = dataset.transfer
        self.start, self.n = dataset.start_file_idx, len(dataset)
        self.valid = set(sampler.valid_indices.tolist())

    def _rank_batches(self, epoch: int, rank: int) -> List[List[int]]:
        s = self.sampler
        share = self.transfer.dump.sampler(shuffle=True, seed=s.seed, drop_last=True, rank=rank,
                                           world_size=s.num_replicas)
        share.set_epoch(epoch)
        items = [self.transfer.row_at[i] - self.start for i in share]
        items = [a for a in items if 0 <= a < self.n and a in self.valid]  # this split's rows
        return _pack(items, s.lengths, s.batch_max_length)

    def __call__(self, epoch: int) -> List[Any]:
        import numpy as np

        s = self.sampler
        if s._cached_generated_batches[0] == epoch:  # the cache its mid-epoch resume slices
            return s._cached_generated_batches[1]
        per_rank = [self._rank_batches(epoch, r) for r in range(s.num_replicas)]
        batches = per_rank[s.rank][:min(map(len, per_rank))]
        if s.max_batches is not None:
            batches = batches[:s.max_batches]
        batches = [np.array(b) for b in deal(batches, self.workers)]
        s._cached_generated_batches = (epoch, batches)
        return batches


class SpeculatorsPatch(TrainerPatch):
    """The patch's state: the dumps it opened, one DumpDataset per (dump, dataset), which the
    train and val ArrowDatasets share."""

    NAME = NAME
    POINTS = (Point("speculators.train.data", "ArrowDataset.__init__", "_arrow_init"),
              Point("speculators.train.dataloader", "DataLoader", "_data_loader"))

    def __init__(self) -> None:
        super().__init__()
        self.dumps: Dict[Tuple[str, str], Any] = {}

    def _uninstrument(self) -> None:
        self.dumps.clear()
        super()._uninstrument()

    def open(self, path: str, dataset: str) -> Any:
        from hs_capture.offline.train.dump_dataset import DumpDataset

        key = (path, dataset)
        if key not in self.dumps:
            self.dumps[key] = DumpDataset(path, dataset, keys="speculators")
        return self.dumps[key]

    def _arrow_init(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> None:
        from hs_capture.dump.paths import holds_dump
        from hs_capture.offline.read.reader import DumpError

        wrapped(*args, **kwargs)
        files = instance.transfer
        path = getattr(files, "hidden_states_path", None)
        if isinstance(files, DumpTransfer) or path is None or not holds_dump(str(path)):
            return
        datapath = str(inspect.signature(wrapped).bind(*args, **kwargs).arguments["datapath"])
        dataset = self.dataset or datapath  # without --dataset: DATA's own rows, sent as ids "0".."N-1"
        transfer = DumpTransfer(files, self.open(str(path), dataset))
        if not transfer.row_at:
            raise DumpError(f"the dump {path} holds none of the samples of {dataset} whole: send that dataset "
                            "(`hscap send DATA`), or give `hscap train --dataset` the JSONL that was sent, its "
                            "lines in DATA's row order")
        start, n = instance.start_file_idx, len(instance.data)
        held = sum(start <= row < start + n for row in transfer.row_at)
        if held < n:
            log.warning("%d of %d rows (%d..%d) of %s are not whole in the dump %s: left out of training",
                        n - held, n, start, start + n - 1, datapath, path)
        instance.transfer = transfer

    def _data_loader(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        dataset = args[0] if args else kwargs.get("dataset")
        sampler = kwargs.get("batch_sampler")
        if isinstance(getattr(dataset, "transfer", None), DumpTransfer) and sampler is not None:
            sampler._generate_batches = _DumpBatches(sampler, dataset, kwargs.get("num_workers", 0))
        return wrapped(*args, **kwargs)


PATCH = SpeculatorsPatch


def main(argv: List[str]) -> None:
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    # what `speculators train ARGS` and `torchrun -m speculators.train ARGS` run
    train(TrainConfig.resolve(list(argv)))
