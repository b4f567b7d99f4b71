"""What the trainer patches share: the instrumentor each is (hs_capture.patching's, with the
points it wraps), and running a trainer's entry point with its patch on, a damaged dump ending
it in one line."""

from __future__ import annotations

import functools
import logging
import re
import sys
from types import ModuleType
from typing import Any, List, NamedTuple, Optional, Tuple

from hs_capture.offline.read.reader import DumpError
from hs_capture.patching import Instrumentor, where


class Unsupported(Exception):
    """What a patch found, while the trainer ran, that it cannot work with: one line."""


class Point(NamedTuple):
    """One place a trainer patch changes: once `module` is imported, its attribute `path` (a
    name, or Class.name: wrapped on the class that defines it) is wrapped by the patch's method
    `handler`; with proxy=True that method makes the proxy put in its place instead."""
    module: str
    path: str
    handler: str
    proxy: bool = False


class TrainerPatch(Instrumentor):
    """A trainer's patch: `instrument(dataset)` wraps its POINTS (post-import hooks, so a module
    the trainer imports later is patched too), its state lives in the object, `uninstrument()`
    puts every original back. A point someone else already wrapped stops it (Unsupported): a
    trainer reading merge's file names from a dump would fail later, less clearly."""

    NAME = ""
    POINTS: Tuple[Point, ...] = ()
    log = logging.getLogger("hs_capture.offline.train.trainers")

    def __init__(self) -> None:
        super().__init__()
        self.dataset: Optional[str] = None  # the JSONL given to `hscap send`

    def instrument(self, dataset: Optional[str] = None) -> bool:  # type: ignore[override]
        return super().instrument(dataset=dataset)

    def _instrument(self, dataset: Optional[str] = None) -> None:
        self.dataset = dataset
        for point in self.POINTS:
            self.when_imported(point.module, functools.partial(self._patch, point))

    def _uninstrument(self) -> None:
        self.dataset = None

    def _patch(self, point: Point, module: Any) -> None:
        *classes, attr = point.path.split(".")
        owner = module
        for name in classes:
            owner = getattr(owner, name, None)
        if owner is None or not hasattr(owner, attr):
            return  # not this trainer's module after all (check() names what a release lacks)
        handler = getattr(self, point.handler)
        if point.proxy:
            self.replace(owner, attr, handler)
        else:
            self.wrap(owner, attr, handler)

    def on_refused(self, owner: Any, attr: str, current: Any, note: str) -> None:
        raise Unsupported(f"{where(owner, attr)} is already wrapped by {self.whose(current)}: the {self.NAME} "
                          "dump patch does not wrap a wrapper (turn off what wrapped it)")


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
    instrumentor = patch.PATCH()
    try:
        instrumentor.instrument(dataset)
        patch.main(argv)
    except (DumpError, Unsupported) as e:
        return one_line(e)
    finally:
        if instrumentor.is_instrumented:
            instrumentor.uninstrument()
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
