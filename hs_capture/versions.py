"""Dependency gate (after OpenTelemetry's get_dependency_conflicts): returns a
problem string instead of raising; HSCAP_FORCE=1 overrides."""

from __future__ import annotations

import os
from typing import Optional

from .package import _instruments


def check_host() -> Optional[str]:
    if os.environ.get("HSCAP_FORCE", "") in ("1", "true", "yes"):
        return None
    try:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import Requirement
    except ImportError:
        return None  # cannot tell: feature detection decides
    for spec in _instruments:
        req = Requirement(spec)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(have, prereleases=True):
            return f"{req.name} {have} is not supported (hs_capture instruments {spec})"
    return None
