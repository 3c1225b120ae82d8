"""Progress over input bytes: a tqdm bar on a terminal, a log line every `interval_s` otherwise (Airflow)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_bytes: int, interval_s: float = 30.0) -> None:
        self.total, self.interval_s = total_bytes, interval_s
        self.done = self.tokens = 0
        self.start = self._last = time.monotonic()
        self._bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data", file=sys.stderr)

    def update(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            log.info("prepare-data: %.1f%% of %.1f MB read, %d tokens, %.0f tokens/s",
                     100 * self.done / max(1, self.total), self.total / 1e6, self.tokens,
                     self.tokens / max(1e-9, now - self.start))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
