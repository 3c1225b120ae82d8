"""`retrainer plan` exit codes: 0 fits, 3 does not fit, 2 invalid input with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tasks.cli.plan import main

ROOT = REPO_ROOT
DEMO = ROOT / "configs" / "tiny-llama.yaml"


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
    assert "plan tiny-llama" in out and "optimizer_states" in out and "229,952 total (model family llama)" in out


def test_the_demo_config_plans_without_a_warning() -> None:
    """`retrainer plan configs/tiny-llama.yaml`, the README's first look at the planner: its hardware is the
    CPU ranks it runs on, so nothing to warn about (no communication share against a GPU's compute)."""
    done = subprocess.run([sys.executable, "-m", "tasks.cli", "plan", str(DEMO)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "plan tiny-llama: FITS " in done.stdout, done.stdout
    assert "warning" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr


def test_json_output_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DEMO), "--json", "--device", "cpu", "--serve-concurrency", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["params_total"] == 229952 and doc["model_family"] == "llama"
    assert set(doc["memory"]) >= {"weights", "gradients", "optimizer_states", "activations", "comm_buffers", "total"}
    assert doc["serving"]["concurrency"] == 4 and doc["assumptions"]


def test_does_not_fit_exits_3_naming_the_term(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path, model={"vocab_size": 50304, "seq_len": 2048, "n_layers": 32, "d_model": 4096,
                                  "n_heads": 32, "n_kv_heads": 32, "d_ff": 16384},
                 cluster={"gpu_memory_gib": 24}, parallel={"dp": 1})
    assert main([str(cfg), "--device", "gpu"]) == 3
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "does not fit" in captured.err


def test_search_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DEMO), "--search", "4", "--device", "gpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] > 0 and all(p["fits"] for p in doc["plans"])
    huge = _write(tmp_path, model={"vocab_size": 50304, "seq_len": 2048, "n_layers": 8, "d_model": 8192,
                                   "n_heads": 64, "n_kv_heads": 64}, cluster={"gpu_memory_gib": 1})
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
        ([], {"cluster": {"gpu_memory_gib": -1}}, "cluster.gpu_memory_gib"),
        (["--serve-context", "-5"], {}, "serving.context_len"),
        (["--serve-dtype", "fp8"], {}, "serving.dtype"),
        ([], {"serving": {"concurrency": 0}}, "serving.concurrency"),
        (["--search", "0"], {}, "--search"),
    ],
)
def test_invalid_input_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], sections: dict, reason: str
) -> None:
    cfg = _write(tmp_path, **sections)
    assert main([str(cfg), "--device", "cpu", *args]) == 2
    assert reason in capsys.readouterr().err


@pytest.mark.parametrize(("old", "new"), [
    ("gpu_memory_gb", "cluster.gpu_memory_gib (GiB per GPU)"),
    ("intra_node_gbps", "cluster.intra_node_gbytes_per_s (GB/s per GPU inside a node)"),
    ("inter_node_gbps", "cluster.inter_node_gbytes_per_s (GB/s per node between nodes), or inter_node_gbits_per_s"),
])
def test_old_unit_names_are_refused_with_the_new_name(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      old: str, new: str) -> None:
    assert main([str(_write(tmp_path, cluster={old: 10}))]) == 2
    assert f"cluster.{old} was renamed to {new}" in capsys.readouterr().err


def test_inter_node_bandwidth_takes_one_unit_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = _write(tmp_path, cluster={"inter_node_gbytes_per_s": 50, "inter_node_gbits_per_s": 400})
    assert main([str(both)]) == 2
    err = capsys.readouterr().err
    assert "cluster.inter_node_gbytes_per_s" in err and "cluster.inter_node_gbits_per_s" in err


def test_serving_section_sizes_the_estimate_and_flags_override_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path, serving={"concurrency": 3, "context_len": 32, "dtype": "fp32"})
    assert main([str(cfg), "--json", "--device", "cpu"]) == 0
    serving = json.loads(capsys.readouterr().out)["serving"]
    # KV per token: 4 layers x 2 kv heads x 16 head dim x 2 (K, V) x 4 B (fp32) = 1024
    assert (serving["concurrency"], serving["context"], serving["dtype"]) == (3, 32, "fp32")
    assert serving["kv_cache_bytes"] == 1024 * 3 * 32 and serving["weights_bytes"] == 4 * 229952
    assert main([str(cfg), "--json", "--device", "cpu", "--serve-concurrency", "5", "--serve-dtype", "bf16"]) == 0
    serving = json.loads(capsys.readouterr().out)["serving"]
    assert (serving["concurrency"], serving["context"], serving["dtype"]) == (5, 32, "bf16")


