"""`slurm`: an `sbatch` script: a staging step warming every node, then `srun python -m tasks.base.spawn ...`, one
per node.

Why this shape: Slurm owns the allocation and the processes (it tracks and
kills every process of a step), `tasks.base.spawn` owns the ranks on each node, and the
rendezvous is the first node of the allocation (`scontrol show hostnames`),
at `cluster.master_port`. The job id is written to `<output_dir>/slurm-job-id`
and logged; the job's output file (on the shared output dir) is tailed into
`logging`. Cancelling is `scancel`, then waiting until Slurm reports the job
ended and no longer COMPLETING, i.e. every node has reaped the step. Run from the
lifecycle, the script's first step is `srun --ntasks-per-node=1 python -m
tasks.inputs.node` in the same allocation, so the nodes that warm are the nodes that
train; each writes its report to `<output_dir>/warm/<node>.json`, and a node that
fails or verified other data writes the reason to the status file and ends the
job before any rank starts (`set -e`). The warm spec travels in sbatch's
environment and is unset before the training step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.base.errors import RetrainerError
from tasks.base.fsutil import atomic_write_bytes
from tasks.base.job_status import STATUS_FILE, Status, read_status
from tasks.base.rank_failure import RankFailure
from tasks.config.cluster import SlurmConfig
from tasks.config.schema import JobConfig
from tasks.inputs.node import REPORT_DIR, SPEC_VAR, describe, forwarded_env, node_spec
from tasks.launch import torchrun
from tasks.launch.base import Job, Launcher
from tasks.launch.logs import FileTail, LineSink
from tasks.launch.procs import TAG_VAR
from tasks.launch.shell import per_node_line
from tasks.launch.spec import JobSpec, LaunchOptions
from tasks.runs.identity import RunIdentity

log = logging.getLogger(__name__)

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
# Ends the cluster caused: the job is not at fault and resumes from its checkpoint when started again. A
# CANCELLED job we did not cancel stands for preemption too (an admin's scancel, a preemptor with GraceTime).
PREEMPTED = {"PREEMPTED", "NODE_FAIL", "CANCELLED", "BOOT_FAIL"}
_FIELD = re.compile(r"(\w+)=(\S*)")
# What `scontrol show job` says of a job the controller no longer holds.
_PURGED = "Invalid job id"
UNKNOWN = "UNKNOWN"  # the controller did not answer: asked again at the next poll
# sbatch runs that may fail on the way to the controller (signals, timeouts, a restarting slurmctld), and the
# pause before the next (times the try's number).
SUBMIT_TRIES, SUBMIT_BACKOFF_S = 3, 2.0
_TRANSIENT = ("Socket timed out", "Unable to contact slurm controller", "Connection refused", "Zero Bytes",
              "Resource temporarily unavailable", "temporarily unable")


def _transient(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether a failed sbatch died on the way (a signal, the controller unreachable or busy), not on the script."""
    return done.returncode < 0 or any(text in done.stderr for text in _TRANSIENT)


def job_name(cfg: JobConfig, spec: JobSpec) -> str:
    """The Slurm job name of one rank job (a training's: `retrainer-<config>-<run id>`): how a later attempt
    finds (and cancels) a job an earlier one left."""
    return f"retrainer-{cfg.name}-{spec.name}"


def render_script(cfg: JobConfig, slurm: SlurmConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, *,
                  warm: bool = False, evaluation: bool = False) -> str:
    """The batch script of the job `spec` names, writing into its directory: (with `warm`) a staging step per
    node, then one `tasks.base.spawn` per node, node rank and master from Slurm."""
    nodes = slurm.nodes
    cmd = torchrun.node_command(cfg, dataset_dir, config_json, nnodes=nodes, node_rank=0, python=slurm.python,
                                evaluation=evaluation)
    line = per_node_line(cmd, node_rank="$SLURM_NODEID", master_addr="$RETRAINER_MASTER_ADDR")
    out = spec.output_dir
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name(cfg, spec)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={out}/slurm-%j.out",
        f"#SBATCH --time={slurm.time_limit}",
    ]
    if cfg.cluster.partition:
        lines.append(f"#SBATCH --partition={cfg.cluster.partition}")
    if slurm.qos:
        lines.append(f"#SBATCH --qos={slurm.qos}")
    if slurm.job_priority:
        lines.append(f"#SBATCH --priority={max(cfg.schedule.priority, 0)}")
    if slurm.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={slurm.gpus_per_node}")
    lines += [f"#SBATCH {arg}" for arg in slurm.sbatch_args]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(slurm.workdir)}",
        'RETRAINER_MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "export RETRAINER_MASTER_ADDR",
        'echo "retrainer: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $RETRAINER_MASTER_ADDR"',
    ]
    if warm:
        stage = (f"NODE_NAME=$(hostname) exec {shlex.quote(slurm.python)} -m tasks.inputs.node "
                 f"--report-dir {shlex.quote(str(out / REPORT_DIR))} --status-dir {shlex.quote(str(out))}")
        lines += [f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node=1 bash -c {shlex.quote(stage)}",
                  f"unset {SPEC_VAR}"]
    lines += [
        f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node=1 bash -c {shlex.quote(line)}",
        "",
    ]
    return "\n".join(lines)


