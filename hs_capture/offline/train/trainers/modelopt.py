"""NVIDIA ModelOpt 0.47 (EAGLE-3 offline training) straight from a dump.

ModelOpt trains offline with its Model-Optimizer checkout's examples/speculative_decoding/main.py
and `data.offline_data_path=DIR`. There, `eagle_utils.make_speculative_data_module` lists DIR's
`*.pt` files (rglob) into `OfflineSupervisedDataset`, whose `__getitem__` does
`torch.load(self.dumped_files[i], weights_only=True)` and turns the dict into the model's inputs;
`EagleOfflineDataCollator` pads or truncates a batch; the HF `Trainer` draws indices from
`_get_train_sampler`. When DIR holds a dump, `instrument()` changes three points and nothing else:

  the listing   `eagle_utils.make_speculative_data_module` (a post-import hook: the checkout is a
                script directory, not a package) builds ModelOpt's own dataset and collator over
                the dump's samples instead of globbing files (`data_module` below);
  the load      the `torch` OfflineSupervisedDataset's module calls load on (that module's binding
                alone: torch.load itself is untouched) given one of those samples returns
                `DumpDataset(keys="modelopt")[i]`, exactly what torch.load of merge's .pt gives, so
                ModelOpt's per-item code runs on it;
  the sampler   `transformers.Trainer._get_train_sampler` returns `DumpDataset.sampler(...)` with
                the trainer's batch size, workers, seed and drop_last, so each step file is
                decoded about once (several processes: see _Interleaved).

Any other path, dataset or call goes to ModelOpt untouched.

    hscap train modelopt --dataset data.jsonl -- main.py --config ... data.offline_data_path=/data/hs

`main(argv)`: argv[0] is the checkout's main.py, the rest its own arguments.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import wrapt

from hs_capture.dump.paths import holds_dump
from hs_capture.offline.train.dump_dataset import DumpDataset
from hs_capture.offline.train.step_sampler import StepWindowSampler
from hs_capture.offline.read.reader import DumpError
from hs_capture.offline.train.trainers.patching import Point, TrainerPatch

NAME = "modelopt"
SUPPORTED = ("0.47.",)  # releases whose OfflineSupervisedDataset loads one torch.load dict per item
ITEMS = "modelopt.torch.speculative.eagle.utils"  # OfflineSupervisedDataset's module: its `torch` loads each item


def check() -> Optional[str]:
    try:
        import modelopt
        from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset
        from transformers import Trainer
    except ImportError as e:
        return f"ModelOpt's offline EAGLE training cannot be imported: {e}"
    version = getattr(modelopt, "__version__", "unknown")
    if not version.startswith(SUPPORTED):
        return (f"nvidia-modelopt {version} is not supported: the dump patch knows "
                f"{', '.join(v + 'x' for v in SUPPORTED)} (whose OfflineSupervisedDataset torch.loads one .pt per item)")
    if "dumped_files" not in inspect.signature(OfflineSupervisedDataset.__init__).parameters:
        return f"nvidia-modelopt {version}: OfflineSupervisedDataset takes no dumped_files list"
    import torch

    if getattr(sys.modules[ITEMS], "torch", None) is not torch:
        return f"nvidia-modelopt {version}: {ITEMS} binds no `torch` of its own to load the dump's samples through"
    if not callable(getattr(Trainer, "_get_train_sampler", None)):
        return "transformers' Trainer has no _get_train_sampler to hand the dump's sampler to"
    return None


class _Sample(NamedTuple):
    """What OfflineSupervisedDataset holds in place of one .pt path: the patched torch.load reads it."""
    dump: Any  # a DumpDataset(keys="modelopt")
    index: int


class _Samples(Sequence):
    """OfflineSupervisedDataset's `dumped_files`: the first `n` samples of a dump, in merge's row order."""

    def __init__(self, dump: Any, n: int) -> None:
        self.dump, self.n = dump, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> _Sample:  # type: ignore[override]
        return _Sample(self.dump, range(self.n)[i])

    def sampler(self, **kw: Any) -> Any:
        """The dump's own sampler (DumpDataset.sampler), over the first n samples (data.sample_size)."""
        if self.n == len(self.dump):
            return self.dump.sampler(**kw)
        windows = [[i for i in w if i < self.n] for w in self.dump.windows]
        return StepWindowSampler([w for w in windows if w], **kw)


