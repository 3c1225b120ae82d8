"""`local`: the ranks on this machine (`tasks.base.spawn`) (the default, and what tests use).

It is the trainer's own path (`tasks.launch.torchrun.node_command` and
`rank_env`) behind the launcher interface, plus what the trainer alone does
not give: hang detection and a cleanup that also reaches processes a rank put in
their own sessions.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from tasks.base.job_status import STATUS_FILE, Status, read_status
from tasks.base.rank_failure import RankFailure
from tasks.base.spawn import die_with_parent
from tasks.config.schema import JobConfig
from tasks.launch import torchrun
from tasks.launch.base import Job, Launcher
from tasks.launch.logs import LineSink, pump
from tasks.launch.procs import TAG_VAR, stop_all
from tasks.launch.spec import JobSpec, LaunchOptions
from tasks.runs.identity import RunIdentity

log = logging.getLogger(__name__)


class LocalJob(Job):
    def __init__(self, cmd: list[str], env: dict[str, str], tag: str, status_path: Path, *, grace_s: float) -> None:
        self.tag, self.grace_s, self.status_path = tag, grace_s, status_path
        self.sink = LineSink(logging.getLogger("tasks.launch.ranks"))
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=die_with_parent)
        assert self.proc.stdout is not None
        self.reader = pump(self.proc.stdout, self.sink, name="ranks-log")
        self._stopped = False

    def status(self) -> Status | None:
        return read_status(self.status_path)

    def rank_failure(self) -> RankFailure | None:
        return self.sink.rank_failure

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self._stopped:
            return
        n = stop_all(self.tag, root_pid=self.proc.pid, grace_s=self.grace_s)
        self.proc.wait()
        self.reader.join(timeout=10)
        self._stopped = True
        if n:
            log.warning("local job %s: stopped %d leftover process(es)", self.tag[:8], n)


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, *, env: dict[str, str] | None = None, grace_s: float = 15.0) -> None:
        self.env, self.grace_s = dict(env or {}), grace_s

    def start(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
              run: RunIdentity, options: LaunchOptions) -> Job:
        cmd = torchrun.node_command(cfg, dataset_dir, config_json, evaluation=options.evaluating)
        log.info("local: launching %d ranks: %s", cfg.parallel.layout.world_size, " ".join(cmd))
        return LocalJob(cmd, torchrun.rank_env({**self.env, **options.secret_env, TAG_VAR: tag},
                                                   evaluation=options.evaluating), tag,
                        spec.output_dir / STATUS_FILE, grace_s=self.grace_s)