MHA = {"n_kv_heads": 4}  # tp=4 needs 4 kv heads; the demo has 2 (GQA)
TWO_SSH_HOSTS = {"launcher": "ssh", "hosts": ["10.0.0.1", "10.0.0.2"], "master_addr": "10.0.0.1"}


@pytest.mark.parametrize(("cluster", "parallel", "reason"), [
    (TWO_SSH_HOSTS, {"dp": 8}, "parallel.tp x pp x dp = 8 but cluster.hosts (2) x cluster.gpus_per_node (8) = 16"),
    ({"launcher": "slurm", "slurm": {"nodes": 4}, "nproc_per_node": 2}, {"dp": 4},
     "parallel.tp x pp x dp = 4 but cluster.slurm.nodes (4) x cluster.nproc_per_node (2) = 8"),
    ({"launcher": "kubernetes", "kubernetes": {"nodes": 3}, "gpus_per_node": 1}, {"dp": 2},
     "parallel.tp x pp x dp = 2 but cluster.kubernetes.nodes (3) x cluster.gpus_per_node (1) = 3"),
    ({"gpus_per_node": 1}, {"dp": 2}, "parallel.tp x pp x dp = 2 but cluster.launcher local runs 1 node of at most "
                                      "cluster.gpus_per_node (1) ranks"),
    ({"nproc_per_node": 4}, {"dp": 2}, "parallel.tp x pp x dp = 2 but cluster.launcher local (1 node) x "
                                       "cluster.nproc_per_node (4) = 4"),
    ({"launcher": "slurm", "slurm": {"nodes": 2}, "gpus_per_node": 2}, {"tp": 4, "dp": 1, "model": MHA},
     "parallel.tp (4) must fit inside one node: it must divide cluster.gpus_per_node (2)"),
])
def test_layout_that_the_cluster_cannot_run_exits_2_naming_the_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cluster: dict, parallel: dict, reason: str
) -> None:
    layout, model = {k: v for k, v in parallel.items() if k != "model"}, parallel.get("model", {})
    assert main([str(_write(tmp_path, cluster=cluster, parallel=layout, model=model)), "--device", "gpu"]) == 2
    assert reason in capsys.readouterr().err


@pytest.mark.parametrize(("cluster", "parallel"), [
    (TWO_SSH_HOSTS, {"dp": 16}),
    ({**TWO_SSH_HOSTS, "nproc_per_node": 2}, {"dp": 4}),
    ({"launcher": "slurm", "slurm": {"nodes": 2}, "gpus_per_node": 2}, {"tp": 2, "dp": 2}),
    ({"launcher": "kubernetes", "kubernetes": {"nodes": 2}, "gpus_per_node": 4}, {"tp": 4, "dp": 2, "model": MHA}),
    ({}, {"dp": 8}),  # local: up to gpus_per_node ranks on this machine
])
def test_layout_that_fills_the_cluster_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str], cluster: dict,
                                             parallel: dict) -> None:
    layout, model = {k: v for k, v in parallel.items() if k != "model"}, parallel.get("model", {})
    assert main([str(_write(tmp_path, cluster=cluster, parallel=layout, model=model)), "--device", "gpu"]) == 0


LLAMA_70B = {"family": "llama", "vocab_size": 128256, "seq_len": 8192, "n_layers": 80, "d_model": 8192,
             "n_heads": 64, "n_kv_heads": 8, "d_ff": 28672}
LLAMA_70B_ON_32_GPUS = {"tp": 8, "pp": 2, "dp": 2, "zero_stage": 1, "micro_batches": 16}


