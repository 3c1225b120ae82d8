"""Secrets handed to a job through the environment (S3 keys, the registry's DB password, expanded into
the config at load) never appear in task logs, stage outputs, run files or registry records."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import yaml

from tasks.data.synthetic import make_data
from tests.faults.conftest import Trained, driver, metrics_file, run_task, task_env
from tests.services import S3Endpoint


def test_secrets_never_reach_logs_or_summaries(
    trained: Trained, tmp_path: Path, pg_url: str, s3: S3Endpoint, s3_bucket: str
) -> None:
    db_password = f"dbpw-{secrets.token_hex(8)}"
    s3_key, s3_secret = f"AKIA{secrets.token_hex(8).upper()}", f"s3sk-{secrets.token_hex(16)}"
    env = task_env(FAULT_DB_PASSWORD=db_password, FAULT_S3_KEY=s3_key, FAULT_S3_SECRET=s3_secret)
    secret_values = [db_password, s3_key, s3_secret]

    # Publish to PostgreSQL with a password in the registry URL (trust auth accepts and ignores it).
    url = pg_url.replace("postgres@", "postgres:${FAULT_DB_PASSWORD}@", 1)
    job = trained.job_for(tmp_path, url)
    state = trained.state_for(tmp_path)
    argv = [*driver(job, state, "publish"), "--metrics", str(metrics_file(tmp_path, state))]
    rc, out = run_task(argv, tmp_path / "publish.log", env)
    assert rc == 0, out[-3000:]
    rc, out = run_task(driver(job, state, "rollback"), tmp_path / "rollback.log", env)  # nothing to roll back to
    assert rc != 0 and "nothing to roll back to" in out, out[-3000:]

    # Warm from S3 with the access key and secret taken from the environment.
    make_data(f"s3://{s3_bucket}/tiny", name="tiny-llama", n_train_shards=2, tokens_per_shard=4096,
              storage_options=s3.storage_options)
    cfg = yaml.safe_load(job.config.read_text())
    cfg["data"].update(source_url=f"s3://{s3_bucket}/tiny", cache_dir=str(tmp_path / "cache"),
                       storage_options={"key": "${FAULT_S3_KEY}", "secret": "${FAULT_S3_SECRET}",
                                        "client_kwargs": {"endpoint_url": s3.endpoint_url}})
    s3_config = tmp_path / "s3-job.yaml"
    s3_config.write_text(yaml.safe_dump(cfg))
    rc, out = run_task([str(s3_config), str(tmp_path / "s3-state"), "plan", "warm"], tmp_path / "warm.log", env)
    assert rc == 0, out[-3000:]

    registry_dump = json.dumps(job.registry().show("tiny-llama"), default=str)
    places = {p: p.read_text(errors="replace") for p in tmp_path.rglob("*")
              if p.is_file() and p.suffix in (".log", ".json", ".jsonl")}
    places[Path("registry show")] = registry_dump
    assert len(places) >= 6
    for where, text in places.items():
        for value in secret_values:
            assert value not in text, f"secret leaked into {where}"
    assert "publish" in places[tmp_path / "publish.log"]  # the logs checked are the real ones
