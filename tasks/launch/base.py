"""The launcher interface: start a training job somewhere, supervise it, and always clean up.

Why one supervise loop for every engine: the guarantees the Airflow task needs
are the same whether ranks run here, over SSH, under Slurm or in Kubernetes:
logs stream into `logging`, the exit status becomes the result or a
`TrainingFailedError` carrying the reason from the run's status file, a hang
(the status's step does not move for `cluster.hang_timeout_s`) fails the task
naming the last step, and SIGTERM, a timeout exception or any other error
cancels the job on every node and waits until nothing is left. Before starting,
a launcher cancels a job of the same run an earlier attempt left alive. Engines
only say how to start, poll, read the status of and stop a job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tasks.config import JobConfig
from tasks.errors import RetrainerError, TrainingFailedError
from tasks.launch.procs import new_tag
from tasks.launch.watch import ProgressWatcher
from tasks.train.status import STATUS_FILE, Status

if TYPE_CHECKING:
    from tasks.run import RunIdentity

log = logging.getLogger(__name__)


class LaunchCancelled(RetrainerError):
    """The launcher was told to stop (SIGTERM from Airflow on kill/timeout); the job was cancelled."""

    exit_code = 143


class Job(ABC):
    """A started training job on one or more nodes."""

    @abstractmethod
    def poll(self) -> int | None:
        """None while running; the job's exit status once it ended (non-zero if any node failed)."""

    @abstractmethod
    def status(self) -> Status | None:
        """The run's latest status as this engine sees it (the status file, or a node agent's relay)."""

    @abstractmethod
    def stop(self) -> None:
        """Cancel whatever still runs on every node and return only when nothing is left. Idempotent."""

    def summary(self) -> dict[str, Any] | None:
        """The finished run's summary as a node agent relayed it (the run dir may be on a node's own disk);
        None: read `<output_dir>/summary.json`."""
        return None


