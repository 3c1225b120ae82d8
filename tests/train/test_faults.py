"""Fault tests with real torchrun/gloo ranks: SIGKILL of one rank, crash inside a checkpoint commit, NaN.

Both crash tests resume and must end on weights bitwise identical to an unbroken
run of the same experiment (dropout on), which covers RNG states, data position,
optimizer and LR scheduler.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tasks.base.errors import InvalidInputError, TrainingFailedError
from tasks.base.job_status import STATUS_FILE, read_status
from tasks.base.spawn import FORKED_RANK_NAME
from tasks.config.schema import JobConfig
from tasks.launch import JobSpec, torchrun, train
from tasks.models.weights import weights_digest
from tasks.runs.identity import RunIdentity, for_dataset
from tasks.train import checkpoint as ck
from tests.train.conftest import tiny_config, write_dataset

pytestmark = pytest.mark.multiproc

EXPERIMENT = {"parallel.dp": 2, "train.steps": 6, "train.checkpoint_every": 3, "train.keep_last": 3,
              "model.dropout": 0.1}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """An unbroken run of the experiment: (tmp root, dataset dir, summary)."""
    root = tmp_path_factory.mktemp("straight")
    dataset = write_dataset(root / "dataset")
    summary = train(tiny_config(root, EXPERIMENT, out="straight"), dataset)
    return root, dataset, summary


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _rank_of(pid: int) -> int | None:
    """The rank a process of the node is: a forked rank is named `rank N` (tasks/base/spawn.py), one started as a
    process of its own has RANK in its environment."""
    try:
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if name.startswith(FORKED_RANK_NAME):
        return int(name.removeprefix(FORKED_RANK_NAME))
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _start(cfg: JobConfig, dataset: Path, run: RunIdentity | None = None,
           init_path: Path | None = None) -> subprocess.Popen[bytes]:
    """The node command of the hooked worker (see the `hooked` fixture), outside any launcher: one rank can die."""
    out = Path(cfg.train.output_dir)
    run = run or for_dataset(cfg, dataset)
    cmd = torchrun.node_command(cfg, dataset, torchrun.write_worker_config(
        cfg, JobSpec(run.run_id, out), run, init_path))
    log = open(out / "torchrun.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, env=torchrun.rank_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(cond: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _reap(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_a_rank_after_step_3(cfg: JobConfig, dataset: Path, hooked: Callable[..., None],
                             run: RunIdentity | None = None, init_path: Path | None = None) -> None:
    """Start the hooked node command (a second per step), SIGKILL rank 1 once the step-3 checkpoint is
    committed; the node failed and `latest` names step 3. The caller drops the step delay (monkeypatch) before
    it resumes."""
    ckroot = ck.ckpt_root(cfg.train.output_dir)
    Path(cfg.train.output_dir).mkdir(parents=True)
    hooked(HOOK_STEP_DELAY_S="1.0")
    proc = _start(cfg, dataset, run, init_path)
    try:
        _wait_for(lambda: (ckroot / ck.LATEST).exists(), proc, "the step-3 checkpoint")
        os.kill({_rank_of(pid): pid for pid in _children(proc.pid)}[1], signal.SIGKILL)
    finally:
        rc = _reap(proc)
    assert rc != 0 and ck.read_latest(ckroot) == "step-000003"


def _assert_same_final_weights(summary: dict, reference: dict) -> None:
    assert summary["losses"] == reference["losses"]
    m = tiny_config(Path(summary["checkpoint_dir"]), EXPERIMENT).model
    assert weights_digest(summary["checkpoint_dir"], m) == weights_digest(reference["checkpoint_dir"], m)


def test_sigkill_one_rank_then_resume_is_bitwise_exact(straight, hooked, monkeypatch) -> None:
    """The step-3 checkpoint is written slowly while step 4 trains: a CPU rank's snapshot writes its optimizer
    states from the live tensors (tasks/train/async_save.py), so step 4's optimizer step must wait for the write,
    or the checkpoint would hold step 4's states and the resumed run would not end where the unbroken one did."""
    root, dataset, reference = straight
    cfg = tiny_config(root, EXPERIMENT, out="killed")
    hooked(HOOK_CKPT_WRITE_DELAY="3:1")
    kill_a_rank_after_step_3(cfg, dataset, hooked)
    assert not (Path(cfg.train.output_dir) / "summary.json").exists()

    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    monkeypatch.delenv("HOOK_CKPT_WRITE_DELAY")
    resumed = train(cfg, dataset)
    assert resumed["resumed_from_step"] == 3
    _assert_same_final_weights(resumed, reference)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, RunIdentity, dict]:
    """An unbroken run of the experiment on a mixture (this week's data + 25% replay of an older snapshot),
    both warmed into one cache as the warm stage does: (tmp root, primary dataset dir, identity, summary)."""
    from tasks.data.synthetic import make_data
    from tasks.data.warm import warm_mixture

    root = tmp_path_factory.mktemp("mixture")
    new, old = root / "snap-new", root / "snap-old"
    make_data(str(new), name="tiny-test", seed=1, n_train_shards=2, tokens_per_shard=8192)
    make_data(str(old), name="tiny-test", seed=2, n_train_shards=1, tokens_per_shard=8192)
    cfg = tiny_config(root, {**EXPERIMENT, "data.source_url": str(new),
                             "data.replay": [{"source_url": str(old), "weight": 0.25}]}, out="straight")
    primary, replay = warm_mixture(cfg, progress=False)
    run = for_dataset(cfg, primary.dataset_dir, [replay.dataset_dir])
    assert [r.weight for r in run.replay] == [0.25] and run.replay[0].manifest_hash == replay.manifest_hash
    return root, primary.dataset_dir, run, train(cfg, primary.dataset_dir, run=run)


