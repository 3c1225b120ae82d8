"""The registry verbs through the real `retrainer` entry point: output, --json and exit codes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml

from tasks.config.schema import JobConfig
from tasks.registry.schema import HEAD
from tests.registry.conftest import make_checkpoint


def test_cli_lifecycle(
    registry_url: str, cli: Callable[..., tuple[int, str, str]], job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    db = ["--db", registry_url]
    rc, out, _ = cli("db", "upgrade", *db, "--json")
    assert rc == 0 and json.loads(out)["current"] == HEAD
    assert cli("db", "upgrade", *db)[1].startswith(f"schema already at {HEAD}")

    cfg = job_config(registry_url)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"loss": 1.5}))
    checkpoints = []
    for seed, tag in enumerate(("step-10", "step-20")):
        checkpoints.append(ckpt := make_checkpoint(tmp_path / "ckpt", cfg, tag, seed=seed))
        rc, out, err = cli("publish", str(config_file), "--checkpoint", str(ckpt), "--metrics", str(metrics), "--json")
        assert rc == 0, err
        assert json.loads(out)["version"] == seed + 1

    # A promotion past the gate (forced: this test's checkpoints were never evaluated) needs a reason.
    rc, out, err = cli("promote", str(config_file), "--version", "1", "--force")
    assert rc == 2 and "reason: a forced promotion onto 'production' (past its gate) needs a reason" in err
    rc, out, _ = cli("promote", str(config_file), "--version", "1", "--force", "--reason", "hotfix", "--actor", "ops",
                     "--json")
    assert rc == 0 and json.loads(out)["from_version"] == 2
    rc, out, _ = cli("rollback", "--model", "tiny-llama", *db)
    assert rc == 0 and "version 1 -> version 2" in out
    rc, out, err = cli("promote", str(config_file), "--version", "9")
    assert rc == 2 and "has no version 9" in err
    rc, out, err = cli("rollback", "--model", "tiny-llama", "--alias", "staging", *db)
    assert rc == 1 and "nothing to roll back" in err
    rc, out, err = cli("rollback", "--model", "tiny-llama", "--expect", "abc", *db)
    assert rc == 2 and "--expect" in err

    rc, out, _ = cli("registry", "history", "--model", "tiny-llama", *db, "--json")
    hist = json.loads(out)
    assert [(h["action"], h["from_version"], h["to_version"]) for h in hist] == [
        ("publish", None, 1), ("publish", 1, 2), ("promote", 2, 1), ("rollback", 1, 2)]
    assert hist[2]["actor"] == "ops" and hist[2]["reason"] == "hotfix; gate skipped (forced)"
    rc, out, _ = cli("registry", "history", "--model", "tiny-llama", *db)
    assert out.splitlines()[0].split() == ["ALIAS", "SEQ", "ACTION", "FROM", "TO", "ACTOR", "AT", "REASON"]
    assert len(out.splitlines()) == 5
    rc, out, _ = cli("registry", "show", "--model", "tiny-llama", *db, "--json")
    info = json.loads(out)
    assert info["aliases"]["production"]["version"] == 2 and len(info["versions"]) == 2
    assert all("created" not in v and v["parent_version"] is None for v in info["versions"])
    # The `rollback` above moved production away from v1: v1 is marked, and an automatic publish of
    # v1's checkpoint cannot put it back (an explicit promote could).
    assert info["versions"][0]["rolled_back_from"]["production"]["to_version"] == 2
    assert info["versions"][1]["rolled_back_from"] == {}
    rc, out, err = cli("publish", str(config_file), "--checkpoint", str(checkpoints[0]), "--metrics", str(metrics))
    assert rc == 1 and "version 1 was rolled back from it" in err
    rc, out, _ = cli("registry", "show", "--model", "tiny-llama", *db)
    assert "production -> 2" in out and "rolled back from production" in out
    # The numbers a person compares are columns, not cut-off JSON; --json has each version's whole record.
    lines = out.splitlines()
    head = lines.index("versions:") + 1
    assert lines[head].split()[:5] == ["VERSION", "FROM", "LOSS", "PERPLEXITY", "GATE"]
    assert [line.split()[:5] for line in lines[head + 1:head + 3]] == [["1", "scratch", "1.5000", "-", "-"],
                                                                      ["2", "scratch", "1.5000", "-", "-"]]
    assert "{" not in out
    assert info["versions"][0]["config"] == cfg.model_dump(mode="json") and info["versions"][0]["started_from"] == (
        "scratch")
    rc, out, _ = cli("registry", "models", *db, "--json")
    assert json.loads(out) == [{"model": "tiny-llama", "versions": 2, "aliases": {"production": 2}}]
    rc, out, err = cli("registry", "show", "--model", "nope", *db)
    assert rc == 2 and "'nope' is not in the registry" in err

    # Rolling back again from v2 would redo the rollback of v1: refused, saying why; v1 comes back only forced.
    rc, out, err = cli("rollback", "--model", "tiny-llama", *db)
    assert rc == 1 and "every version live on it before version 2 was rolled back from it (v1 by " in err, err
    for refused in (("rollback", "--model", "tiny-llama", "--to", "1", *db),
                    ("promote", str(config_file), "--version", "1")):
        rc, out, err = cli(*refused)
        assert rc == 1 and "version 1 was rolled back from it by " in err and "--force" in err, err
    rc, out, err = cli("rollback", "--model", "tiny-llama", "--to", "1", "--force", "--reason", "v1 retested fine",
                       "--actor", "ops", *db, "--json")
    assert rc == 0, err
    forced = json.loads(out)
    assert [forced[k] for k in ("action", "from_version", "to_version", "actor")] == ["rollback", 2, 1, "ops"]
    assert forced["reason"].startswith("v1 retested fine [forced: v1 had been rolled back from production by ")
    assert json.loads(cli("registry", "history", "--model", "tiny-llama", *db, "--json")[1])[-1] == {
        **forced, "to_parent_version": None}


def test_cli_default_db_under_retrainer_home(
    cli: Callable[..., tuple[int, str, str]], tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    assert cli("db", "upgrade")[0] == 0
    rc, out, _ = cli("registry", "models", "--json")
    assert rc == 0 and json.loads(out) == []
    assert (tmp_path / "home" / "registry.db").is_file()