class _Interleaved:
    """Every rank's sampler as the one index stream accelerate shards. With N processes it hands
    process p the batches p, p+N, p+2N, ... of that stream (BatchSamplerShard), so batch k of
    rank r goes at place k*N + r and each process reads exactly its own sampler's batches, in
    the order its DataLoader workers were planned for. The ranks' shares are equally long; their
    short last batches are dropped (drop_last) or filled from the share's start (as accelerate's
    even_batches does) so the batches stay aligned."""

    def __init__(self, samplers: List[Any], batch_size: int, drop_last: bool) -> None:
        self.samplers, self.batch_size, self.drop_last = samplers, batch_size, drop_last

    def _batches(self, sampler: Any) -> List[List[int]]:
        order = list(sampler)
        out = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if out and len(out[-1]) < self.batch_size:
            if self.drop_last:
                out.pop()
            else:
                out[-1] = (out[-1] + order * self.batch_size)[:self.batch_size]
        return out

    def __iter__(self) -> Iterator[int]:
        for batch_round in zip(*(self._batches(s) for s in self.samplers)):
            for batch in batch_round:
                yield from batch

    def __len__(self) -> int:
        n = len(self.samplers[0])
        per = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return per * self.batch_size * len(self.samplers)

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)


class _LoadingTorch(wrapt.ObjectProxy):
    """The `torch` of OfflineSupervisedDataset's module alone: its load, given a sample of a
    dump, returns the sample; torch itself, and every other caller's torch.load, are untouched."""

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, _Sample):
            return f.dump[f.index]
        return self.__wrapped__.load(f, *args, **kwargs)


def _data_args(tokenizer: Any, data_args: Any, *args: Any, **kwargs: Any) -> Any:
    return data_args


class ModelOptPatch(TrainerPatch):
    """ModelOpt's patch: its state is the dataset given (the loss masks)."""

    NAME = NAME
    # the checkout's eagle_utils is a script directory's module, imported by main.py as `eagle_utils`
    POINTS = (Point("eagle_utils", "make_speculative_data_module", "_make_data_module"),
              Point(ITEMS, "torch", "_loading_torch", proxy=True),
              Point("transformers.trainer", "Trainer._get_train_sampler", "_train_sampler"))

    def data_module(self, tokenizer: Any, data_args: Any, train_len: Optional[int] = None,
                    answer_only_loss: bool = False, shift_labels: bool = True) -> Dict[str, Any]:
        """ModelOpt 0.47's offline branch of make_speculative_data_module (same arguments; that branch
        ignores shift_labels too) with the dump's samples as its file list: its own
        OfflineSupervisedDataset (per-item code) and EagleOfflineDataCollator."""
        from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

        if answer_only_loss and self.dataset is None:
            # without the dataset every loss_mask is all ones: answer-only would silently train on every token
            raise DumpError("training.answer_only_loss needs the dataset's loss masks: give `hscap train --dataset "
                            "JSONL`")
        sample_size = getattr(data_args, "sample_size", -1)  # -1 or a positive count: its recipe checks
        dump = DumpDataset(data_args.offline_data_path, self.dataset, keys="modelopt")
        if not len(dump):
            raise DumpError(f"no whole sample in the dump {data_args.offline_data_path}")
        n = len(dump) if sample_size < 0 else min(sample_size, len(dump))
        return {"train_dataset": OfflineSupervisedDataset(_Samples(dump, n), answer_only_loss=answer_only_loss,
                                                          tokenizer=tokenizer),
                "data_collator": EagleOfflineDataCollator(train_len=train_len)}

    def _make_data_module(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Dict[str, Any]:
        data_args = _data_args(*args, **kwargs)
        path = getattr(data_args, "offline_data_path", None)
        if getattr(data_args, "mode", None) != "offline" or not path or not holds_dump(str(path)):
            return wrapped(*args, **kwargs)
        return self.data_module(*args, **kwargs)

    def _loading_torch(self, torch: Any) -> Any:
        return _LoadingTorch(torch)

    def _train_sampler(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        dataset = (args[0] if args else kwargs.get("train_dataset")) or instance.train_dataset
        files = getattr(dataset, "dumped_files", None)
        if not isinstance(files, _Samples):
            return wrapped(*args, **kwargs)
        a = instance.args
        kw = dict(batch_size=instance._train_batch_size, num_workers=a.dataloader_num_workers,
                  shuffle=getattr(a, "train_sampling_strategy", "random") != "sequential",
                  seed=a.data_seed if a.data_seed is not None else a.seed, drop_last=a.dataloader_drop_last)
        # accelerate, not torch.distributed, says how many processes share the data (and it shards the
        # sampler the Trainer gives it)
        world = instance.accelerator.num_processes
        if world == 1:
            return files.sampler(rank=0, world_size=1, **kw)
        return _Interleaved([files.sampler(rank=r, world_size=world, **kw) for r in range(world)],
                            instance._train_batch_size, a.dataloader_drop_last)


PATCH = ModelOptPatch


def main(argv: List[str]) -> None:
    if not argv or not os.path.isfile(argv[0]):
        raise SystemExit(f"hscap train {NAME}: the first argument after -- is ModelOpt's main.py "
                         "(examples/speculative_decoding/main.py of a Model-Optimizer checkout)")
    script = os.path.abspath(argv[0])
    saved = sys.argv, list(sys.path)
    # as `python main.py ...` would: it imports eagle_utils and scripts/ from beside itself
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved
