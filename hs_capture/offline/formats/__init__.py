"""The training formats: one registry (shaped like targets.py), one module per format, each
entry saying how samples are named, what the dump must hold, how to write one and how to
read one back. `hscap merge` writes through it, `hscap verify` and `HsCaptureDataset` read
through it, the CLI lists it. Importing it needs no torch (the CLI starts without it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hs_capture.offline.formats.merged_sample import MergedSample


@dataclass(frozen=True)
class TrainingFormat:
    name: str
    what: str  # one line, for --help and errors
    # per-sample formats: (rid, row) -> file name; None: packed shards listed by an index (native)
    file_name: Optional[Callable[[str, int], str]]
    # a file name (no directory) -> (file stem naming a rid, row) when it is this format's, else None
    identify: Callable[[str], Optional[Tuple[Optional[str], Optional[int]]]]
    write: Callable  # per-sample: (path, AssembledSample, loss_mask) -> bytes written
    load: Callable  # (path, key, headers) -> MergedSample; key: the native row's tensor prefix
    needs_prenorm: bool = False
    aux_layers: Optional[int] = None  # exactly this many captured layers, or any
    # the engine that serves this trainer's drafters ("sglang" or "vllm"): it decides which
    # layer ids land on the captured layers (serving_ids.py)
    served_by: Optional[str] = None
    # the trainer's own settings that match a capture: (the layer ids the serving engine maps
    # onto the captured layers, None when none does; whether the dataset gave real loss
    # masks) -> {setting: value}; merge writes them to OUT/trainer_settings.json
    settings: Optional[Callable[[Optional[Sequence[int]], bool], Dict[str, object]]] = None
    # the state dtypes the trainer computes with, and why: merge warns when the capture's differ
    state_dtypes: Optional[Tuple[Tuple[str, ...], str]] = None
    # whether a path under an output dir ('/'-separated, relative) is this format's output;
    # None: a sample file at the top (`identify`)
    owns_path: Optional[Callable[[str], bool]] = None

    def owns(self, rel: str) -> bool:
        """Whether merge writes this path (relative to its output dir) in this format."""
        if self.owns_path is not None:
            return self.owns_path(rel)
        return "/" not in rel and self.identify(rel) is not None

    def problem(self, prenorm: bool, layers: Sequence[int]) -> Optional[str]:
        """Why a dump with these settings cannot be written in this format, or None."""
        if self.needs_prenorm and not prenorm:
            return f"{self.name} needs the pre-norm final state: capture with HSCAP_PRENORM=1"
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


from hs_capture.offline.formats import modelopt, native, specforge, speculators  # noqa: E402  (each module defines FORMAT)

FORMATS: Dict[str, TrainingFormat] = {f.name: f for f in (specforge.FORMAT, modelopt.FORMAT, speculators.FORMAT,
                                                           native.FORMAT)}
NAMES: List[str] = sorted(FORMATS)


def for_file(name: str) -> Optional[Tuple[TrainingFormat, Optional[str], Optional[int]]]:
    """(format, file stem naming a rid, row) of a merged file, by its name; None: no format's."""
    for f in FORMATS.values():
        found = f.identify(name)
        if found is not None:
            return (f, *found)
    return None


__all__ = ["FORMATS", "NAMES", "MergedSample", "TrainingFormat", "for_file"]
