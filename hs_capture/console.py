"""The `hscap` console script. Two things the click group alone cannot do:

- a Ctrl-C while the commands import (click, numpy, torch) ends in one line and exit 130, not
  an import traceback;
- once a command has returned, the process ends without the interpreter's teardown: with
  torch imported it takes a noticeable while, in which a Ctrl-C is either lost or kills the finished
  process. atexit's callbacks still run (multiprocessing's among them); if a thread is still
  alive the normal exit waits for it as usual.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn, Optional, Union


def main() -> NoReturn:
    try:
        from hs_capture.cli import main as hscap
    except KeyboardInterrupt:
        sys.stderr.write("hscap: interrupted\n")
        raise SystemExit(130) from None
    try:
        hscap.main(prog_name="hscap")  # standalone: always ends in SystemExit
        code: Union[int, str, None] = 0
    except SystemExit as e:
        code = e.code
    _exit(code)


def _exit(code: Optional[Union[int, str]]) -> NoReturn:
    if isinstance(code, str):  # sys.exit(message): the message on stderr, status 1
        sys.stderr.write(code + "\n")
    status = 1 if isinstance(code, str) else int(code or 0)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        if threading.active_count() > 1:
            raise SystemExit(status)
        atexit._run_exitfuncs()
    except KeyboardInterrupt:  # the command has finished: its status stands
        pass
    os._exit(status)
