"""The `[HS_DUMP]` logger: every line hs_capture prints inside the server starts with it,
so `grep HS_DUMP server.log` shows whether capture is live."""

from __future__ import annotations

import logging
import os
import sys

PREFIX = "[HS_DUMP]"
_logger = logging.getLogger("hs_capture")


def get_logger() -> logging.Logger:
    # Our own handler: the host's logging configuration (or none) must not hide or reformat us.
    if not _logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PREFIX} %(message)s"))
        _logger.addHandler(handler)
        _logger.propagate = False
        _logger.setLevel(logging.DEBUG if os.environ.get("HSCAP_DEBUG") else logging.INFO)
    return _logger
