"""What the trainer patches share: the attributes one patch replaced, to put back, and running a
trainer's entry point with its patch on, a damaged dump ending it in one line."""

from __future__ import annotations

import re
import sys
from types import ModuleType
from typing import Any, Callable, List, Optional, Tuple

from hs_capture.offline.reader import DumpError


class Unsupported(Exception):
    """What a patch found, while the trainer ran, that it cannot work with: one line."""


class Patches:
    """The (owner, attribute, original) one instrumentor replaced with wrapt FunctionWrappers."""

    def __init__(self) -> None:
        self._done: List[Tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, wrapper: Callable) -> None:
        """Wrap owner.attr once (a second instrument() finds it wrapped)."""
        import wrapt

        if any(o is owner and a == attr for o, a, _ in self._done):
            return
        # a class's own attribute as stored (a staticmethod stays one); else by name
        original = vars(owner)[attr] if isinstance(owner, type) and attr in vars(owner) else getattr(owner, attr)
        setattr(owner, attr, wrapt.FunctionWrapper(original, wrapper))
        self._done.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._done):
            setattr(owner, attr, original)
        self._done.clear()


def one_line(e: BaseException) -> str:
    """A DumpError's own line, also when a DataLoader worker re-raised it with its traceback
    (whose last line is "module.ClassName: message")."""
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return re.sub(r"^[\w.]+(Error|Differ): ", "", lines[-1]) if lines else type(e).__name__


def run(patch: ModuleType, dataset: Optional[str], argv: List[str]) -> Optional[str]:
    """The trainer's own entry point with its patch on. Returns None, or the one line that says
    why it cannot run (the trainer release, a damaged or unusable dump)."""
    problem = patch.check()
    if problem:
        return problem
    patch.instrument(dataset)
    try:
        patch.main(argv)
    except (DumpError, Unsupported) as e:
        return one_line(e)
    finally:
        patch.uninstrument()
    return None


def worker_main(patch: ModuleType) -> None:
    """A trainer's worker process started through the patch (`python -m <patch> [--dataset F]
    ARGS`): the same run, a damaged dump one line on stderr and exit 1 on every rank."""
    argv = sys.argv[1:]
    dataset = None
    if argv[:1] == ["--dataset"]:
        dataset, argv = argv[1], argv[2:]
    problem = run(patch, dataset, argv)
    if problem:
        sys.stderr.write(f"Error: {problem}\n")
        raise SystemExit(1)
