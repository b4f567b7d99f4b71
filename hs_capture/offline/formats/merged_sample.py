"""One merged sample as read back (any format): numpy arrays with the states widened to
float32 (what verify checks), or torch tensors of the stored dtypes (what HsCaptureDataset
hands a trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class MergedSample:
    """One sample of `hscap merge` output read back through its format (TrainingFormat.load)."""

    rid: Optional[str]
    input_ids: np.ndarray
    loss_mask: Optional[np.ndarray]
    aux: np.ndarray  # (T, K*H)
    final: Optional[np.ndarray]  # (T, H) post-norm
    prenorm: Optional[np.ndarray]  # (T, H)
    hidden_size: int
    dtype: str = "float32"  # the states' stored dtype