class Launcher(ABC):
    """Runs rank jobs through one engine: the training ranks (`tasks.train.worker`), or the evaluation ranks
    (`tasks.evaluate.worker`); `run()` returns the ranks' summary."""

    name = "base"
    poll_interval_s = 0.5
    warms_nodes = False  # True: warm_nodes (or the job itself) fetches the data and starting weights per node
    node_warm = False  # set by run(): warm the dataset and starting weights on every node before the ranks
    # Set by run(): credentials the ranks need (the export's store), passed by environment only.
    secret_env: Mapping[str, str] = MappingProxyType({})
    evaluation = False  # set by run(): the ranks are evaluation ranks (tasks/evaluate/worker.py)

    @abstractmethod
    def start(self, cfg: JobConfig, dataset_dir: Path, config_json: Path, tag: str, run: RunIdentity) -> Job:
        """Start the job; every process it creates must carry the launch tag (see procs.TAG_VAR)."""

    def prepare(self, cfg: JobConfig, dataset_dir: Path) -> None:  # noqa: B027 (optional hook)
        """Validate engine-specific inputs before anything is written (override as needed)."""

    def warm_nodes(self, cfg: JobConfig, run: RunIdentity) -> list[dict[str, Any]]:
        """Warm every node that will train (tasks/warm/node.py) and return their reports, refusing (naming the
        node) one that failed or verified other data. Engines that warm inside the job (Slurm's staging
        step, Kubernetes' init container) or on this machine (local: the warm task did) return []."""
        return []

    def node_reports(self, cfg: JobConfig) -> list[dict[str, Any]]:
        """The per-node warm reports a finished job left (engines that warm inside the job)."""
        return []

    def cancel_earlier(self, cfg: JobConfig, run: RunIdentity) -> None:  # noqa: B027 (optional hook)
        """Cancel a job of this run that an earlier, killed attempt left on the engine (say so), and wait
        until it is gone: two jobs of one run would race on its checkpoints. Engines whose jobs die with
        the launcher (local, ssh: parent-death signal, agent on the ssh channel) have nothing to do."""

    def run(self, cfg: JobConfig, dataset_dir: str | os.PathLike[str], *, run: RunIdentity | None = None,
            init_path: Path | None = None, node_warm: bool = False, export: dict[str, Any] | None = None,
            secret_env: dict[str, str] | None = None, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
        """Train into `cfg.train.output_dir`; return the trainer's summary (with `node_warm`: each node's warm
        report under "nodes").

        `run` is the run's identity (default: a scratch run on this dataset); `init_path` the local
        starting weights a fresh run loads. `node_warm`: first warm `data.source_url` (and the starting
        weights) on every training node into its own `data.cache_dir` (the lifecycle does; a caller that
        hands over a dataset directory every node already sees does not). `export`: the ranks write the
        final weights' Hugging Face shards into the store's staging area (tasks/train/export.py), with
        `secret_env` (the store's credentials) in their environment. Before the first step of this
        launch (imports, rendezvous, one-off op builds) the allowance is `cluster.startup_timeout_s`
        (default: cluster.hang_timeout_s). `evaluation`: run the evaluation ranks on this spec instead
        (tasks/evaluate: same engine, same supervision, their summary returned)."""
        from tasks.launch.torchrun import write_worker_config
        from tasks.run import for_dataset
        from tasks.train.data import read_manifest

        dataset_dir = Path(dataset_dir).resolve()
        read_manifest(dataset_dir)  # fail fast, before any node is touched
        run = run or for_dataset(cfg, dataset_dir)
        self.prepare(cfg, dataset_dir)
        out = Path(cfg.train.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary_path = out / "summary.json"
        summary_path.unlink(missing_ok=True)  # a stale summary must never describe this run
        (out / STATUS_FILE).unlink(missing_ok=True)  # nor a stale status supervise it
        watcher = ProgressWatcher(cfg.cluster.hang_timeout_s, startup_timeout_s=cfg.cluster.startup_timeout_s)
        self.cancel_earlier(cfg, run)
        from tasks.credentials import split_credentials

        _, mirror_env = split_credentials(cfg.train.checkpoint_storage_options, "train.checkpoint_storage_options")
        self.node_warm, self.secret_env = node_warm, {**(secret_env or {}), **mirror_env}
        self.evaluation = evaluation is not None
        what = "evaluation" if self.evaluation else "training"
        reports = self.warm_nodes(cfg, run) if node_warm else []
        config_json = write_worker_config(cfg, out, run, init_path, export, evaluation)
        tag = new_tag()
        try:
            with _sigterm_cancels() as cancel:
                with cancel.deferred():  # never leave a half-started job untracked
                    job = self.start(cfg, dataset_dir, config_json, tag, run)
                try:
                    rc = self._supervise(cfg, job, watcher, what)
                finally:
                    with _sigterm_ignored():
                        job.stop()
        finally:
            config_json.unlink(missing_ok=True)
        watcher.observe(job.status())  # a rank's last word (its failure reason) lands as it exits
        if rc != 0:
            summary_path.unlink(missing_ok=True)
            detail = watcher.failure or f"exit status {rc}"
            raise TrainingFailedError(f"{what} of {cfg.name} failed ({self.name} launcher): {detail}")
        try:
            summary = job.summary() or json.loads(summary_path.read_text())
        except FileNotFoundError:
            raise TrainingFailedError(f"{what} of {cfg.name} exited 0 but wrote no {summary_path}") from None
        if node_warm:
            summary["nodes"] = reports or self.node_reports(cfg)
        return summary

    def _supervise(self, cfg: JobConfig, job: Job, watcher: ProgressWatcher, what: str) -> int:
        while (rc := job.poll()) is None:
            watcher.observe(job.status())
            if watcher.hung():
                reason = watcher.describe()
                log.error("%s job of %s hung: %s; cancelling", self.name, cfg.name, reason)
                with _sigterm_ignored():
                    job.stop()
                raise TrainingFailedError(f"{what} of {cfg.name} hung ({self.name} launcher): {reason}; "
                                          "job cancelled on every node")
            time.sleep(self.poll_interval_s)
        return rc


class _Cancel:
    """SIGTERM handler state: raise at once, or (while deferred) remember and raise afterwards."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending = False

    def on_term(self, signum: int, frame: object) -> None:
        if self.deferring:
            self.pending = True
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one cancellation at a time
        raise LaunchCancelled("launcher received SIGTERM: training cancelled on every node")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending:
            self.on_term(signal.SIGTERM, None)


@contextlib.contextmanager
def _sigterm_cancels() -> Iterator[_Cancel]:
    """Turn SIGTERM (Airflow killing or timing out the task) into LaunchCancelled in the main thread."""
    cancel = _Cancel()
    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return
    previous = signal.signal(signal.SIGTERM, cancel.on_term)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """Cleanup must finish: a second SIGTERM during it is logged, not obeyed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda s, f: log.warning("SIGTERM during cleanup: finishing cleanup"))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
