"""A logging handler that keeps what the "memoffload" logger said, for the
rank processes of the tests (node_worker.py, save_windows_worker.py,
inflight_worker.py), which write it into their results."""

from __future__ import annotations

import logging
from typing import List


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")
