"""Runtime patches that let a trainer read its offline data straight from a dump (`hscap train`):
one module per trainer, each with NAME, check(), PATCH (its patching.TrainerPatch: an object
holding the patch's state, `PATCH().instrument(dataset)`, `.uninstrument()`) and main(argv)
(the trainer's own entry point). A module imports its trainer only when called."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Tuple

NAMES: Tuple[str, ...] = ("modelopt", "specforge", "speculators")


def load(name: str) -> ModuleType:
    """The patch module of one trainer (ValueError: no such trainer)."""
    if name not in NAMES:
        raise ValueError(f"unknown trainer {name!r}: choose from {list(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")
