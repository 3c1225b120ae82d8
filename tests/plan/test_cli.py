"""`retrainer plan` exit codes: 0 fits, 3 does not fit, 2 invalid input with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.plan.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "tiny-gpt.yaml"


def _write(tmp_path: Path, **sections: dict) -> Path:
    data = yaml.safe_load(DEMO.read_text())
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_demo_config_fits_and_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DEMO), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "plan tiny-gpt" in out and "optimizer_states" in out and "236,928" in out


def test_json_output_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DEMO), "--json", "--device", "cpu", "--serve-concurrency", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["params_total"] == 236928
    assert set(doc["memory"]) >= {"weights", "gradients", "optimizer_states", "activations", "comm_buffers", "total"}
    assert doc["serving"]["concurrency"] == 4 and doc["assumptions"]


def test_does_not_fit_exits_3_naming_the_term(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path, model={"vocab_size": 50304, "seq_len": 2048, "n_layers": 32, "d_model": 4096,
                                  "n_heads": 32, "n_kv_heads": 32, "d_ff": 16384},
                 cluster={"gpu_memory_gb": 24}, parallel={"dp": 1})
    assert main([str(cfg), "--device", "gpu"]) == 3
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "does not fit" in captured.err


def test_search_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DEMO), "--search", "4", "--device", "gpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] > 0 and all(p["fits"] for p in doc["plans"])
    huge = _write(tmp_path, model={"vocab_size": 50304, "seq_len": 2048, "n_layers": 8, "d_model": 8192,
                                   "n_heads": 64, "n_kv_heads": 64}, cluster={"gpu_memory_gb": 1})
    assert main([str(huge), "--search", "2", "--device", "gpu"]) == 3


@pytest.mark.parametrize(
    ("args", "sections", "reason"),
    [
        (["--tp", "3"], {}, "parallel.tp (3) must divide model.n_heads"),
        (["--pp", "9"], {}, "parallel.pp (9) cannot exceed model.n_layers (4)"),
        (["--gpus", "4"], {}, "does not match the GPU count 4"),
        (["--dp", "-1"], {}, "parallel.dp"),
        (["--micro-batch", "0"], {}, "train.micro_batch_size"),
        ([], {"model": {"d_model": -64}}, "model.d_model"),
        ([], {"cluster": {"gpu_memory_gb": -1}}, "cluster.gpu_memory_gb"),
        (["--serve-context", "-5"], {}, "serving context"),
        (["--search", "0"], {}, "--search"),
    ],
)
def test_invalid_input_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], sections: dict, reason: str
) -> None:
    cfg = _write(tmp_path, **sections)
    assert main([str(cfg), "--device", "cpu", *args]) == 2
    assert reason in capsys.readouterr().err


def test_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_module_entry_point_runs_as_a_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tasks.plan", str(DEMO), "--tp", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "parallel.tp (3)" in proc.stderr


def test_retrainer_cli_maps_plan_exit_codes(tmp_path: Path) -> None:
    """Through the project's `retrainer` entry point (all verbs registered), not just the plan module."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([sys.executable, "-m", "tasks.cli", "plan", str(DEMO), "--device", "cpu", "--json"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and json.loads(ok.stdout)["fits"] is True
    bad = subprocess.run([sys.executable, "-m", "tasks.cli", "plan", str(DEMO), "--gpus", "3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not match the GPU count 3" in bad.stderr
