"""Runtime patching, one design for the server's hooks and the trainers' patches: an
Instrumentor object per patch (base.py). Imports wrapt only: neither side, nor torch or sglang."""

from hs_capture.patching.base import (REFUSED, SHARED, WRAPPED, Instrumentor, Slot, defining_class, is_ours,
                                      is_wrapped, owner_of, where)

__all__ = ["REFUSED", "SHARED", "WRAPPED", "Instrumentor", "Slot", "defining_class", "is_ours", "is_wrapped",
           "owner_of", "where"]
