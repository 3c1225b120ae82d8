"""Table definitions the registry code queries (SQLAlchemy Core), and the schema revision they mirror.

The DDL that creates them lives in the migrations under `sql/versions/`, which
are frozen snapshots; this module mirrors the latest schema (`HEAD`). Table names carry a
`registry_` prefix because the registry may share a database with Airflow.

Only `retrainer db upgrade` changes the schema, with one exception: a blank embedded SQLite
database (no table at all: a new file) is migrated on first use (`Registry`), since nothing
there can be in the way and its user owns the file. Everything else checks it once per
engine (`require_head`: one read of the version table, no alembic import), so task
users need no DDL rights and a database that is not at `HEAD` fails with one line.
"""

from __future__ import annotations

import sqlalchemy as sa

from tasks.registry.errors import SchemaVersionError

# alembic's version table, named so the registry can share a database with Airflow (`alembic_version`).
VERSION_TABLE = "retrainer_schema_version"
# The newest migration, which the tables below mirror (tests/registry/test_migrations.py checks it is the head).
HEAD = "0009"

metadata = sa.MetaData()

models = sa.Table(
    "registry_models",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

versions = sa.Table(
    "registry_versions",
    metadata,
    sa.Column("model_id", sa.Integer, sa.ForeignKey("registry_models.id"), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("artifact_digest", sa.String(64), nullable=False),
    sa.Column("artifact_url", sa.Text, nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("config_hash", sa.String(200), nullable=False),
    sa.Column("data_manifest_hash", sa.String(200), nullable=False),
    sa.Column("code_revision", sa.String(200), nullable=False),
    sa.Column("checkpoint_tag", sa.String(200), nullable=False),
    sa.Column("metrics", sa.JSON, nullable=False),
    sa.Column("serving_bytes", sa.BigInteger, nullable=True),
    sa.Column("created_by", sa.String(200), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("parent_version", sa.Integer, nullable=True),
    sa.Column("init_digest", sa.String(64), nullable=True),
    sa.Column("data_url", sa.Text, nullable=True),
    sa.Column("artifact_kind", sa.String(16), nullable=False, server_default="file"),
    sa.Column("data_replay", sa.JSON, nullable=True),
    sa.Column("config", sa.JSON, nullable=True),
    sa.Column("started_from", sa.Text, nullable=True),
    sa.Column("base_version", sa.Integer, nullable=True),
    sa.Column("base_digest", sa.String(64), nullable=True),
    sa.UniqueConstraint("model_id", "artifact_digest"),
)

aliases = sa.Table(
    "registry_aliases",
    metadata,
    sa.Column("model_id", sa.Integer, sa.ForeignKey("registry_models.id"), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("version", sa.Integer, nullable=True),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("updated_by", sa.String(200), nullable=True),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(["model_id", "version"], ["registry_versions.model_id", "registry_versions.version"]),
)

history = sa.Table(
    "registry_alias_history",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("model_id", sa.Integer, nullable=False),
    sa.Column("alias", sa.String(200), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("from_version", sa.Integer, nullable=True),
    sa.Column("to_version", sa.Integer, nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    sa.UniqueConstraint("model_id", "alias", "seq"),
    # The rule "rolled back from this alias: a publish never, a person only with force" looks rows up by this.
    sa.Index("ix_registry_alias_history_rollbacks", "model_id", "alias", "from_version", "seq",
             sqlite_where=sa.text("action = 'rollback'"), postgresql_where=sa.text("action = 'rollback'")),
    # The rule "a rollback only goes back" (revision 0009's trigger and Registry.rollback) looks rows up by this.
    sa.Index("ix_registry_alias_history_targets", "model_id", "alias", "to_version"),
)


def revision(conn: sa.Connection) -> str | None:
    """The schema revision the database is at (None when never migrated)."""
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def blank_sqlite(engine: sa.Engine) -> bool:
    """An SQLite database without a single table (a file just created): the embedded default's first use."""
    if engine.dialect.name != "sqlite":
        return False
    with engine.connect() as conn:
        return not sa.inspect(conn).get_table_names()


def require_head(engine: sa.Engine) -> None:
    """Refuse a database whose schema is not the one this code speaks, naming it (password hidden)."""
    with engine.connect() as conn:
        found = revision(conn)
    if found == HEAD:
        return
    where = engine.url.render_as_string(hide_password=True)
    state = "has no registry schema (never migrated)" if found is None else f"is at schema revision {found}"
    raise SchemaVersionError(
        f"registry database {where} {state}, this retrainer needs revision {HEAD}: run `retrainer db upgrade`")
