"""Schema migrations: idempotent, recorded in their own version table, immutability enforced by the database."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tasks.registry import ArtifactRef, Lineage, Registry, upgrade
from tasks.registry.db import make_engine
from tasks.registry.migrate import VERSION_TABLE, current
from tasks.registry.schema import HEAD


def test_upgrade_is_idempotent_and_recorded(registry_url: str) -> None:
    assert current(registry_url) is None
    assert upgrade(registry_url) == ["0001", "0002", "0003"]
    assert upgrade(registry_url) == []
    assert current(registry_url) == HEAD == "0003"  # the code's HEAD is the migrations' head
    engine = make_engine(registry_url)
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
    engine.dispose()
    assert {VERSION_TABLE, "registry_models", "registry_versions", "registry_aliases",
            "registry_alias_history"} <= tables
    assert "alembic_version" not in tables  # Airflow's own table name stays free


def _seed(url: str) -> None:
    upgrade(url)
    with Registry(url) as reg:
        ref = ArtifactRef("ab" * 32, "file:///store/x", 10)
        reg.publish_version("m", ref, Lineage("c", "d", "rev", "tag"), {"loss": 1.0}, "alice")
        reg.switch_alias("m", "production", 1, actor="alice", reason="first")


@pytest.mark.parametrize("table", ["registry_versions", "registry_alias_history"])
@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE {t} SET {col} = {col}",
        "DELETE FROM {t}",
        "DELETE FROM {t} WHERE 1 = 1",
    ],
)
def test_raw_sql_cannot_change_immutable_tables(registry_url: str, table: str, statement: str) -> None:
    _seed(registry_url)
    col = "artifact_url" if table == "registry_versions" else "reason"
    engine = make_engine(registry_url)
    sql = statement.format(t=table, col=col)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
        conn.exec_driver_sql(sql)
    with engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar() == 1
        if table == "registry_versions":
            assert conn.exec_driver_sql(f"SELECT {col} FROM {table}").scalar() == "file:///store/x"
    engine.dispose()


@pytest.mark.parametrize("table", ["registry_versions", "registry_alias_history"])
def test_truncate_refused_on_postgres(pg_url: str, table: str) -> None:
    _seed(pg_url)
    engine = make_engine(pg_url)
    # Plain TRUNCATE of versions may already be stopped by foreign keys; CASCADE reaches the trigger.
    for sql in (f"TRUNCATE {table}", f"TRUNCATE {table} CASCADE", "TRUNCATE registry_models CASCADE"):
        with pytest.raises(sa.exc.DBAPIError, match=r"append-only|foreign key"), engine.begin() as conn:
            conn.exec_driver_sql(sql)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE {table} CASCADE")
    with engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar() == 1
    engine.dispose()

