"""The local launcher (`tasks.base.spawn` here): SIGTERM mid-training leaves no rank behind."""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path

import pytest

from tests.launch.conftest import tiny_config, write_dataset
from tests.launch.helpers import is_rank, launched, source_line, training_processes, wait_for_step

pytestmark = pytest.mark.multiproc


def test_sigterm_to_local_launcher_leaves_no_rank(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"parallel.dp": 2, "train.steps": 200}, out="local")
    with launched(cfg, dataset, {"HOOK_STEP_DELAY_S": "0.3"}, tmp_path / "l.log") as launcher:
        wait_for_step(cfg.train.output_dir, 2, launcher)
        running = training_processes(cfg.train.output_dir)
        assert len(running) >= 3  # the spawner + 2 ranks
        assert len({p.pid for p in running if is_rank(p)}) >= 2
        launcher.send_signal(signal.SIGTERM)
        rc = launcher.wait(timeout=120)
    log = (tmp_path / "l.log").read_text()
    assert rc == 143, log[-3000:]
    assert training_processes(cfg.train.output_dir) == []
    assert not (Path(cfg.train.output_dir) / "summary.json").exists()


def test_supervision_reads_the_status_file_not_the_log_text(tmp_path: Path, hooked, caplog) -> None:
    """Every worker log line reworded (HOOK_REWORD_LOGS): the failure reason and hang detection still come
    through, because launchers read the run's status file, never the log text. The relayed rank lines
    keep their level (a rank's WARNING is a WARNING in the task log), carry no second timestamp, and
    DeepSpeed's start-up chatter ("Using topology") stays out of it."""
    from tasks.base.errors import TrainingFailedError
    from tasks.launch import train

    dataset = write_dataset(tmp_path / "dataset")
    nan = tiny_config(tmp_path, {"parallel.dp": 2, "train.steps": 5, "train.checkpoint_every": 2}, out="nan")
    hooked(HOOK_REWORD_LOGS="1", HOOK_NAN_AT_STEP="3", HOOK_CKPT_DELAY="2:0")  # the hook warns at step 2's commit
    with caplog.at_level(logging.INFO, logger="tasks.launch.ranks"), \
            pytest.raises(TrainingFailedError, match=r"non-finite loss at step 3"):
        train(nan, dataset)
    relayed = [r for r in caplog.records if r.name == "tasks.launch.ranks"]
    warned = [r for r in relayed if "inside the commit of step 2" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING], [r.getMessage() for r in relayed]
    assert all(r.getMessage().startswith("[rank ") for r in warned), [r.getMessage() for r in warned]
    assert any(r.levelno == logging.ERROR and "[rank " in r.getMessage() for r in relayed)  # the failure itself
    assert not [r for r in relayed if "Using topology" in r.getMessage()]
    ranks = [r.getMessage() for r in relayed if r.getMessage().startswith("[rank ")]  # not the spawner's own report
    assert ranks and not [m for m in ranks if re.search(r"\d\d:\d\d:\d\d", m)], ranks

    hung = tiny_config(tmp_path, {"train.steps": 50, "cluster.hang_timeout_s": 4, "cluster.startup_timeout_s": 300},
                       out="hung")
    # Each step (and the start) is followed by a 10 s pause: step 1 comes within the startup allowance, the
    # pause after it outlasts hang_timeout_s.
    hooked(HOOK_REWORD_LOGS="1", HOOK_NAN_AT_STEP="0", HOOK_STEP_DELAY_S="10")  # step 1, then a stall
    with pytest.raises(TrainingFailedError, match=r"hung .*last finished step 1\b"):
        train(hung, dataset)
    assert training_processes(hung.train.output_dir) == []


def test_a_ranks_unexpected_exception_reaches_the_cli_error_line(tmp_path: Path) -> None:
    """The last rank's input at step 2 holds a token id past the vocabulary (tests/hooks): its embedding raises
    IndexError. `retrainer train` fails with one error line naming the rank, the exception, its message and
    the line of our code it came from (not torch's), never a bare exit status; the log carries the traceback
    once, at ERROR."""
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"parallel.dp": 2, "train.steps": 4}, out="crash")
    with launched(cfg, dataset, {"HOOK_BAD_TOKEN_AT": "2:1"}, tmp_path / "l.log") as launcher:
        rc = launcher.wait(timeout=300)
    log = (tmp_path / "l.log").read_text()
    assert rc == 1, log[-3000:]
    where = source_line("tasks/models/gpt/model.py", "self.drop(self.tok(tokens)")
    error = log.splitlines()[-1]
    assert re.fullmatch(r"retrainer: error: training of tiny-test failed \(local launcher\): rank 1 failed: "
                        rf"IndexError: index out of range in self \({re.escape(where)} on \S+\)", error), log[-3000:]
    assert "exit status" not in log and "exited with code" not in log
    assert log.count("Traceback (most recent call last)") == 1
    logged = log[log.index("ERROR tasks.launch.base: rank 1 failed: IndexError"):]
    assert logged.index("Traceback (most recent call last)") < logged.index(error)  # the traceback, with the error
    assert training_processes(cfg.train.output_dir) == []


def test_a_run_planned_for_other_devices_than_the_nodes_is_refused_by_its_ranks(tmp_path: Path) -> None:
    """`cluster.device` (or a Slurm / Kubernetes GPU request) is what the run was planned for; a node that is not
    that (here: a GPU run on this CPU machine, or a CPU run on a GPU machine) is refused by every rank before its
    process group, naming the field and the node, instead of training in another precision than planned."""
    import socket

    import torch

    from tasks.base.errors import TrainingFailedError
    from tasks.launch import train

    have, planned = ("gpu", "cpu") if torch.cuda.is_available() else ("cpu", "gpu")
    found = "has CUDA devices, which the ranks would train on" if have == "gpu" else "has no CUDA device"
    cfg = tiny_config(tmp_path, {"parallel.dp": 2, "train.steps": 2, "cluster.device": planned}, out="device")
    with pytest.raises(TrainingFailedError, match=re.escape(
            f"cluster.device: the run was planned for {planned} ranks but this node ({socket.gethostname()}) "
            f"{found}")):
        train(cfg, write_dataset(tmp_path / "dataset"))
    assert not (Path(cfg.train.output_dir) / "ckpt").exists() and training_processes(cfg.train.output_dir) == []
