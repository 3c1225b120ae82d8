"""The local launcher (torchrun here): SIGTERM mid-training leaves no rank behind, although torchrun puts
every rank in its own session."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.launch.conftest import tiny_config, write_dataset
from tests.launch.helpers import launched, training_processes, wait_for_step

pytestmark = pytest.mark.multiproc


def test_sigterm_to_local_launcher_leaves_no_rank(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    cfg = tiny_config(tmp_path, {"parallel.dp": 2, "train.steps": 200}, out="local")
    with launched(cfg, dataset, {"RETRAINER_FAULT_STEP_DELAY_S": "0.3"}, tmp_path / "l.log") as launcher:
        wait_for_step(cfg.train.output_dir, 2, launcher)
        running = training_processes(cfg.train.output_dir)
        assert len(running) >= 3  # torchrun + 2 ranks
        assert len({p.pid for p in running if "tasks.train.worker" in p.cmdline()}) >= 2
        launcher.send_signal(signal.SIGTERM)
        rc = launcher.wait(timeout=120)
    log = (tmp_path / "l.log").read_text()
    assert rc == 143, log[-3000:]
    assert training_processes(cfg.train.output_dir) == []
    assert not (Path(cfg.train.output_dir) / "summary.json").exists()