def test_sigkill_then_resume_on_a_mixture_is_bitwise_exact(mixture, hooked, monkeypatch) -> None:
    """Each source's stream position is a function of the step: the resumed run draws what the unbroken one
    drew from both snapshots, to the same losses and the same final weights."""
    root, dataset, run, reference = mixture
    cfg = tiny_config(root, {**EXPERIMENT, "data.source_url": str(root / "snap-new"),
                             "data.replay": [{"source_url": str(root / "snap-old"), "weight": 0.25}]}, out="killed")
    kill_a_rank_after_step_3(cfg, dataset, hooked, run)
    assert f"+ replay {root / 'snap-old'} (" in (Path(cfg.train.output_dir) / "torchrun.log").read_text()

    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    resumed = train(cfg, dataset, run=run)
    assert resumed["resumed_from_step"] == 3
    assert resumed["run"]["replay"] == reference["run"]["replay"] == [
        {"url": str(root / "snap-old"), "manifest_hash": run.replay[0].manifest_hash, "weight": 0.25}]
    _assert_same_final_weights(resumed, reference)


def test_crash_inside_checkpoint_commit_keeps_previous_latest(straight, hooked, monkeypatch) -> None:
    root, dataset, reference = straight
    cfg = tiny_config(root, EXPERIMENT, out="crashed")
    ckroot = ck.ckpt_root(cfg.train.output_dir)
    Path(cfg.train.output_dir).mkdir(parents=True)
    tmp = ckroot / "tmp-step-000006"
    hooked(HOOK_CKPT_DELAY="6:120")
    proc = _start(cfg, dataset)
    try:  # rank 0 writes its rank state, then pauses before the marker and the rename
        _wait_for(lambda: ck.rank_file(tmp, 0).exists(), proc, "the step-6 checkpoint files")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        _reap(proc)
    assert ck.read_latest(ckroot) == "step-000003"
    assert tmp.is_dir() and not (tmp / ck.MARKER).exists() and not (ckroot / "step-000006").exists()
    with pytest.raises(InvalidInputError, match="not a complete checkpoint"):
        ck.validate_checkpoint_dir(tmp, cfg.fingerprint())

    monkeypatch.delenv("HOOK_CKPT_DELAY")
    resumed = train(cfg, dataset)
    assert resumed["resumed_from_step"] == 3
    assert not tmp.exists()  # swept, never loaded
    _assert_same_final_weights(resumed, reference)


def test_sigkill_during_a_slow_background_save_resumes_from_the_previous_checkpoint(straight, hooked,
                                                                                      monkeypatch) -> None:
    """Saves every 2 steps; the step-4 save writes slowly in the background while training goes on into step 5,
    whose optimizer step waits for the write (a CPU rank: its ZeRO step buffers and the snapshot share the host
    memory); a kill then leaves step 2 as `latest`, and the rerun ends bitwise where the unbroken run did."""
    root, dataset, reference = straight
    cfg = tiny_config(root, {**EXPERIMENT, "train.checkpoint_every": 2}, out="async-killed")
    out = Path(cfg.train.output_dir)
    ckroot = ck.ckpt_root(out)
    out.mkdir(parents=True)
    hooked(HOOK_CKPT_WRITE_DELAY="4:120")
    proc = _start(cfg, dataset)
    try:
        log = out / "torchrun.log"
        _wait_for(lambda: _status_step(out) >= 4 and log.exists() and "slowly (" in log.read_text(), proc,
                  "step 4's snapshot being written")
        assert ck.read_latest(ckroot) == "step-000002" and (ckroot / "tmp-step-000004").is_dir()
        assert _status_step(out) == 4  # step 5 waits for the snapshot before its optimizer step
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        _reap(proc)
    assert ck.read_latest(ckroot) == "step-000002" and not (ckroot / "step-000004").exists()

    monkeypatch.delenv("HOOK_CKPT_WRITE_DELAY")
    resumed = train(cfg, dataset)
    assert resumed["resumed_from_step"] == 2
    _assert_same_final_weights(resumed, reference)
    saves = resumed["checkpoint_saves"]  # the stall per save is reported next to the whole save's time
    assert [s["tag"] for s in saves] == ["step-000004", "step-000006"]
    assert all(0 < s["stall_s"] <= s["seconds"] for s in saves)
    assert "training blocked" in (out / "torchrun.log").read_text()


