"""A rollback only goes back: the database refuses a `rollback` move onto a version the alias never held.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05

A "rollback" to a version that was never live on the alias (v5, published to staging only, put on
production by `rollback_model` with `to_version=5`) is a promotion that skipped production's gate and its
approvers. tasks/registry/core.py refuses it with a message pointing at the promote path; this revision
makes the database refuse it too, whichever client writes the move: a BEFORE INSERT trigger on the alias
history refuses a row whose action is 'rollback' unless an earlier row of the same alias moved it to that
version. Every pointer move appends a history row in the same transaction (the registry's code, and the
`registry_move_alias` function of revisions 0002/0007, which still takes a rollback flag), so the move
fails whole. PostgreSQL raises SQLSTATE `RGPRM` with the version as DETAIL; SQLite aborts with the same
words. `ix_registry_alias_history_targets` (model_id, alias, to_version) makes the check an index lookup
however long the history grows.

No '%' and no ':name' in this text (FIELD-NOTES: it passes through SQLAlchemy text() and the psycopg
paramstyle).
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

INDEX = "ix_registry_alias_history_targets"
TRIGGER = "registry_alias_history_rollback_goes_back"
MESSAGE = "registry: a rollback goes only to a version the alias held before"
HELD_BEFORE = """EXISTS (SELECT 1 FROM registry_alias_history h
        WHERE h.model_id = NEW.model_id AND h.alias = NEW.alias AND h.to_version = NEW.to_version
        AND h.seq < NEW.seq)"""

PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION registry_rollback_goes_back() RETURNS trigger
LANGUAGE plpgsql AS $body$
BEGIN
    IF NEW.action = 'rollback' AND NOT {HELD_BEFORE} THEN
        RAISE EXCEPTION USING ERRCODE = 'RGPRM', MESSAGE = '{MESSAGE}', DETAIL = NEW.to_version::text;
    END IF;
    RETURN NEW;
END
$body$
"""


def upgrade() -> None:
    op.create_index(INDEX, "registry_alias_history", ["model_id", "alias", "to_version"])
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(f"CREATE TRIGGER {TRIGGER} BEFORE INSERT ON registry_alias_history "
                   "FOR EACH ROW EXECUTE FUNCTION registry_rollback_goes_back()")
    elif dialect == "sqlite":
        op.execute(f"CREATE TRIGGER {TRIGGER} BEFORE INSERT ON registry_alias_history "
                   f"WHEN NEW.action = 'rollback' AND NOT {HELD_BEFORE} "
                   f"BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END")
    else:
        raise RuntimeError(f"registry schema: no rollback trigger for dialect {dialect!r}")


def downgrade() -> None:
    op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER}" + (" ON registry_alias_history"
                                                      if op.get_bind().dialect.name == "postgresql" else ""))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS registry_rollback_goes_back()")
    op.drop_index(INDEX, "registry_alias_history")
