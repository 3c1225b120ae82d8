"""Schema migrations: idempotent, recorded in their own version table, immutability enforced by the database."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tasks.base.errors import InvalidInputError
from tasks.registry import ArtifactRef, ForceRequiredError, Lineage, Registry, RolledBackError, upgrade
from tasks.registry.db import make_engine
from tasks.registry.migrate import VERSION_TABLE, current
from tasks.registry.schema import HEAD


def test_upgrade_is_idempotent_and_recorded(registry_url: str) -> None:
    assert current(registry_url) is None
    assert upgrade(registry_url) == ["0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009"]
    assert upgrade(registry_url) == []
    assert current(registry_url) == HEAD == "0009"  # the code's HEAD is the migrations' head
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


def _at_revision(url: str, target: str) -> None:
    """Migrate only up to `target` (what an older retrainer left behind)."""
    from alembic import command

    from tasks.registry.migrate import alembic_config

    engine = make_engine(url, poolclass=sa.NullPool)
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), target)
    engine.dispose()


def _old_version_at(url: str, revision: str) -> None:
    """The schema at `revision` holding one version of model 'm', inserted as that revision's code did."""
    _at_revision(url, revision)
    engine = make_engine(url, poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO registry_models (id, name, created_at) VALUES (1, 'm', CURRENT_TIMESTAMP)")
        conn.exec_driver_sql(
            "INSERT INTO registry_versions (model_id, version, artifact_digest, artifact_url, size_bytes, config_hash, "
            "data_manifest_hash, code_revision, checkpoint_tag, metrics, created_by, created_at) VALUES "
            f"(1, 1, '{'ab' * 32}', 'file:///s/x', 3, 'c', 'd', 'r', 't', '{{}}', 'alice', CURRENT_TIMESTAMP)")
    engine.dispose()


def test_0004_versions_published_before_read_as_single_files(registry_url: str) -> None:
    _old_version_at(registry_url, "0003")  # as the 0003 code wrote it (no artifact_kind)
    assert upgrade(registry_url) == ["0004", "0005", "0006", "0007", "0008", "0009"]
    with Registry(registry_url) as reg:
        assert reg.get_version("m", 1).artifact_kind == "file"
        tree = reg.publish_version("m", ArtifactRef("cd" * 32, "file:///s/trees/cd/x", 9, kind="tree"),
                                   Lineage("c", "d", "r", "t2"), {}, "alice")
        assert reg.get_version("m", tree.version).artifact_kind == "tree"
        with pytest.raises(InvalidInputError, match=r"artifact\.kind"):
            reg.publish_version("m", ArtifactRef("ef" * 32, "u", 1, kind="dir"), Lineage("c", "d", "r", "t3"), {}, "a")


def test_0005_versions_published_before_have_no_replay_and_new_ones_keep_theirs(registry_url: str) -> None:
    _old_version_at(registry_url, "0004")  # as the 0004 code wrote it (no data_replay)
    assert upgrade(registry_url) == ["0005", "0006", "0007", "0008", "0009"]
    replay = [{"url": "s3://b/snap-a", "manifest_hash": "a" * 64, "weight": 0.05}]
    with Registry(registry_url) as reg:
        assert reg.get_version("m", 1).data_replay == []
        mixed = reg.publish_version("m", ArtifactRef("cd" * 32, "file:///s/y", 9), Lineage("c", "d", "r", "t2",
                                    data_replay=replay), {}, "alice")
        assert mixed.data_replay == replay == reg.get_version("m", mixed.version).data_replay
        for bad, field in (([{"url": "u", "manifest_hash": "h", "weight": 1.0}], r"data_replay\[0\]\.weight"),
                           ([{"url": "u", "weight": 0.1}], r"data_replay\[0\]: must be an object"),
                           ([{"url": "u", "manifest_hash": "h", "weight": 0.6}] * 2, "sum below 1")):
            with pytest.raises(InvalidInputError, match=field):
                reg.publish_version("m", ArtifactRef("ef" * 32, "u", 1), Lineage("c", "d", "r", "t3", data_replay=bad),
                                    {}, "a")


def test_0006_versions_published_before_keep_everything_and_record_no_config(registry_url: str) -> None:
    """An upgrade from 0005 with versions in place: they stay as they were (no config, origin from the
    lineage they have), a new version records its config and origin, and a config holding a credential is
    refused before anything is written."""
    _old_version_at(registry_url, "0005")  # as the 0005 code wrote it (no config, no started_from)
    assert upgrade(registry_url) == ["0006", "0007", "0008", "0009"]
    with Registry(registry_url) as reg:
        old = reg.get_version("m", 1)
        assert (old.artifact_url, old.config_hash, old.created_by) == ("file:///s/x", "c", "alice")
        assert old.config is None and old.started_from is None and old.origin == "scratch"
        config = {"train": {"steps": 3, "lr": 0.001}, "publish": {"storage_options": {"secret": "<redacted>"}}}
        new = reg.publish_version("m", ArtifactRef("cd" * 32, "file:///s/y", 9), Lineage(
            "c", "d", "r", "t2", parent_version=1, config=config, started_from="version 1"), {}, "alice")
        assert reg.get_version("m", new.version).config == config == new.config
        assert reg.get_version("m", new.version).origin == "version 1"
        for leak, field in (({"publish": {"storage_options": {"secret": "s3cr3t"}}}, "publish.storage_options.secret"),
                            ({"publish": {"registry_url": "postgresql://u:pw@h/db"}}, "publish.registry_url")):
            with pytest.raises(InvalidInputError, match=rf"lineage\.config: {field} would record a credential"):
                reg.publish_version("m", ArtifactRef("ef" * 32, "u", 1), Lineage("c", "d", "r", "t3", config=leak),
                                    {}, "a")
        assert [v.version for v in reg.list_versions("m")] == [1, 2]


def test_0004_postgres_refuses_an_unknown_artifact_kind(pg_url: str) -> None:
    _seed(pg_url)
    engine = make_engine(pg_url)
    with pytest.raises(sa.exc.IntegrityError, match="ck_registry_versions_artifact_kind"), engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO registry_versions (model_id, version, artifact_digest, artifact_url, size_bytes, config_hash, "
            "data_manifest_hash, code_revision, checkpoint_tag, metrics, created_by, created_at, artifact_kind) "
            "SELECT id, 2, 'x', 'u', 1, 'c', 'd', 'r', 't', '{}', 'a', now(), 'dir' FROM registry_models")
    engine.dispose()


def test_0007_history_kept_and_a_version_rolled_back_before_the_upgrade_needs_force(registry_url: str) -> None:
    """An operator upgrades from 0006 after rolling production back from v3 to v2 (rows as the 0006 code
    wrote them): the history stays, the rollback rows are indexed, and the old rollback still holds: a plain
    promote of v3 is refused naming who rolled it back and why, a publish never puts it back, a promote of v1
    and a forced v3 go through and are recorded."""
    _at_revision(registry_url, "0006")
    engine = make_engine(registry_url, poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO registry_models (id, name, created_at) VALUES (1, 'm', CURRENT_TIMESTAMP)")
        for n in (1, 2, 3):
            conn.exec_driver_sql(
                "INSERT INTO registry_versions (model_id, version, artifact_digest, artifact_url, size_bytes, "
                "config_hash, data_manifest_hash, code_revision, checkpoint_tag, metrics, created_by, created_at) "
                f"VALUES (1, {n}, '{str(n) * 64}', 'file:///s/{n}', 3, 'c', 'd', 'r', 't{n}', '{{}}', 'ci', "
                "CURRENT_TIMESTAMP)")
        conn.exec_driver_sql("INSERT INTO registry_aliases (model_id, name, version, generation, updated_by, "
                             "updated_at) VALUES (1, 'production', 2, 4, 'alice', CURRENT_TIMESTAMP)")
        for seq, action, frm, to, actor, reason in ((1, "publish", "NULL", 1, "ci", "publish"),
                                                    (2, "publish", "1", 2, "ci", "publish"),
                                                    (3, "publish", "2", 3, "ci", "publish"),
                                                    (4, "rollback", "3", 2, "alice", "v3 hallucinates")):
            conn.exec_driver_sql(
                "INSERT INTO registry_alias_history (model_id, alias, seq, action, from_version, to_version, actor, "
                f"reason, at) VALUES (1, 'production', {seq}, '{action}', {frm}, {to}, '{actor}', '{reason}', "
                "CURRENT_TIMESTAMP)")
    assert upgrade(registry_url) == ["0007", "0008", "0009"]
    with engine.connect() as conn:
        indexes = {i["name"]: i["column_names"] for i in sa.inspect(conn).get_indexes("registry_alias_history")}
        assert indexes["ix_registry_alias_history_rollbacks"] == ["model_id", "alias", "from_version", "seq"]
        if engine.dialect.name == "postgresql":  # one function: the 0003 signature was replaced, not overloaded
            assert conn.exec_driver_sql("SELECT proargnames[10], pronargs FROM pg_proc "
                                        "WHERE proname = 'registry_move_alias'").all() == [("p_force", 11)]
    engine.dispose()
    with Registry(registry_url) as reg:
        before = reg.history("m", "production")
        assert [(h.seq, h.action, h.from_version, h.to_version, h.actor) for h in before] == [
            (1, "publish", None, 1, "ci"), (2, "publish", 1, 2, "ci"), (3, "publish", 2, 3, "ci"),
            (4, "rollback", 3, 2, "alice")]
        with pytest.raises(ForceRequiredError) as refused:
            reg.switch_alias("m", "production", 3, actor="bob", reason="v3 again")
        assert f"version 3 was rolled back from it by alice at {before[-1].at} (reason: 'v3 hallucinates')" in str(
            refused.value)
        with pytest.raises(RolledBackError, match="an automatic publish never points it there again"):
            reg.switch_alias("m", "production", 3, actor="ci", action="publish")
        assert reg.history("m", "production") == before  # refusals wrote nothing
        one = reg.switch_alias("m", "production", 1, actor="bob", reason="pin v1")
        assert (one.seq, one.from_version, one.to_version, one.actor, one.changed) == (5, 2, 1, "bob", True)
        forced = reg.switch_alias("m", "production", 3, actor="bob", reason="v3 retested", force=True)
        assert forced.reason.startswith("v3 retested [forced: v3 had been rolled back from production by alice at ")
        assert reg.live_version("m", "production").version == 3
        assert reg.history("m", "production") == [*before, one, forced]
