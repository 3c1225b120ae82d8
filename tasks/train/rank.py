"""What every rank program (training, evaluation) does around its work: a quiet start-up, joining the job's
process group, the failure it reports (a known reason in the status file; any failure, expected or not, in the
error file `tasks.base.spawn` named for it: tasks/base/rank_failure.py), an orderly end, and an exit without
interpreter teardown.

Why one place: tasks/train/worker.py and tasks/evaluate/worker.py are both started by `tasks.base.spawn` under
the same launchers, which supervise them through the status file; the two must start and end the same way.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist

from tasks.base import rank_failure
from tasks.base.comm_ops import load_shm_op
from tasks.base.errors import InvalidInputError
from tasks.base.job_status import Status, now, write_status
from tasks.config.schema import RankCluster

log = logging.getLogger(__name__)


@contextlib.contextmanager
def deepspeed_prints_to_debug():
    """DeepSpeed prints its start-up chatter (topology, layer lists, op builds) to stdout: keep it at DEBUG."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            log.debug("deepspeed: %s", line)


@contextlib.contextmanager
def _mlflow_hidden() -> Iterator[None]:
    """MLflow unimportable for the duration: DeepSpeed's autotuner (imported by its runtime config, so by any
    DeepSpeed import) imports MLflow when it is installed, 2.9 s and ~100 MiB of RSS in every rank for a tool
    the ranks never run (a LoRA rank peaked 100 MiB over its plan in CI). Rank 0's tracker imports it later,
    when a run asks for MLflow."""
    if "mlflow" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        yield
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


def quiet_start_up() -> None:
    """Before DeepSpeed is imported: name the accelerator (no "Setting accelerator to CPU" warning on
    every rank), import DeepSpeed without MLflow, and drop the deprecation noise torch and DeepSpeed print
    at start-up. DeepSpeed's own logger prints to stdout with its own time and level in brackets: its
    records go through ours instead (one time per line in the task log, the level where the relay reads it).
    The launchers start every rank program through tasks/train/start.py, which calls this before the program's
    module (which imports DeepSpeed) is imported."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    with _mlflow_hidden():
        from deepspeed.utils import logger as deepspeed_log  # imports DeepSpeed: after DS_ACCELERATOR

    for handler in list(deepspeed_log.handlers):
        deepspeed_log.removeHandler(handler)
    deepspeed_log.propagate = True
    deepspeed_log.setLevel(logging.WARNING)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


# How long a rank other than 0 looks for rank 0's rendezvous store before leaving the wait to torch's own connect.
RENDEZVOUS_PROBE_S = 30.0


def join_process_group(cluster: RankCluster) -> None:
    """This rank's device started, DeepSpeed's CPU comm op loaded and the job's process group joined (DeepSpeed's
    comm too), as every rank program starts."""
    import deepspeed

    backend = start_device(cluster)
    load_shm_op()  # before init_distributed loads it: never waits on a dead loader's lock
    wait_for_rendezvous_store(RENDEZVOUS_PROBE_S)
    with deepspeed_prints_to_debug():
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=cluster.hang_timeout_s))


def wait_for_rendezvous_store(timeout_s: float) -> None:
    """A rank other than 0 waits until rank 0's store listens at MASTER_ADDR:MASTER_PORT, at most `timeout_s`.
    Why: torch's store client that finds no listener tries again only after a random backoff, 0.4-0.7 s here,
    and the ranks of a node reach the rendezvous within milliseconds of each other, so about every other launch
    paid it (an evaluation's process group took 0.42-0.8 s instead of 0.02). The probe's connection closes at
    once; the store takes it for a client that left. Polls every 5 ms at first, every 100 ms after a second
    (a pod's master address may not resolve yet: 64 ranks must not flood the cluster's DNS). Without the
    rendezvous in its environment (every launcher sets it) there is nothing to wait for: torch reports it."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if int(os.environ.get("RANK", "0")) == 0 or not addr or not port:
        return
    address = (addr, int(port))
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection(address, timeout=1.0):
                return
        except OSError:
            waited = time.monotonic() - start
            if waited > timeout_s:
                return  # torch's own connect waits on and reports what it finds
            time.sleep(min(0.005 + waited / 10, 0.1))


def start_device(cluster: RankCluster) -> str:
    """This rank's device and its process-group backend ("nccl" on CUDA, "gloo" on CPU), after refusing a node
    that is not what the run was planned for (`cluster.planned_device`): a GPU job landing on a node without a
    GPU would otherwise train in fp32 on its CPU, planned for memory it does not have."""
    on_gpu = torch.cuda.is_available()
    if cluster.planned_device is not None and (cluster.planned_device[0] == "gpu") != on_gpu:
        planned, field = cluster.planned_device
        found = "has CUDA devices, which the ranks would train on" if on_gpu else "has no CUDA device"
        raise InvalidInputError(f"{field}: the run was planned for {planned} ranks but this node "
                                f"({socket.gethostname()}) {found}")
    if on_gpu:  # before the first NCCL collective
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return "nccl" if on_gpu else "gloo"


def report_failure(output_dir: str | Path, exc: Exception, *, step: int, steps: int) -> int:
    """Any rank that knows why its job failed says so in the status file (an atomic replace: a concurrent
    writer's reason is as true), and records it for its spawner (the status file of a rank on another
    node's own disk reaches no launcher); returns the rank's exit code."""
    write_status(output_dir, Status(state="failed", step=step, steps=steps, at=now(), reason=str(exc),
                                    rank=int(os.environ.get("RANK", "0"))))
    rank_failure.record(exc)
    return 1


def finish() -> int:
    """The orderly end of a rank that succeeded: wait for every rank, then leave the process group on NCCL (its
    communicators released in order). A gloo rank leaves its groups to its exit, which follows at once
    (`exit_without_teardown`) and closes their sockets: destroying them cost an evaluation rank of the 300M
    benchmark 0.05-0.14 s (measured in the ranks), 1-3% of its evaluation on CPU."""
    tdist.barrier()
    if tdist.get_backend() != "gloo":
        tdist.destroy_process_group()
    return 0


def exit_without_teardown(run: Callable[[], int]) -> None:
    """Run a rank's `main` and leave without interpreter teardown: by then its outputs are fsynced and the
    process group is destroyed, and tearing down torch/DeepSpeed's C++ state still aborted a rank now
    and then on CPU ("terminate called without an active exception", SIGABRT, seen under load).

    An exception nobody caught is recorded for the spawner, which reports it to the launcher (the rank
    prints it only when it runs without one): the person reads which rank failed, how and where."""
    try:
        code = run()
    except Exception as exc:
        if not rank_failure.record(exc):
            traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