def test_background_save_error_fails_the_run_naming_it(make_config, dataset_dir: Path, hooked) -> None:
    cfg = make_config({"parallel.dp": 2, "train.steps": 6, "train.checkpoint_every": 2})
    hooked(HOOK_CKPT_WRITE_ERROR="4:1")
    with pytest.raises(TrainingFailedError, match=r"checkpoint step-000004 write failed on rank 1: .*No space left"):
        train(cfg, dataset_dir)
    out = Path(cfg.train.output_dir)
    assert not (out / "summary.json").exists()
    assert ck.read_latest(ck.ckpt_root(out)) == "step-000002"


def test_a_cpu_step_waits_for_the_snapshot_before_its_optimizer_step(make_config, dataset_dir: Path,
                                                                     hooked) -> None:
    """The step-2 save writes slowly: step 3 trains its forward and backward passes, then waits for the write
    before its gradients are reduced (the snapshot never meets ZeRO's step buffers in host memory, as the plan
    counts: tasks/plan/process.py), and says so in its telemetry; the run ends with both checkpoints."""
    cfg = make_config({"parallel.dp": 2, "train.steps": 4, "train.checkpoint_every": 2})
    hooked(HOOK_CKPT_WRITE_DELAY="2:1")
    summary = train(cfg, dataset_dir)
    out = Path(cfg.train.output_dir)
    rows = {r["step"]: r for r in map(json.loads, (out / "telemetry.jsonl").read_text().splitlines())}
    assert rows[3]["snapshot_wait_s"] > 0 and rows[3]["step_s"] >= rows[3]["snapshot_wait_s"]
    assert rows[3]["snapshot_wait_s"] > 10 * max(rows[1]["snapshot_wait_s"], rows[2]["snapshot_wait_s"])
    assert [s["tag"] for s in summary["checkpoint_saves"]] == ["step-000002", "step-000004"]
    assert ck.read_latest(ck.ckpt_root(out)) == "step-000004"


def _status_step(out: Path) -> int:
    status = read_status(out / STATUS_FILE)
    return status.step if status is not None else 0


def test_checkpoint_from_another_model_is_refused(straight) -> None:
    root, dataset, reference = straight
    other = tiny_config(root, {**EXPERIMENT, "train.lr": 1e-3}, out="straight")  # same dir, other experiment
    with pytest.raises(TrainingFailedError, match="checkpoint from another model"):
        train(other, dataset)
    with pytest.raises(InvalidInputError, match="checkpoint from another model"):
        ck.find_resume(ck.ckpt_root(other.train.output_dir), for_dataset(other, dataset))
    assert json.loads((Path(reference["checkpoint_dir"]) / ck.MARKER).read_text())["step"] == 6


def test_nan_at_step_fails_naming_the_step(make_config, dataset_dir: Path, hooked) -> None:
    cfg = make_config({"parallel.dp": 2, "train.steps": 5, "train.checkpoint_every": 2})
    hooked(HOOK_NAN_AT_STEP="3")
    with pytest.raises(TrainingFailedError, match="non-finite loss at step 3"):
        train(cfg, dataset_dir)
    out = Path(cfg.train.output_dir)
    assert not (out / "summary.json").exists()
    assert ck.read_latest(ck.ckpt_root(out)) == "step-000002"
    rows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def _processes_with(marker: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_sigterm_to_the_cli_stops_every_rank(make_config, dataset_dir: Path, tmp_path: Path) -> None:
    """What Airflow does on a task timeout: SIGTERM the `retrainer train` process; no rank may survive."""
    cfg = make_config({"parallel.dp": 2, "train.steps": 50, "train.checkpoint_every": 1})
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    marker = f"HOOK_RUN_MARKER={uuid.uuid4().hex}"  # a HOOK_ variable: the hooks forward it to the ranks
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOOK_STEP_DELAY_S": "0.5",
           marker.split("=")[0]: marker.split("=")[1]}
    cli = subprocess.Popen([sys.executable, "-m", "tests.hooks.cli", "train", str(config_path),
                            "--dataset-dir", str(dataset_dir)], env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        latest = ck.ckpt_root(cfg.train.output_dir) / ck.LATEST
        _wait_for(latest.exists, cli, "the first checkpoint")
        assert len(_processes_with(marker.encode())) >= 4  # cli, torchrun, 2 ranks
        cli.send_signal(signal.SIGTERM)
        rc = cli.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cli.pid, signal.SIGKILL)
        cli.wait()
    assert rc == 143  # LaunchCancelled: the launcher cancelled the job on SIGTERM
    deadline = time.monotonic() + 10
    while _processes_with(marker.encode()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker.encode()) == []
    assert not (Path(cfg.train.output_dir) / "summary.json").exists()


