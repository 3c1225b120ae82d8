"""The launcher interface: start a training job somewhere, supervise it, and always clean up.

Why one supervise loop for every engine: the guarantees the Airflow task needs
are the same whether ranks run here, over SSH, under Slurm or in Kubernetes:
logs stream into `logging`, the exit status becomes the result or a
`TrainingFailedError` carrying the reason from the run's status file (else the
first rank failure a node's spawner reported: the rank, its exception and where
it was raised, its traceback logged once; tasks/base/rank_failure.py), a hang
(the status's step does not move for `cluster.hang_timeout_s`) fails the task
naming the last step, and SIGTERM, a timeout exception or any other error
cancels the job on every node and waits until nothing is left. Before starting,
a launcher cancels a job of the same name (`JobSpec`) an earlier attempt left
alive. Engines only say how to start, poll, read the status of and stop a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from tasks.base.credentials import split_credentials
from tasks.base.errors import RetrainerError, TrainingFailedError
from tasks.base.job_status import STATUS_FILE, Status
from tasks.base.rank_failure import RankFailure
from tasks.config.schema import JobConfig
from tasks.data.manifest import read_manifest
from tasks.launch.outcome import Outcome
from tasks.launch.procs import new_tag
from tasks.launch.spec import JobSpec, LaunchOptions
from tasks.launch.torchrun import write_worker_config
from tasks.launch.watch import ProgressWatcher
from tasks.runs.identity import RunIdentity, for_dataset
from tasks.train.checkpoint import refuse_layout_change

log = logging.getLogger(__name__)


class LaunchCancelled(RetrainerError):
    """The launcher was told to stop (SIGTERM from Airflow on kill/timeout); the job was cancelled."""

    exit_code = 143


class JobPreempted(TrainingFailedError):
    """The cluster took the job away (Slurm preemption or a cancel not ours, a node failure, a pod eviction):
    the run is not at fault and resumes from its last checkpoint when started again."""


def _watcher(cfg: JobConfig) -> ProgressWatcher:
    return ProgressWatcher(cfg.cluster.hang_timeout_s, startup_timeout_s=cfg.cluster.startup_timeout_s)


class Job(ABC):
    """A started training job on one or more nodes."""

    @abstractmethod
    def poll(self) -> int | None:
        """None while running; the job's exit status once it ended (non-zero if any node failed)."""

    def wait(self, timeout_s: float) -> int | None:
        """`poll` after at most `timeout_s`: sooner where the engine can tell the job ended (a local process),
        so the supervisor returns when the ranks exit, not up to a poll interval later."""
        time.sleep(timeout_s)
        return self.poll()

    @abstractmethod
    def status(self) -> Status | None:
        """The run's latest status as this engine sees it (the status file, or a node agent's relay)."""

    @abstractmethod
    def stop(self) -> None:
        """Cancel whatever still runs on every node and return only when nothing is left. Idempotent."""

    @abstractmethod
    def rank_failure(self) -> RankFailure | None:
        """The earliest rank failure any node's spawner reported in the output followed so far (complete
        once the job is stopped or closed)."""

    def summary(self) -> dict[str, Any] | None:
        """The finished run's summary as a node agent relayed it (the run dir may be on a node's own disk);
        None: read `<output_dir>/summary.json`."""
        return None

    def preempted(self) -> bool:
        """Once ended: whether the cluster took the job away (not the job's own failure)."""
        return False

    def handle(self) -> dict[str, Any]:
        """What names this job on its engine (JSON), for `Launcher.attach` elsewhere (detachable engines)."""
        raise RetrainerError(f"{type(self).__name__} cannot be followed from another process")

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Let go of the job without stopping it (log tails, API streams); it keeps running."""


class Launcher(ABC):
    """Runs rank jobs through one engine: the training ranks (`tasks.train.worker`), or the evaluation ranks
    (`tasks.evaluate.worker`); `run()` returns the ranks' summary."""

    name = "base"
    poll_interval_s = 0.5
    detachable = False  # True: jobs outlive this process (submit / follow / collect; Airflow deferral)
    warms_nodes = False  # True: warm_nodes (or the job itself) fetches the data and starting weights per node

    @abstractmethod
    def start(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
              run: RunIdentity, options: LaunchOptions) -> Job:
        """Start the job `spec` names, in its directory; every process it creates must carry the launch tag (see
        procs.TAG_VAR)."""

    def prepare(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path,  # noqa: B027 (optional hook)
                options: LaunchOptions) -> None:
        """Validate engine-specific inputs before anything is written (override as needed)."""

    def warm_nodes(self, cfg: JobConfig, spec: JobSpec, run: RunIdentity,
                   options: LaunchOptions) -> list[dict[str, Any]]:
        """Warm every node that will train (tasks/inputs/node.py) and return their reports, refusing (naming the
        node) one that failed or verified other data. Engines that warm inside the job (Slurm's staging
        step, Kubernetes' init container) or on this machine (local: the warm task did) return []."""
        return []

    def node_reports(self, spec: JobSpec) -> list[dict[str, Any]]:
        """The per-node warm reports a finished job left in its directory (engines that warm inside the job)."""
        return []

    def cancel_earlier(self, cfg: JobConfig, spec: JobSpec) -> None:  # noqa: B027 (optional hook)
        """Cancel a job of this name that an earlier, killed attempt left on the engine (say so), and wait
        until it is gone: two jobs of one run would race on its checkpoints. Engines whose jobs die with
        the launcher (local, ssh: parent-death signal, agent on the ssh channel) have nothing to do."""

    def run(self, cfg: JobConfig, dataset_dir: str | os.PathLike[str], *, job: JobSpec | None = None,
            run: RunIdentity | None = None, options: LaunchOptions | None = None) -> dict[str, Any]:
        """Run the job `job` names into its directory, supervising it from this process; return the ranks'
        summary (with `options.node_warm`: each node's warm report under "nodes").

        `job` defaults to the run's training straight into `cfg.train.output_dir` (the `train` verb, tests).
        `run` is the run's identity (default: a scratch run on this dataset); `options` what else the ranks
        take (none: a training on the data as handed over, from scratch or its checkpoint). With
        `options.node_warm` the nodes warm `data.source_url` (and the starting weights) into their own
        `data.cache_dir` first (the lifecycle does; a caller that hands over a dataset directory every node
        already sees does not). Before the first step of this launch (imports, rendezvous, one-off op
        builds) the allowance is `cluster.startup_timeout_s` (default: cluster.hang_timeout_s). With
        `options.evaluation` the evaluation ranks run instead (tasks/evaluate: same engine, same
        supervision, their summary returned)."""
        spec, dataset_dir, run, config_json, options, reports = self._before_start(cfg, dataset_dir, job=job, run=run,
                                                                                   options=options)
        what = options.what
        watcher = _watcher(cfg)
        try:
            with _sigterm_cancels() as cancel:
                with cancel.deferred():  # never leave a half-started job untracked
                    started = self.start(cfg, spec, dataset_dir, config_json, new_tag(), run, options)
                try:
                    rc = self._supervise(cfg, started, watcher, what)
                finally:
                    with _sigterm_ignored():
                        started.stop()
        finally:
            config_json.unlink(missing_ok=True)
        watcher.observe(started.status())  # a rank's last word (its failure reason) lands as it exits
        return self._result(cfg, spec, started, rc, watcher.failure, started.rank_failure(), what,
                            reports if options.node_warm else None, preempted=rc != 0 and started.preempted())

    def submit(self, cfg: JobConfig, dataset_dir: str | os.PathLike[str], *, run: RunIdentity,
               job: JobSpec | None = None, options: LaunchOptions | None = None) -> dict[str, Any]:
        """Start the job as `run()` does and return at once with its handle (JSON, no credentials): for engines
        whose jobs outlive this process (`detachable`). `follow()` waits for it (anywhere: Airflow's
        triggerer), `collect()` turns the outcome into the summary, `stop_job()` stops it."""
        if not self.detachable:
            raise RetrainerError(f"the {self.name} launcher's ranks die with the process that started them: "
                                 "its jobs cannot be submitted and followed from elsewhere")
        spec, dataset_dir, run, config_json, options, reports = self._before_start(cfg, dataset_dir, job=job, run=run,
                                                                                   options=options)
        with _sigterm_cancels() as cancel:
            with cancel.deferred():  # a SIGTERM while starting: cancel what started, once it has
                started = self.start(cfg, spec, dataset_dir, config_json, new_tag(), run, options)
                handle = {"engine": self.name, **started.handle(), **spec.handle_fields(),
                          "config_json": str(config_json), "what": options.what, "node_warm": options.node_warm,
                          "reports": reports, "submitted_at": time.time()}
                if cancel.pending:
                    with _sigterm_ignored():
                        started.stop()
            started.close()
        log.info("%s: %s job %s submitted (%s); following it from elsewhere", self.name, handle["what"], spec.name,
                 ", ".join(f"{k} {v}" for k, v in started.handle().items()))
        return handle

    def attach(self, handle: Mapping[str, Any], *, output: bool = False) -> Job:
        """The job a handle of `submit()` names, for following (`output`: stream its log lines into `logging`)
        or stopping it (detachable engines)."""
        raise RetrainerError(f"the {self.name} launcher cannot attach to a job it did not start")

    async def follow(self, cfg: JobConfig, handle: Mapping[str, Any], *, deadline: float | None = None) -> Outcome:
        """Wait (without blocking the event loop) until the job ends, hangs (`cluster.hang_timeout_s`) or
        `deadline` (unix time) passes; the outcome `collect()` takes. Each blocking engine call runs in a
        thread. A hung or overdue job is cancelled here, on every node, before returning."""
        job = self.attach(handle, output=True)
        watcher = _watcher(cfg)
        cancelled: dict[str, str] = {}
        try:
            while (rc := await asyncio.to_thread(job.poll)) is None:
                watcher.observe(await asyncio.to_thread(job.status))
                if watcher.hung() or (deadline is not None and time.time() > deadline):
                    cancelled = ({"hung": watcher.describe()} if watcher.hung()
                                 else {"timed_out": f"still running at its deadline ({time.ctime(deadline)})"})
                    log.error("%s job hung or overdue: %s; cancelling", self.name, next(iter(cancelled.values())))
                    await asyncio.to_thread(job.stop)
                    rc = 1
                    break
                await asyncio.sleep(self.poll_interval_s)
            watcher.observe(await asyncio.to_thread(job.status))
        finally:
            job.close()
        return Outcome(rc=rc, failure=watcher.failure, last_step=watcher.last_step, rank_failure=job.rank_failure(),
                       preempted=not cancelled and rc != 0 and job.preempted(), **cancelled)

    def collect(self, cfg: JobConfig, handle: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
        """The summary of a followed job (`follow()`'s outcome): TrainingFailedError for a failed, hung or
        overdue one (JobPreempted when the engine took it away), after making sure nothing of it is left."""
        job = self.attach(handle)
        what = handle["what"]
        try:
            if outcome.rc != 0:
                job.stop()
        finally:
            job.close()
        Path(handle["config_json"]).unlink(missing_ok=True)
        if reason := outcome.hung or outcome.timed_out:
            raise TrainingFailedError(f"{what} of {cfg.name} {'hung' if outcome.hung else 'timed out'} "
                                      f"({self.name} launcher): {reason}; job cancelled on every node")
        if outcome.preempted:
            raise JobPreempted(f"{what} of {cfg.name}: the {self.name} job was preempted or cancelled by the "
                               f"cluster after step {outcome.last_step or 0}")
        return self._result(cfg, JobSpec.from_handle(handle), job, outcome.rc, outcome.failure,
                            outcome.rank_failure, what, handle["reports"] if handle["node_warm"] else None,
                            preempted=False)

    def stop_job(self, handle: Mapping[str, Any]) -> None:
        """Stop a submitted job on every node and wait until nothing of it is left (idempotent)."""
        job = self.attach(handle)
        try:
            job.stop()
        finally:
            job.close()
        Path(handle["config_json"]).unlink(missing_ok=True)

    def _before_start(self, cfg: JobConfig, dataset_dir: str | os.PathLike[str], *, job: JobSpec | None,
                      run: RunIdentity | None, options: LaunchOptions | None,
                      ) -> tuple[JobSpec, Path, RunIdentity, Path, LaunchOptions, list[dict[str, Any]]]:
        """Everything before the job starts: inputs checked, stale summary and status gone, a job of this name an
        earlier attempt left cancelled, the nodes warmed, the ranks' input written; the options the engine
        starts the job with (the checkpoint mirror's credentials added to the ranks' environment)."""
        dataset_dir = Path(dataset_dir).resolve()
        read_manifest(str(dataset_dir))  # fail fast, before any node is touched
        run = run or for_dataset(cfg, dataset_dir)
        spec = job or JobSpec(run.run_id, Path(cfg.train.output_dir))
        options = options or LaunchOptions()
        if not options.evaluating:  # a tp/pp change against the run's checkpoint: before any node
            refuse_layout_change(cfg, run, spec.output_dir)
        self.prepare(cfg, spec, dataset_dir, options)
        out = spec.output_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").unlink(missing_ok=True)  # a stale summary must never describe this run
        (out / STATUS_FILE).unlink(missing_ok=True)  # nor a stale status supervise it
        self.cancel_earlier(cfg, spec)
        _, mirror_env = split_credentials(cfg.train.checkpoint_storage_options, "train.checkpoint_storage_options")
        options = replace(options, secret_env={**options.secret_env, **mirror_env})
        reports = self.warm_nodes(cfg, spec, run, options) if options.node_warm else []
        config_json = write_worker_config(cfg, spec, run, options.init_path, options.export, options.evaluation)
        return spec, dataset_dir, run, config_json, options, reports

    def _result(self, cfg: JobConfig, spec: JobSpec, job: Job, rc: int, failure: str | None,
                failed_rank: RankFailure | None, what: str, reports: list[dict[str, Any]] | None, *,
                preempted: bool) -> dict[str, Any]:
        """The ended job's summary (`reports`: the nodes' warm reports, None when the nodes were not warmed);
        for a failed job the error: `failure` (the status file's reason), else `failed_rank`."""
        summary_path = spec.output_dir / "summary.json"
        if rc != 0:
            summary_path.unlink(missing_ok=True)
            if preempted:
                raise JobPreempted(f"{what} of {cfg.name}: the {self.name} job was preempted or cancelled by the "
                                   "cluster; a retry resumes from its last checkpoint")
            raise TrainingFailedError(f"{what} of {cfg.name} failed ({self.name} launcher): "
                                      f"{_why(failure, failed_rank) or f'exit status {rc}'}")
        try:
            summary = job.summary() or json.loads(summary_path.read_text())
        except FileNotFoundError:
            raise TrainingFailedError(f"{what} of {cfg.name} exited 0 but wrote no {summary_path}") from None
        if reports is not None:
            summary["nodes"] = reports or self.node_reports(spec)
        return summary

    def _supervise(self, cfg: JobConfig, job: Job, watcher: ProgressWatcher, what: str) -> int:
        rc = job.poll()
        while rc is None:
            watcher.observe(job.status())
            if watcher.hung():
                reason = watcher.describe()
                log.error("%s job of %s hung: %s; cancelling", self.name, cfg.name, reason)
                with _sigterm_ignored():
                    job.stop()
                raise TrainingFailedError(f"{what} of {cfg.name} hung ({self.name} launcher): {reason}; "
                                          "job cancelled on every node")
            rc = job.wait(self.poll_interval_s)
        return rc


def _why(reason: str | None, failed: RankFailure | None) -> str | None:
    """Why a job failed, in one line: the reason a rank wrote in the status file keeps its wording; else the
    earliest rank failure a node reported, whose traceback goes to the log here, once."""
    if reason or failed is None:
        return reason
    log.error("%s%s", failed.describe(), f"\n{failed.traceback.rstrip()}" if failed.traceback else "")
    return failed.describe()


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