class SlurmJob(Job):
    """One submitted allocation; its status file is on the output dir (Slurm needs it shared: the job's
    output file is there too)."""

    def __init__(self, launcher: SlurmLauncher, job_id: str, output: Path, status_path: Path, *,
                 tail: bool = True) -> None:
        self.launcher, self.job_id, self.status_path = launcher, job_id, status_path
        self.sink = LineSink(logging.getLogger("tasks.launch.ranks"), prefix=f"[slurm {job_id}] ")
        self.tail = FileTail(output, self.sink) if tail else None
        self._stopped = False
        self._rc: int | None = None
        self._state: str | None = None  # the state it ended in

    def handle(self) -> dict[str, str]:
        return {"job_id": self.job_id}

    def preempted(self) -> bool:
        """Seen ending PREEMPTED, NODE_FAIL, or CANCELLED by someone else (by poll(), before any stop of ours)."""
        return self._state in PREEMPTED

    def close(self) -> None:
        if self.tail is not None:
            self.tail.stop()

    def status(self) -> Status | None:
        return read_status(self.status_path)

    def rank_failure(self) -> RankFailure | None:
        return self.sink.rank_failure

    def poll(self) -> int | None:
        if self._rc is not None:
            return self._rc
        state, rc = self.launcher.state(self.job_id)
        if state not in ENDED and state != "GONE":
            return None
        self._state, self._rc = state, 0 if state == "COMPLETED" else (rc or 1)
        log.info("slurm job %s ended: %s (exit %s)", self.job_id, state, self._rc)
        return self._rc

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.launcher.cancel(self.job_id)
        finally:
            self.close()