PACKED = {**EXPERIMENT, "model.vocab_size": 512, "model.seq_len": 128, "train.micro_batch_size": 2}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """An unbroken run of the experiment on a chat dataset (packed conversations, assistant-token loss):
    (tmp root, dataset dir, summary)."""
    from tests.chat import LLAMA3
    from tests.train.test_packed import chat_dataset

    root = tmp_path_factory.mktemp("packed")
    dataset = chat_dataset(root, LLAMA3, 60)
    return root, dataset, train(tiny_config(root, {**PACKED, "data.source_url": str(dataset)}, out="straight"),
                                dataset)


def test_sigkill_then_resume_on_packed_conversations_is_bitwise_exact(packed, hooked, monkeypatch) -> None:
    """The packed windows, their documents and the global batch's assistant-token count are functions of the
    step: the resumed run trains on what the unbroken one did, to the same losses and final weights."""
    root, dataset, reference = packed
    cfg = tiny_config(root, {**PACKED, "data.source_url": str(dataset)}, out="killed")
    kill_a_rank_after_step_3(cfg, dataset, hooked)

    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    resumed = train(cfg, dataset)
    assert resumed["resumed_from_step"] == 3
    rows = [json.loads(line) for line in Path(resumed["telemetry_path"]).read_text().splitlines()]
    assert [r["step"] for r in rows][-3:] == [4, 5, 6] and all(r["trained_tokens"] > 0 for r in rows[-3:])
    _assert_same_final_weights(resumed, reference)


EXPERT_PARALLEL = {**{k: v for k, v in EXPERIMENT.items() if k != "model.dropout"},  # the family has none
                   "model.family": "qwen3_moe", "model.qk_norm": True, "model.num_experts": 4,
                   "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16,
                   "model.router_aux_loss_coef": 0.01, "parallel.ep": 2, "parallel.micro_batches": 2}


def test_sigkill_then_resume_at_ep2_is_bitwise_exact(dataset_dir: Path, tmp_path: Path, hooked, monkeypatch) -> None:
    """Each expert-parallel rank's experts and their optimizer partitions are saved and loaded by that rank:
    the resumed run reaches the unbroken run's losses and final weights bit for bit. The same checkpoint resumed
    on twice the replicas (dp 2 -> 4, ep 2: the experts' partitions cut anew over their own ranks) trains on to
    the same losses; resumed at another ep it is refused, naming the axis, before any rank starts."""
    straight = train(tiny_config(tmp_path, EXPERT_PARALLEL, out="straight"), dataset_dir)
    cfg = tiny_config(tmp_path, EXPERT_PARALLEL, out="killed")
    kill_a_rank_after_step_3(cfg, dataset_dir, hooked)
    files = {p.name for p in (ck.ckpt_root(cfg.train.output_dir) / "step-000003").iterdir()}
    assert {"layer_02-model_00-experts_00-model_states.pt", "layer_02-model_00-experts_01-model_states.pt"} <= files
    shutil.copytree(cfg.train.output_dir, tmp_path / "grown")

    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    with pytest.raises(InvalidInputError, match="ep=2 -> 1"):
        train(tiny_config(tmp_path, {**EXPERT_PARALLEL, "parallel.ep": 1}, out="killed"), dataset_dir)
    resumed = train(cfg, dataset_dir)
    assert resumed["resumed_from_step"] == 3 and resumed["layout"]["ep"] == 2
    assert resumed["losses"] == straight["losses"]
    assert weights_digest(resumed["checkpoint_dir"], cfg.model) == weights_digest(straight["checkpoint_dir"], cfg.model)

    grown = train(tiny_config(tmp_path, {**EXPERT_PARALLEL, "parallel.dp": 4, "parallel.micro_batches": 1},
                              out="grown"), dataset_dir)
    assert grown["resharded"] == {"from_dp": 2, "to_dp": 4, "at_step": 3} and grown["layout"]["ep"] == 2
    for step, (got, want) in enumerate(zip(grown["losses"], straight["losses"], strict=True), start=1):
        assert abs(got - want) <= 1e-6, f"step {step}: resumed at dp=4 {got} vs unbroken dp=2 {want}"
