"""Lineage columns on versions, and no automatic publish back onto a rolled-back version.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Versions gain `parent_version` (the version a run started from), `init_digest` (the digest
of its starting weights) and `data_url` (where its training data was read from). Nullable:
versions published before this revision have no recorded lineage of that kind.

`registry_move_alias` (PostgreSQL) is replaced by the same function plus one rule: an
alias switch with action `publish` (an automatic run) to a version that a rollback once
moved this alias away from is refused with SQLSTATE `RGRBK` (DETAIL: the version). An
explicit `promote` may still do it; that is audited like every switch. SQLite keeps the
Python path (tasks/registry/core.py), which applies the same rule in its transaction.
The function text below repeats revision 0002's with that rule added: migrations are
snapshots, they never import each other.

No '%' and no ':name' in this text (FIELD-NOTES: it passes through SQLAlchemy text() and
the psycopg paramstyle).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

PG_MOVE_ALIAS = """
CREATE OR REPLACE FUNCTION registry_move_alias(
    p_model text, p_alias text, p_to integer, p_expect_any boolean, p_expect integer,
    p_actor text, p_reason text, p_action text, p_rollback boolean, p_at timestamptz,
    OUT o_seq integer, OUT o_action text, OUT o_from integer, OUT o_to integer,
    OUT o_actor text, OUT o_reason text, OUT o_at timestamptz, OUT o_changed boolean)
LANGUAGE plpgsql AS $body$
DECLARE
    v_model_id integer;
    v_current integer;
    v_generation integer;
    v_prev integer;
BEGIN
    SELECT m.id INTO v_model_id FROM registry_models m WHERE m.name = p_model;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'RGNOM', MESSAGE = 'registry: model not found';
    END IF;

    IF NOT p_rollback THEN
        -- Versions are immutable: checking the target before taking the lock is as good as after.
        PERFORM 1 FROM registry_versions v WHERE v.model_id = v_model_id AND v.version = p_to;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'RGNOV', MESSAGE = 'registry: version not found',
                DETAIL = p_to::text;
        END IF;
        SELECT a.version, a.generation INTO v_current, v_generation
            FROM registry_aliases a WHERE a.model_id = v_model_id AND a.name = p_alias FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO registry_aliases (model_id, name, version, generation)
                VALUES (v_model_id, p_alias, NULL, 0) ON CONFLICT (model_id, name) DO NOTHING;
            SELECT a.version, a.generation INTO STRICT v_current, v_generation
                FROM registry_aliases a WHERE a.model_id = v_model_id AND a.name = p_alias FOR UPDATE;
        END IF;
    ELSE
        SELECT a.version, a.generation INTO v_current, v_generation
            FROM registry_aliases a WHERE a.model_id = v_model_id AND a.name = p_alias FOR UPDATE;
        IF NOT FOUND OR v_current IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'RGNRB', MESSAGE = 'registry: nothing to roll back',
                DETAIL = 'empty';
        END IF;
        IF p_to IS NULL THEN
            SELECT h.from_version INTO v_prev FROM registry_alias_history h
                WHERE h.model_id = v_model_id AND h.alias = p_alias ORDER BY h.seq DESC LIMIT 1;
            IF v_prev IS NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'RGNRB', MESSAGE = 'registry: nothing to roll back',
                    DETAIL = 'first ' || v_current::text;
            END IF;
            p_to := v_prev;
        ELSIF p_to = v_current THEN
            RAISE EXCEPTION USING ERRCODE = 'RGNRB', MESSAGE = 'registry: nothing to roll back',
                DETAIL = 'same ' || p_to::text;
        END IF;
    END IF;

    IF NOT p_expect_any AND p_expect IS DISTINCT FROM v_current THEN
        RAISE EXCEPTION USING ERRCODE = 'RGCAS', MESSAGE = 'registry: compare-and-swap lost',
            DETAIL = coalesce(v_current::text, '');
    END IF;

    IF p_rollback THEN
        PERFORM 1 FROM registry_versions v WHERE v.model_id = v_model_id AND v.version = p_to;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'RGNOV', MESSAGE = 'registry: version not found',
                DETAIL = p_to::text;
        END IF;
    END IF;

    IF v_current = p_to THEN
        SELECT h.seq, h.action, h.from_version, h.to_version, h.actor, h.reason, h.at, false
            INTO o_seq, o_action, o_from, o_to, o_actor, o_reason, o_at, o_changed
            FROM registry_alias_history h
            WHERE h.model_id = v_model_id AND h.alias = p_alias AND h.seq = v_generation;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'RGHIS', MESSAGE = 'registry: pointer and history disagree';
        END IF;
        RETURN;
    END IF;

    -- An automatic publish never points an alias back at a version that was rolled back from it.
    IF p_action = 'publish' THEN
        PERFORM 1 FROM registry_alias_history h
            WHERE h.model_id = v_model_id AND h.alias = p_alias AND h.action = 'rollback' AND h.from_version = p_to;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'RGRBK', MESSAGE = 'registry: version was rolled back from this alias',
                DETAIL = p_to::text;
        END IF;
    END IF;

    UPDATE registry_aliases SET version = p_to, generation = v_generation + 1, updated_by = p_actor,
        updated_at = p_at
        WHERE model_id = v_model_id AND name = p_alias;
    INSERT INTO registry_alias_history (model_id, alias, seq, action, from_version, to_version, actor, reason, at)
        VALUES (v_model_id, p_alias, v_generation + 1, p_action, v_current, p_to, p_actor, p_reason, p_at);
    o_seq := v_generation + 1;
    o_action := p_action;
    o_from := v_current;
    o_to := p_to;
    o_actor := p_actor;
    o_reason := p_reason;
    o_at := p_at;
    o_changed := true;
END
$body$
"""


def upgrade() -> None:
    op.add_column("registry_versions", sa.Column("parent_version", sa.Integer, nullable=True))
    op.add_column("registry_versions", sa.Column("init_digest", sa.String(64), nullable=True))
    op.add_column("registry_versions", sa.Column("data_url", sa.Text, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_MOVE_ALIAS)


def downgrade() -> None:
    """Drop the lineage columns. The PostgreSQL function keeps its rollback rule (it reads only history)."""
    for column in ("data_url", "init_digest", "parent_version"):
        # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch copy would lose the immutability triggers.
        op.drop_column("registry_versions", column)
