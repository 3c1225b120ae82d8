"""Publish under faults, on a real PostgreSQL registry: SIGKILL between version insert and pointer
switch, the server restarted mid-publish, and a storm of concurrent publishes and rollbacks."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

from tests.faults.conftest import (
    Job,
    TaskProcess,
    Trained,
    driver,
    metrics_file,
    read_json,
    run_task,
    task_env,
)
from tests.services import PgCluster


def chain(job: Job) -> list[tuple[int | None, int]]:
    return [(h.from_version, h.to_version) for h in job.registry().history("tiny-llama", "production")]


def assert_consistent(job: Job) -> None:
    """Every pointer names an existing version whose artifact is in the store, bytes intact."""
    import sqlalchemy as sa

    from tasks.registry import ArtifactStore

    engine = sa.create_engine(job.registry_url, poolclass=sa.NullPool)
    try:
        if not sa.inspect(engine).get_table_names():
            return  # failed before the schema was even created: nothing written at all
    finally:
        engine.dispose()
    registry = job.registry()
    versions = {v.version: v for v in registry.list_versions("tiny-llama")}
    live = registry.live_version("tiny-llama", "production")
    if live is not None:
        assert live.version in versions
    history = chain(job)
    for (_, to), (frm, _) in itertools.pairwise(history):
        assert frm == to, f"history is not one chain: {history}"
    if history:
        assert live is not None and history[-1][1] == live.version
    store = ArtifactStore(job.data["publish"]["store_url"], {})
    for version in versions.values():  # every byte verified on read
        assert version.artifact_kind == "tree"
        out = store.get_tree(version.artifact_digest, job.tmp / f"check-v{version.version}")
        shutil.rmtree(out)


def restart(cluster: PgCluster) -> None:
    """pg_ctl restart -m fast, with pg_ctl's own words if it fails."""
    try:
        cluster.restart()
    except subprocess.CalledProcessError as exc:
        raise AssertionError(f"pg_ctl restart failed: {exc.stdout!r} {exc.stderr!r}") from None


def test_sigkill_between_version_insert_and_pointer_switch(
    trained: Trained, tmp_path: Path, pg_url: str, no_leftovers: None
) -> None:
    job, state = trained.job_for(tmp_path, pg_url), trained.state_for(tmp_path)
    argv = [*driver(job, state, "publish"), "--metrics", str(metrics_file(tmp_path, state))]

    task = TaskProcess(argv, tmp_path / "publish-1.log", task_env(HOOK_PUBLISH_BLOCK="after_version_insert"))
    task.wait_for(lambda: "blocking after the version insert" in task.text(), "the version insert")
    task.sigkill()
    registry = job.registry()
    assert [v.version for v in registry.list_versions("tiny-llama")] == [1]  # an unpointed version: harmless
    assert registry.live_version("tiny-llama", "production") is None
    assert chain(job) == []

    rc, out = run_task(argv, tmp_path / "publish-2.log")  # the retry
    assert rc == 0, out[-3000:]
    result = read_json(state / "publish.json")
    assert (result["version"], result["created"], result["switched"]) == (1, False, True)
    rc, out = run_task(argv, tmp_path / "publish-3.log")  # and a re-run of a finished publish
    assert rc == 0, out[-3000:]
    assert read_json(state / "publish.json")["switched"] is False

    assert [v.version for v in registry.list_versions("tiny-llama")] == [1]
    assert registry.live_version("tiny-llama", "production").version == 1
    assert chain(job) == [(None, 1)]
    assert_consistent(job)


def test_postgres_restart_during_publish_fails_cleanly_or_completes_and_retry_succeeds(
    trained: Trained, tmp_path: Path, pg_cluster: PgCluster, pg_url: str, no_leftovers: None
) -> None:
    job, state = trained.job_for(tmp_path, pg_url), trained.state_for(tmp_path)
    argv = [*driver(job, state, "publish"), "--metrics", str(metrics_file(tmp_path, state))]

    task = TaskProcess(argv, tmp_path / "publish-1.log")
    # As soon as the publish stage starts (its first query comes next), restart the server under it.
    task.wait_for(lambda: "stage publish starts" in task.text(), "publish to start")
    restart(pg_cluster)
    rc = task.finish(timeout=300)
    first = task.text()
    if rc != 0:  # a clean failure: the connection error is reported, no result was recorded
        assert "OperationalError" in first or "retrainer: error:" in first, first[-3000:]
        assert not (state / "publish.json").exists()
    assert_consistent(job)  # whatever happened, nothing half-written

    rc, out = run_task(argv, tmp_path / "publish-2.log")  # the retry Airflow would make
    assert rc == 0, out[-3000:]
    registry = job.registry()
    assert [v.version for v in registry.list_versions("tiny-llama")] == [1]
    assert registry.live_version("tiny-llama", "production").version == 1
    assert chain(job) == [(None, 1)]
    assert_consistent(job)


def test_concurrent_publish_and_rollback_storm_keeps_one_history_chain(
    trained: Trained, tmp_path: Path, pg_url: str, no_leftovers: None
) -> None:
    """Six task processes at once: publishes of two checkpoints and rollbacks, all on one alias."""
    job = trained.job_for(tmp_path, pg_url)
    metrics = metrics_file(tmp_path, trained.state)
    argvs = []
    for i, tag in enumerate(["step-000002", "step-000004", "step-000002", "step-000004"]):
        state = tmp_path / f"state-{i}"
        state.mkdir()
        for name in ("plan", "warm"):  # the run that trained these checkpoints (its identity and data)
            (state / f"{name}.json").write_text((trained.state / f"{name}.json").read_text())
        summary = read_json(trained.state / "train.json")
        summary["checkpoint_dir"] = str(Path(summary["checkpoint_dir"]).parent / tag)
        (state / "train.json").write_text(json.dumps(summary))
        argvs.append([*driver(job, state, "publish"), "--metrics", str(metrics)])
    argvs += [driver(job, tmp_path / f"state-rb{i}", "rollback") for i in range(2)]

    # Seed: v1 live, so the rollbacks have somewhere to go from the first moment.
    rc, out = run_task(argvs[0], tmp_path / "seed.log")
    assert rc == 0, out[-3000:]
    tasks = [TaskProcess(argv, tmp_path / f"storm-{i}.log") for i, argv in enumerate(argvs)]
    time.sleep(0.1)
    outcomes = [(t.finish(timeout=300), t.text()) for t in tasks]
    for rc, text in outcomes:
        assert "Traceback" not in text, text[-3000:]
        assert rc == 0 or "retrainer: error:" in text, text[-3000:]
    assert sum(rc == 0 for rc, _ in outcomes) >= 2

    registry = job.registry()
    assert sorted(v.version for v in registry.list_versions("tiny-llama")) == [1, 2]  # two checkpoints, two versions
    history = chain(job)
    assert history[0] == (None, 1)
    assert_consistent(job)
