"""The training-format interface: what merge, its workers, verify, the CLI and HsCaptureDataset
call, and what each format module implements (one class each; formats/__init__.py maps names
to them). A format that writes a file per sample and the native one that packs many samples
per shard answer the same calls, so no caller asks which format it holds. Importing it needs
no torch (the CLI starts without it)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from hs_capture.dump.files import atomic_file
from hs_capture.dump.hst import TensorInvalidInfo
from hs_capture.offline.formats.common import sample_file_stem
from hs_capture.offline.formats.merged_sample import MergedSample

Row = Tuple[int, str]  # one sample to write: (row, rid)
# merge's cutter: step-ordered rows -> consecutive runs of about `target` decoded bytes, cut
# only between samples that end in different steps
Cut = Callable[[Sequence[Row], float], List[List[Row]]]
# verify's callback for a file a format finds wrong beside its samples: (message, path)
Problem = Callable[[str, str], None]


class Output(NamedTuple):
    """One file merge writes: its path under the output dir and the samples it holds, in step
    order. Sent to merge's worker processes, so it pickles."""

    path: str
    rows: List[Row]


@dataclass(frozen=True)
class SampleRef:
    """One merged sample found on disk: where it is and how its format reads it back."""

    fmt: str
    path: str  # the file
    rid: Optional[str] = None  # known from the file name / a listing (None: read from the file)
    row: Optional[int] = None
    key: Optional[str] = None  # the sample's name inside a file of many (native: its row)
    hidden_size: Optional[int] = None  # what the merge recorded; the reader checks the states against it


