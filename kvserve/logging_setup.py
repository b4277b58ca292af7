"""kvserve's log format: one handler on the `kvserve` logger, as vLLM does, unless the
application configured the logger itself."""

from __future__ import annotations

import logging
import os


def init_logging() -> None:
    logger = logging.getLogger("kvserve")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("KVSERVE_LOGGING_LEVEL", "INFO"))
    logger.propagate = False