class SlurmLauncher(Launcher):
    """Submits the allocation `cluster.slurm` describes; `env` also reaches the Slurm client calls (SLURM_CONF)."""

    name = "slurm"
    poll_interval_s = 1.0

    warms_nodes = True

    def __init__(self, section: SlurmConfig, *, env: dict[str, str] | None = None) -> None:
        self.section, self.env = section, dict(env or {})

    def slurm(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60)
        if check and done.returncode != 0:
            raise RetrainerError(f"{cmd[0]} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return done

    def state(self, job_id: str) -> tuple[str, int]:
        """(JobState, exit status) as Slurm reports them; ('GONE', 1) once the record is purged; ('UNKNOWN', 0)
        while the controller does not answer (busy, restarting): the job is not taken for ended on a timeout."""
        done = self.slurm("scontrol", "show", "job", "-o", job_id, check=False)
        fields = dict(_FIELD.findall(done.stdout))
        if done.returncode != 0 or "JobState" not in fields:
            if _PURGED in done.stderr or done.returncode == 0:
                return "GONE", 1
            log.warning("slurm: scontrol show job %s failed (%s): %s", job_id, done.returncode,
                        done.stderr.strip()[-300:])
            return UNKNOWN, 0
        code, _, sig = fields.get("ExitCode", "1:0").partition(":")
        rc = int(code) if code.isdigit() else 1
        if sig not in ("", "0") and rc == 0:
            rc = 128 + int(sig) if sig.isdigit() else 1
        return fields["JobState"], rc

    def cancel(self, job_id: str) -> None:
        """scancel (if still running) and wait until the job ended and is no longer COMPLETING: every node
        has reaped the step."""
        state, _ = self.state(job_id)
        if state not in ENDED and state != "GONE":
            log.warning("slurm: scancel %s (state %s)", job_id, state)
            self.slurm("scancel", job_id, check=False)
        deadline = time.monotonic() + self.section.cancel_timeout_s
        while True:
            state, _ = self.state(job_id)
            if state in ENDED or state == "GONE":
                return
            if time.monotonic() > deadline:
                raise RetrainerError(f"slurm job {job_id} still {state} {self.section.cancel_timeout_s:.0f}s after "
                                     "scancel; check the nodes")
            time.sleep(0.5)

    def jobs_named(self, name: str) -> list[str]:
        """The ids of the jobs called `name` that Slurm still lists (pending, running or completing)."""
        return self.slurm("squeue", "-h", "--name", name, "-o", "%i", check=True).stdout.split()

    def sbatch(self, script: Path, env: dict[str, str], name: str) -> str:
        """sbatch `script` (its job called `name`): the job id. A submission that failed on the way (sbatch killed
        by a signal, the controller timing out) is tried again, `SUBMIT_TRIES` in all, unless Slurm lists a new
        job of that name: sbatch died after the controller queued it, and that job is taken, never a second."""
        before = set(self.jobs_named(name))
        for attempt in range(1, SUBMIT_TRIES + 1):
            done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env,
                                  timeout=60)
            if done.returncode == 0:
                job_id = done.stdout.strip().split(";")[0]
                if not job_id.isdigit():
                    raise RetrainerError(f"sbatch returned no job id: {done.stdout.strip()!r}")
                return job_id
            failure = f"sbatch {script} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
            try:
                queued = [job_id for job_id in self.jobs_named(name) if job_id not in before]
            except RetrainerError as exc:  # a later attempt's cancel_earlier finds such a job by its name
                raise RetrainerError(f"{failure}; whether it queued the job is unknown: {exc}") from None
            if queued:
                log.warning("slurm: %s, but job %s (%s) was queued: following it", failure, queued[-1], name)
                return queued[-1]
            if attempt == SUBMIT_TRIES or not _transient(done):
                raise RetrainerError(failure)
            log.warning("slurm: %s; submitting again (try %d of %d)", failure, attempt + 1, SUBMIT_TRIES)
            time.sleep(SUBMIT_BACKOFF_S * attempt)
        raise AssertionError("unreachable")

    def cancel_earlier(self, cfg: JobConfig, spec: JobSpec) -> None:
        name = job_name(cfg, spec)
        for job_id in self.jobs_named(name):
            log.warning("slurm: job %s (%s) is still alive from an earlier attempt: cancelling it "
                        "before launching", job_id, name)
            self.cancel(job_id)

    detachable = True

    def attach(self, handle: Mapping[str, Any], *, output: bool = False) -> Job:
        out = JobSpec.from_handle(handle).output_dir
        return SlurmJob(self, handle["job_id"], out / f"slurm-{handle['job_id']}.out", out / STATUS_FILE,
                        tail=output)

    def node_reports(self, spec: JobSpec) -> list[dict[str, object]]:
        reports = [json.loads(p.read_text()) for p in sorted((spec.output_dir / REPORT_DIR).glob("*.json"))]
        for report in reports:
            log.info("slurm: %s", describe(report))
        return reports

    def prepare(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, options: LaunchOptions) -> None:
        render_script(cfg, self.section, spec, dataset_dir, Path("config.json"))  # validates the node split

    def start(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
              run: RunIdentity, options: LaunchOptions) -> Job:
        out = spec.output_dir
        script = out / "slurm-job.sbatch"
        script_text = render_script(cfg, self.section, spec, dataset_dir, config_json, warm=options.node_warm,
                                    evaluation=options.evaluating)
        atomic_write_bytes(script, script_text.encode())
        env = torchrun.rank_env({**self.env, **options.secret_env, TAG_VAR: tag}, evaluation=options.evaluating)
        if options.node_warm:  # in sbatch's environment only (never in the script): it may hold credentials
            shutil.rmtree(out / REPORT_DIR, ignore_errors=True)
            env = {**env, **forwarded_env(), SPEC_VAR: json.dumps(node_spec(cfg, run, out))}
        job_id = self.sbatch(script, env, job_name(cfg, spec))
        atomic_write_bytes(out / "slurm-job-id", f"{job_id}\n".encode())
        log.info("slurm: submitted job %s (%s); output %s", job_id, script, out / f"slurm-{job_id}.out")
        return SlurmJob(self, job_id, out / f"slurm-{job_id}.out", out / STATUS_FILE)
