"""Keep the offline tools' large buffers in the heap. merge and verify decode hundreds of MB
per step; glibc serves each buffer over 32 MB with a fresh mmap and unmaps it on free, so
every step pays the kernel's page faults and zeroing again (a large share of verify's time). Raising
the mmap and trim thresholds lets freed steps be reused. Never called in the server."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(threshold: int = 1 << 30) -> bool:
    """mallopt the mmap threshold (max 32 MB by default) up to `threshold`; True if it took.
    A no-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
