"""SIGKILL the task process in the middle of evaluate: the re-run scores the checkpoint exactly as an
uninterrupted evaluate does, and evaluate -> gate -> publish publishes exactly one version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.conftest import TaskProcess, Trained, driver, processes_mentioning, read_json, run_task, task_env


def test_sigkill_during_evaluate_then_rerun_publishes_once_with_the_same_metrics(
    trained: Trained, tmp_path: Path, no_leftovers: None
) -> None:
    # The reference: an uninterrupted evaluate of the same checkpoint on the same data.
    (tmp_path / "ref").mkdir()
    ref_state = trained.state_for(tmp_path / "ref")
    rc, out = run_task(driver(trained.job, ref_state, "evaluate"), tmp_path / "evaluate-ref.log")
    assert rc == 0, out[-3000:]
    reference = read_json(ref_state / "evaluate.json")

    job = trained.job_for(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    state = trained.state_for(tmp_path)
    task = TaskProcess(driver(job, state, "evaluate", "gate", "publish"), tmp_path / "evaluate-1.log",
                       task_env(HOOK_EVAL_DELAY_S="5"))
    # The evaluation ranks are up (warmed, weights loaded); the kill lands in their 5 s pause before a batch.
    task.wait_for(lambda: "before batch 1" in task.text(), "the evaluation ranks' first batch", timeout=180)
    task.sigkill()
    assert processes_mentioning(str(tmp_path)) == []
    assert not any((state / f"{s}.json").exists() for s in ("evaluate", "gate", "publish"))
    from tasks.registry.errors import NotFoundError

    with pytest.raises(NotFoundError):  # nothing published by the killed attempt
        job.registry().list_versions("tiny-llama")

    # The re-run of evaluate -> gate -> publish (an Airflow retry), then publish re-run once more.
    for attempt, stages in ((2, ("evaluate", "gate", "publish")), (3, ("publish",))):
        rc, out = run_task(driver(job, state, *stages), tmp_path / f"evaluate-{attempt}.log")
        assert rc == 0, out[-3000:]
    metrics = read_json(state / "evaluate.json")
    assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-9)
    assert metrics["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-9)
    for key in ("tokens", "checkpoint_tag", "step", "experiment_key"):
        assert metrics[key] == reference[key], key

    registry = job.registry()
    versions = registry.list_versions("tiny-llama")
    assert [v.version for v in versions] == [1]
    assert versions[0].metrics["loss"] == pytest.approx(reference["loss"])
    assert registry.live_version("tiny-llama", "production").version == 1
    assert [(h.from_version, h.to_version) for h in registry.history("tiny-llama", "production")] == [(None, 1)]