@pytest.mark.parametrize(("cluster", "device"), [
    ({"launcher": "slurm", "slurm": {"nodes": 4, "gpus_per_node": 8}}, "gpu"),
    ({"launcher": "kubernetes", "kubernetes": {"nodes": 4}}, "gpu"),  # unset: one GPU per rank
    ({"launcher": "kubernetes", "kubernetes": {"nodes": 4, "gpus_per_node": 0}}, "cpu"),
    ({**TWO_SSH_HOSTS, "device": "gpu", "nproc_per_node": 16}, "gpu"),
    ({"launcher": "slurm", "slurm": {"nodes": 4, "gpus_per_node": 8}, "device": "cpu"}, "cpu"),
])
def test_the_plan_is_for_the_ranks_devices_not_the_planning_machines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cluster: dict, device: str) -> None:
    """The plan stage runs where Airflow runs it, mostly a machine without a GPU, and calls the planner with no
    device (as here): a Slurm or Kubernetes GPU job is still planned for GPUs, by what the engine section asks
    for or `cluster.device`. Planned for CPU ranks instead, Llama 70B on 32 GPUs was refused: the host's process
    memory (the tensors plus the checkpoint snapshot, 95 GiB) held against the GPU's 80 GiB, and precision auto
    read as fp32."""
    cfg = _write(tmp_path, model={**LLAMA_70B, "rope_theta": 500000.0}, parallel=LLAMA_70B_ON_32_GPUS,
                 train={"micro_batch_size": 1, "activation_checkpointing": True},
                 cluster={"gpus_per_node": 8, "gpu_memory_gib": 80, **cluster})
    code = main([str(cfg), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["precision"] == ("bf16" if device == "gpu" else "fp32")
    assert (code, doc["fits"]) == ((0, True) if device == "gpu" else (3, False)), doc["memory"]
    memory = doc["memory"]
    if device == "gpu":  # the device holds the tensors, the host the runtime and the save's snapshot
        assert memory["total"] < 80 * 2**30 and memory["process_phase"] == "saving"
        assert memory["process_peak"] == memory["process_runtime"] + memory["checkpoint_snapshot"]
    else:
        assert memory["process_phase"] == "training + snapshot" and memory["process_peak"] > 80 * 2**30


def test_a_node_without_the_host_memory_for_its_ranks_saves_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 70B on four 8-GPU Slurm nodes fits each GPU (62 GiB of 80), but every save copies each rank's model
    states to host memory: ~33 GiB a rank, ~266 GiB a node. A node of 256 GiB would be OOM-killed at the first
    save, hours in: the plan says so before the launch, naming the field; 512 GiB fits."""
    def planned(host_gib: int) -> tuple[int, str]:
        cfg = _write(tmp_path, model={**LLAMA_70B, "rope_theta": 500000.0}, parallel=LLAMA_70B_ON_32_GPUS,
                     train={"micro_batch_size": 1, "activation_checkpointing": True},
                     cluster={"launcher": "slurm", "slurm": {"nodes": 4, "gpus_per_node": 8}, "gpus_per_node": 8,
                              "host_memory_gib": host_gib})
        code = main([str(cfg)])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    code, text = planned(256)
    assert code == 3 and "host memory per node (its ranks' process peaks together): 265.68 GiB of 256.00 GiB" in text
    assert "retrainer: plan does not fit: 9.68 GiB over cluster.host_memory_gib (256.00 GiB) on a node" in text
    assert planned(512)[0] == 0


def test_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_module_entry_point_runs_as_a_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tasks.cli.plan", str(DEMO), "--tp", "3"], cwd=ROOT, env=env,
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


def test_retrainer_plan_plans_a_chat_dataset_as_the_plan_stage_does(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`retrainer plan CONFIG` reads data.source_url's manifest: a chat dataset's packed windows add their position
    ids and document masks to the activations, as the run's plan stage counts them, the evaluation ranks' too, and
    every rank's index of its windows to its process memory."""
    from tasks.base.dataset_format import PlannedData
    from tasks.cli import main as retrainer
    from tasks.data.manifest import read_manifest
    from tasks.models.resolve import load_config
    from tasks.plan import plan
    from tests.chat import LLAMA3
    from tests.train.test_packed import chat_dataset

    config = _write(tmp_path, data={"source_url": str(chat_dataset(tmp_path, LLAMA3, 8))}, model={"vocab_size": 512})
    assert retrainer(["plan", str(config), "--json", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    job = load_config(config)
    shape = read_manifest(str(tmp_path / "ds")).split_shape("train", job.model.seq_len)
    data = PlannedData(packed=True, train_index_bytes=shape.index_bytes(sampled=True))
    packed, plain = plan(job, device="cpu", data=data), plan(job, device="cpu")
    assert doc["memory"]["data_index"] == packed.memory.data_index == shape.index_bytes(sampled=True) > 0
    assert doc["memory"]["activations"] == packed.memory.activations > plain.memory.activations
    assert packed.evaluation is not None and plain.evaluation is not None
    assert doc["evaluation"]["activations"] == packed.evaluation["activations"] > plain.evaluation["activations"]
