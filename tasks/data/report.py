"""What a warm did (the report) and how it tells a human while it runs (progress)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.errors import RetrainerError

if TYPE_CHECKING:
    from tasks.data.manifest import Manifest  # lazy: pydantic only when the manifest must be parsed

log = logging.getLogger("tasks.data.warm")


@dataclass
class WarmReport:
    """Counts and speed of one warm; `to_dict()` is what the CLI prints and the DAG passes on."""

    files_total: int = 0
    bytes_total: int = 0
    files_fetched: int = 0
    bytes_fetched: int = 0
    files_skipped: int = 0
    bytes_skipped: int = 0
    files_verified: int = 0
    bytes_verified: int = 0
    retries: int = 0
    evicted: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_fetched / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        d["mb_per_s"] = round(self.mb_per_s, 2)
        return d


@dataclass
class WarmResult:
    """Where the verified dataset is, which manifest it is (lineage), and the report."""

    dataset_dir: Path
    manifest_hash: str
    report: WarmReport
    manifest_raw: bytes = field(default=b"", repr=False)
    manifest_source: str = ""
    parsed: Any = field(default=None, repr=False)  # the Manifest, when the warm had to parse it

    @property
    def manifest(self) -> Manifest:
        """The validated manifest; parsed on first use, since a no-op re-warm never needs pydantic."""
        if self.parsed is None:
            from tasks.data.manifest import Manifest  # lazy: pydantic only when the manifest must be parsed

            self.parsed = Manifest.parse(self.manifest_raw, source=self.manifest_source)
        return self.parsed

    def to_dict(self) -> dict[str, Any]:
        return {"dataset_dir": str(self.dataset_dir), "manifest_hash": self.manifest_hash,
                "report": self.report.to_dict()}


class Progress:
    """A tqdm bar on a terminal; periodic log lines otherwise (Airflow task logs)."""

    def __init__(self, total_bytes: int, total_files: int, enabled: bool, log_every_s: float = 5.0) -> None:
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.files = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._next_log = self._t0 + log_every_s
        self._every = log_every_s
        self._enabled = enabled and total_files > 0
        self._bar: Any = None
        if self._enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="warm", file=sys.stderr)

    def update(self, n_bytes: int, n_files: int = 1) -> None:
        with self._lock:
            self.files += n_files
            self.bytes += n_bytes
            if not self._enabled:
                return
            if self._bar is not None:
                self._bar.update(n_bytes)
                return
            now = time.monotonic()
            if now >= self._next_log:
                self._next_log = now + self._every
                rate = self.bytes / 1e6 / max(now - self._t0, 1e-9)
                log.info("warm: %d/%d files, %.1f/%.1f MB fetched, %.1f MB/s", self.files, self.total_files,
                         self.bytes / 1e6, self.total_bytes / 1e6, rate)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def refuse_unplanned(found_hash: str, planned_hash: str, source_url: str, who: str) -> None:
    """A warm that verified another manifest than the run planned stops here, naming `who` (a node, a suite) and
    the source: the data changed since the run started, and only a new run takes the new data."""
    if found_hash != planned_hash:
        raise RetrainerError(f"{who}: the dataset at {source_url} verified as manifest {found_hash[:12]}, not the "
                             f"{planned_hash[:12]} this run planned; it changed since the run started (a new run "
                             "takes the new data)")
