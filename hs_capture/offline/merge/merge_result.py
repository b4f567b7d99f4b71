"""What a merge (and each of its workers) reports: counts, left-out samples and why, the
trainer's settings, warnings. Shared by merge.py, which plans, and merge_worker.py, which writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

Item = Tuple[int, str]  # one sample to write: (row, rid)


@dataclass
class MergeResult:
    format: str
    written: int = 0
    skipped_existing: int = 0
    tokens: int = 0
    bytes_in: int = 0  # compressed bytes read from the dumps
    raw_bytes: int = 0  # decoded tensor bytes of the samples written
    bytes_out: int = 0
    seconds: float = 0.0
    loss_mask_source: str = "dataset"
    shard: str = "0/1"
    incomplete: Dict[str, str] = field(default_factory=dict)  # rid -> reason (never written)
    # rid -> pieces captured again (a retry, a re-send) beside the whole capture that was
    # written: a warning, never a reason to leave a sample out
    recaptured: Dict[str, int] = field(default_factory=dict)
    # without --dataset: rid -> why it is not a user's (SGLang's warmup), never written; and the
    # samples written whose id SGLang generated (attribution.py)
    left_out: Dict[str, str] = field(default_factory=dict)
    unattributed: List[str] = field(default_factory=list)
    settings: Dict[str, object] = field(default_factory=dict)  # the trainer's, matching the capture
    serving: Dict[str, object] = field(default_factory=dict)  # the engine and rule the layer ids are for
    dtypes: List[str] = field(default_factory=list)  # stored dtypes of the states written
    warnings: List[str] = field(default_factory=list)  # about the output as a whole (printed, in the report)
    worker_peak_rss_bytes: int = 0  # the largest peak resident memory of a process that decoded

    def add(self, other: "MergeResult") -> None:
        for k in ("written", "skipped_existing", "tokens", "bytes_in", "raw_bytes", "bytes_out"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.incomplete.update(other.incomplete)
        self.worker_peak_rss_bytes = max(self.worker_peak_rss_bytes, other.worker_peak_rss_bytes)
        self.dtypes = sorted(set(self.dtypes) | set(other.dtypes))
