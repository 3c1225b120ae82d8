"""Registry schema: models, immutable versions, alias pointers, append-only alias history.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Versions and history are refused UPDATE/DELETE (and TRUNCATE on PostgreSQL) by
triggers, so not even raw SQL can rewrite what was published or who switched what.
Composite foreign keys (model_id, version) make it impossible for a pointer or a
history row to name a missing version or a version of another model.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

IMMUTABLE = ("registry_versions", "registry_alias_history")

# No '%' and no ':name' in this text: it passes through SQLAlchemy text() and the
# psycopg paramstyle (FIELD-NOTES: '%' in PL/pgSQL breaks).
PG_FUNCTION = """
CREATE OR REPLACE FUNCTION registry_refuse_mutation() RETURNS trigger
LANGUAGE plpgsql AS $body$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'restrict_violation',
        MESSAGE = TG_TABLE_NAME || ' is append-only: ' || TG_OP || ' refused';
END
$body$
"""


def upgrade() -> None:
    op.create_table(
        "registry_models",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", name="uq_registry_models_name"),
    )
    op.create_table(
        "registry_versions",
        sa.Column("model_id", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False, autoincrement=False),
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
        sa.PrimaryKeyConstraint("model_id", "version", name="pk_registry_versions"),
        sa.ForeignKeyConstraint(["model_id"], ["registry_models.id"], name="fk_registry_versions_model"),
        sa.UniqueConstraint("model_id", "artifact_digest", name="uq_registry_versions_digest"),
        sa.CheckConstraint("version >= 1", name="ck_registry_versions_positive"),
        sa.CheckConstraint("size_bytes >= 0", name="ck_registry_versions_size"),
    )
    op.create_table(
        "registry_aliases",
        sa.Column("model_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=True),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("model_id", "name", name="pk_registry_aliases"),
        sa.ForeignKeyConstraint(["model_id"], ["registry_models.id"], name="fk_registry_aliases_model"),
        sa.ForeignKeyConstraint(
            ["model_id", "version"],
            ["registry_versions.model_id", "registry_versions.version"],
            name="fk_registry_aliases_version",
        ),
    )
    op.create_table(
        "registry_alias_history",
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
        sa.UniqueConstraint("model_id", "alias", "seq", name="uq_registry_alias_history_seq"),
        sa.CheckConstraint("seq >= 1", name="ck_registry_alias_history_seq"),
        sa.ForeignKeyConstraint(
            ["model_id", "alias"], ["registry_aliases.model_id", "registry_aliases.name"],
            name="fk_registry_alias_history_alias",
        ),
        sa.ForeignKeyConstraint(
            ["model_id", "to_version"], ["registry_versions.model_id", "registry_versions.version"],
            name="fk_registry_alias_history_to",
        ),
        sa.ForeignKeyConstraint(
            ["model_id", "from_version"], ["registry_versions.model_id", "registry_versions.version"],
            name="fk_registry_alias_history_from",
        ),
    )

    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        for table in IMMUTABLE:
            op.execute(
                f"CREATE TRIGGER {table}_no_change BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION registry_refuse_mutation()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                "FOR EACH STATEMENT EXECUTE FUNCTION registry_refuse_mutation()"
            )
    elif dialect == "sqlite":
        # SQLite has no TRUNCATE; `DELETE FROM t` without WHERE fires the DELETE trigger.
        for table in IMMUTABLE:
            for verb in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {verb} refused'); END"
                )
    else:  # the registry refuses other databases before migrating; be explicit anyway
        raise RuntimeError(f"registry schema: no immutability triggers for dialect {dialect!r}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for table in ("registry_alias_history", "registry_aliases", "registry_versions", "registry_models"):
        op.drop_table(table)
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS registry_refuse_mutation()")
