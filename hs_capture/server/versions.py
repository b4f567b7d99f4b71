"""The one version gate (after OpenTelemetry's get_dependency_conflicts): what the host has
against what hs_capture instruments (package.py), as a problem string, never an exception.
The hook refuses to patch on a problem unless HSCAP_FORCE=1; doctor reports it."""

from __future__ import annotations

import os
from typing import Mapping, Optional

from hs_capture.server.config import forced
from hs_capture.server.package import INSTRUMENTS


def problem() -> Optional[str]:
    """Why the installed host is outside the supported range, or None (also when it cannot tell)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import Requirement
    except ImportError:
        return None  # cannot tell: feature detection decides
    for spec in INSTRUMENTS:
        req = Requirement(spec)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(have, prereleases=True):
            return f"{req.name} {have} is not supported (hs_capture instruments {spec})"
    return None


def check_host(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """problem(), unless HSCAP_FORCE=1."""
    return None if forced(env) else problem()
