"""The training formats: the interface (base.py), one module per format implementing it, and
this registry of them by name. `hscap merge` writes through it, `hscap verify` and
`HsCaptureDataset` read through it, the CLI lists it; none of them asks which format it holds.
A new format is one module and one line here. Importing it needs no torch (the CLI starts
without it)."""

from __future__ import annotations

from typing import Dict, List

from hs_capture.offline.formats import modelopt, native, specforge, speculators
from hs_capture.offline.formats.base import ListingError, Output, SampleRef, TrainingFormat
from hs_capture.offline.formats.merged_sample import MergedSample

FORMATS: Dict[str, TrainingFormat] = {f.name: f for f in (specforge.FORMAT, modelopt.FORMAT, speculators.FORMAT,
                                                           native.FORMAT)}
NAMES: List[str] = sorted(FORMATS)
NATIVE = native.NATIVE  # the name of hs_capture's own format (what HsCaptureDataset reads)
NATIVE_ITEM_KEYS = native.ITEM_KEYS  # its tensor kinds -> the keys HsCaptureDataset's items carry

__all__ = ["FORMATS", "NAMES", "NATIVE", "NATIVE_ITEM_KEYS", "ListingError", "MergedSample", "Output", "SampleRef", "TrainingFormat"]
