"""Only `retrainer db upgrade` migrates (but a blank embedded SQLite file, created on first use); every other
command checks the revision once and says what to do.

Through the real entry point in its own process (`python -m tasks.cli`): the output a user sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from tasks.config.schema import JobConfig
from tasks.registry import ArtifactRef, Lineage, Registry, SchemaVersionError, upgrade
from tasks.registry.schema import HEAD
from tests.registry.conftest import ROOT, make_checkpoint

LINEAGE = Lineage("cfg", "data", "rev", "step-10")


def retrainer(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RETRAINER_DB_URL", None)
    return subprocess.run([sys.executable, "-m", "tasks.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


def _seed(url: str) -> None:
    with Registry(url) as reg:
        reg.publish_version("m", ArtifactRef("ab" * 32, "file:///s/sha256/ab/x", 3), LINEAGE, {"loss": 1.0}, "ci")


def test_commands_print_no_alembic_lines_even_at_first_use(registry_url: str) -> None:
    first = retrainer("db", "upgrade", "--db", registry_url)
    assert first.returncode == 0, first.stderr
    revisions = sorted(f.name[:4] for f in (ROOT / "sql" / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert revisions[:6] == ["0001", "0002", "0003", "0004", "0005", "0006"]
    assert first.stdout.strip() == f"applied: {', '.join(revisions)}"
    _seed(registry_url)
    for argv in (("registry", "show", "--model", "m"), ("registry", "history", "--model", "m"),
                 ("db", "upgrade")):
        done = retrainer(*argv, "--db", registry_url)
        assert done.returncode == 0, done.stderr
        assert "alembic" not in done.stdout + done.stderr, (argv, done.stderr)
    shown = retrainer("registry", "show", "--model", "m", "--db", registry_url).stdout
    assert shown.startswith("model m\naliases:\n  (none)\nversions:") and "\n1 " in shown


def _with_password(url: str) -> str:
    """The same database with a password in its URL (the test cluster trusts any), to see it hidden."""
    return url.replace("postgres@", "postgres:s3cr3t-pw@", 1) if url.startswith("postgresql") else url


@pytest.mark.parametrize("state", ["empty", "0001"])
def test_stale_or_empty_schema_fails_with_one_line_until_upgraded(registry_url: str, state: str) -> None:
    from alembic import command

    from tasks.registry.db import make_engine, normalize_url
    from tasks.registry.migrate import alembic_config

    url = _with_password(registry_url)
    engine = make_engine(url, poolclass=sa.NullPool)
    with engine.begin() as conn:
        if state == "0001":
            command.upgrade(alembic_config(conn), "0001")
        elif conn.dialect.name == "sqlite":  # not blank (a file something else uses): not ours to migrate
            conn.execute(sa.text("CREATE TABLE notes (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    where = normalize_url(url).render_as_string(hide_password=True)
    for argv in (("registry", "show", "--model", "m"), ("rollback", "--model", "m")):
        done = retrainer(*argv, "--db", url)
        assert done.returncode == 1
        assert done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        expected = "has no registry schema (never migrated)" if state == "empty" else "is at schema revision 0001"
        assert lines[0] == (f"retrainer: error: registry database {where} "
                            f"{expected}, this retrainer needs revision {HEAD}: run `retrainer db upgrade`")
        assert "s3cr3t-pw" not in done.stderr and ("***" in lines[0]) == url.startswith("postgresql")
    upgraded = retrainer("db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    _seed(url)
    done = retrainer("registry", "show", "--model", "m", "--db", url)
    assert done.returncode == 0 and "versions:" in done.stdout, done.stderr


def test_python_api_checks_once_and_publish_uploads_nothing_to_a_stale_registry(
    sqlite_url: str, job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    from alembic import command

    from tasks.config.endpoints import registry_for
    from tasks.registry.db import make_engine
    from tasks.registry.migrate import alembic_config
    from tasks.stages.publish import publish

    engine = make_engine(sqlite_url, poolclass=sa.NullPool)
    with engine.begin() as conn:  # an older schema: only `retrainer db upgrade` moves it
        command.upgrade(alembic_config(conn), "0001")
    engine.dispose()
    cfg = job_config(sqlite_url)
    with pytest.raises(SchemaVersionError, match=r"is at schema revision 0001, .*run `retrainer db upgrade`"):
        publish(cfg, make_checkpoint(tmp_path, cfg, "step-10"), {"loss": 1.0})
    assert not Path(cfg.publish.store_url).exists()  # checked before any upload
    with pytest.raises(SchemaVersionError):
        registry_for(cfg).live_version("tiny-llama", "production")

    upgrade(sqlite_url)
    reg = registry_for(cfg)
    reads: list[str] = []
    sa.event.listen(reg.engine, "before_cursor_execute",
                    lambda _c, _cur, statement, *_a: reads.append(statement) if "version_num" in statement else None)
    _seed(sqlite_url)
    for _ in range(3):
        reg.live_version("m", "production")
        reg.list_versions("m")
    reg.close()
    assert len(reads) == 1  # one revision check per Registry, not one per call


def test_a_new_embedded_sqlite_registry_is_created_on_first_use(
    sqlite_url: str, job_config: Callable[..., JobConfig], tmp_path: Path
) -> None:
    """A user's first run on the embedded default: no `retrainer db upgrade`, the publish goes through and the
    registry then reads like any other (the CLI, another process)."""
    from tasks.stages.publish import publish

    cfg = job_config(sqlite_url)
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()
    publish(cfg, make_checkpoint(tmp_path, cfg, "step-10"), {"loss": 1.0})
    with Registry(sqlite_url) as reg:
        live = reg.live_version(cfg.publish.model_name, "production")
    assert live is not None and live.version == 1
    done = retrainer("registry", "show", "--model", cfg.publish.model_name, "--db", sqlite_url)
    assert done.returncode == 0 and "production -> 1" in done.stdout, done.stderr
    assert retrainer("db", "upgrade", "--db", sqlite_url).stdout.strip() == f"schema already at {HEAD}; nothing applied"