class ListingError(ValueError):
    """A format's listing of its samples (native: index.json) cannot be used; the one line says
    why. `reason` and `path` apart, for verify's finding."""

    def __init__(self, reason: str, path: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.reason = reason
        self.path = path


class TrainingFormat(ABC):
    """One training format: its requirements, how merge writes it, how it is found and read
    back. Class attributes describe it; the methods do the work."""

    name: str
    what: str  # one line, for --help and errors
    pattern: str  # how its files look, for verify's "nothing found" line
    data_dir: str = ""  # where merge writes the outputs (relative to the output dir); temp files go there
    listings: Tuple[str, ...] = ()  # the files finish() writes beside the outputs (relative to the output dir)
    needs_prenorm: bool = False
    aux_layers: Optional[int] = None  # exactly this many captured layers, or any
    # the engine that serves this trainer's drafters ("sglang" or "vllm"): it decides which
    # layer ids land on the captured layers (hs_capture/dump/layer_ids.py)
    served_by: Optional[str] = None
    # the state dtypes the trainer computes with, and why: merge warns when the capture's differ
    state_dtypes: Optional[Tuple[Tuple[str, ...], str]] = None

    # ------------------------------------------------------------ requirements
    def problem(self, prenorm: bool, layers: Sequence[int]) -> Optional[str]:
        """Why a dump with these settings cannot be written in this format, or None."""
        if self.needs_prenorm and not prenorm:
            return (f"{self.name} needs the pre-norm final state: capture with `hscap serve --prenorm` "
                    "(HSCAP_PRENORM=1 on a server started without hscap serve)")
        if self.aux_layers is not None and len(layers) != self.aux_layers:
            return f"{self.name} takes exactly {self.aux_layers} aux layers; the dump has {list(layers)}"
        return None

    def dtype_warning(self, dtypes: Sequence[str]) -> Optional[str]:
        """Why the trainer cannot use states of these stored dtypes, or None."""
        if self.state_dtypes is None:
            return None
        takes, why = self.state_dtypes
        other = sorted(set(dtypes) - set(takes))
        if not other:
            return None
        return (f"{self.name}'s trainer takes {'/'.join(takes)} states ({why}); this capture is {'/'.join(other)}: "
                f"capture with the server's --dtype {takes[0]}")

    def settings(self, ids: Optional[Sequence[int]], real_mask: bool) -> Optional[Dict[str, object]]:
        """The trainer's own settings that match a capture: `ids`, the layer ids the serving
        engine maps onto the captured layers; `real_mask`, whether the dataset gave loss masks.
        None: the trainer has none (merge writes no trainer_settings.json)."""
        return None

    # ------------------------------------------------------------ writing (merge)
    @abstractmethod
    def plan_outputs(self, rows: Sequence[Row], shard: Tuple[int, int], cut: Cut) -> List[Output]:
        """The files a merge of these step-ordered rows writes. Fixed by the rows and --shard
        alone (never by -j), so a re-run finds the same files and skips those that exist."""

    @abstractmethod
    def record(self, s, loss_mask) -> Dict[str, object]:
        """One AssembledSample with its loss mask as this format's trainer reads it: exactly the
        tensors (names, shapes, dtypes, bytes) merge's file holds for it. merge writes it;
        DumpDataset hands it to a trainer straight from the dump."""

    @abstractmethod
    def write(self, path: str, samples: Sequence[tuple]) -> int:
        """Write one planned output atomically; samples: (row, AssembledSample, loss_mask),
        those of its rows that merge could assemble. Returns the bytes written."""

    def finish(self, out_dir: str, layers: List[int], hidden_size: int, prenorm: bool) -> None:
        """After every output is written (each --shard run): what lists them, if anything."""

    # ------------------------------------------------------------ reading (verify, the dataset)
    @abstractmethod
    def owns(self, rel: str) -> bool:
        """Whether merge writes this path (relative to its output dir, '/'-separated) in this format."""

    def marks(self, root: str) -> bool:
        """Whether root holds a file that marks it as this format's merge output on its own
        (merge_report.json marks every format's)."""
        return False

    @abstractmethod
    def discover(self, root: str, files: Sequence[str], problem: Problem,
                 order: Optional[Sequence[str]]) -> List[SampleRef]:
        """This format's samples under root. `files`: the paths of the files under root that the
        caller found (temp files left out; [] to read only a listing); `order`: the dataset's ids
        in row order, to name samples whose files carry no id. Files of this format that no
        sample accounts for go to `problem`; ListingError: its listing cannot be used."""

    @abstractmethod
    def load(self, ref: SampleRef, cache: Dict, as_torch: bool = False) -> MergedSample:
        """Read one sample back, checking it against the format's layout: numpy arrays with the
        states widened to float32, or (as_torch) torch tensors of the stored dtypes. `cache`:
        the format's memo across loads of one reader (native: shard headers). A file that breaks
        the layout raises an hst.FormatError (KeyError: a tensor it lacks)."""


class PerSampleFormat(TrainingFormat):
    """A format of one file per sample at the top of the output dir, named from its id or row."""

    @abstractmethod
    def file_name(self, rid: str, row: int) -> str:
        """The file of this sample."""

    @abstractmethod
    def identify(self, name: str) -> Optional[Tuple[Optional[str], Optional[int]]]:
        """A file name (no directory) -> (the stem naming a rid, the row) when it is this
        format's, else None."""

    def save(self, path: str, record: Dict[str, object], rid: str) -> None:
        """Write one sample's record (record()) to path: a torch.save dict, unless the format
        says otherwise."""
        import torch

        torch.save(record, path)

    def plan_outputs(self, rows: Sequence[Row], shard: Tuple[int, int], cut: Cut) -> List[Output]:
        return [Output(self.file_name(rid, row), [(row, rid)]) for row, rid in rows]

    def write(self, path: str, samples: Sequence[tuple]) -> int:
        ((_row, s, loss_mask),) = samples
        record = self.record(s, loss_mask)
        return atomic_file(path, lambda p: self.save(p, record, s.rid))

    def owns(self, rel: str) -> bool:
        return "/" not in rel and self.identify(rel) is not None

    def discover(self, root: str, files: Sequence[str], problem: Problem,
                 order: Optional[Sequence[str]]) -> List[SampleRef]:
        # by name anywhere under root (a trainer such as SpecForge globs **/*.ckpt)
        refs: List[SampleRef] = []
        stems: Optional[Dict[str, str]] = None
        for path in files:
            found = self.identify(os.path.basename(path))
            if found is None:
                continue
            stem, row = found
            if stem is not None:
                if stems is None:  # hashed once per format, only when its files are there
                    stems = {sample_file_stem(r): r for r in order} if order else {}
                rid = stems.get(stem)
            else:
                rid = order[row] if order and row is not None and row < len(order) else None
            refs.append(SampleRef(self.name, path, rid, row))
        return refs


def stored_width(ref: SampleRef, width: int) -> None:
    """Raise unless the states' width is the hidden size the merge recorded (when known)."""
    if ref.hidden_size is not None and width != ref.hidden_size:
        raise TensorInvalidInfo(f"the states are {width} wide; the merge recorded hidden size {ref.hidden_size}")
