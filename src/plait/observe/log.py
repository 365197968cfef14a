"""One rank-aware logger: rank 0 logs at INFO, other ranks only warnings and errors."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s plait[%(rank)s] %(levelname)s %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def get_logger(rank: int | None = None) -> logging.Logger:
    """The ``plait`` logger, configured once per process for ``rank`` (default: $RANK or 0)."""
    logger = logging.getLogger("plait")
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    for h in logger.handlers:
        h.filters = [_RankFilter(rank)]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger
