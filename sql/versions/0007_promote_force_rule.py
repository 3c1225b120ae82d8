"""A plain promote on PostgreSQL is one statement again: the "rolled back from this alias needs force" rule moves
into `registry_move_alias`, and an index finds an alias's rollbacks.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

Revision 0003's function refused only an automatic publish onto a version a rollback had moved the alias
away from. A person's promote there needs `force` (tasks/registry/core.py, ForceRequiredError), and the
PostgreSQL promote ran that check as a guard statement pipelined around the function call, scanning the
alias's whole history each time. Now:
- `ix_registry_alias_history_rollbacks`: a partial index on the history's rollback rows
  (model_id, alias, from_version, seq) WHERE action = 'rollback', on SQLite and PostgreSQL, so the rule is
  an index lookup however long the history grows. `seq` last: the latest such rollback is the index's
  last entry for the key, so the planner never prefers a backward scan of the alias's whole history
  (the unique (model_id, alias, seq) index) for `ORDER BY seq DESC LIMIT 1`, even before statistics exist;
- `registry_move_alias` (PostgreSQL) gains `p_force boolean` and applies the rule itself: without force a
  promote or rollback onto such a version is refused with SQLSTATE `RGFRC` whose DETAIL is that rollback
  (JSON: seq, action, from_version, to_version, actor, reason, at), so the caller can name who rolled it
  back, when and why. A publish is refused with `RGRBK` whatever `p_force` says, as before. With force the
  function skips the rule: a forced move that overrides a rollback is composed by the caller (it records
  what it overrode in the reason). The 10-argument function is dropped (a new signature is a new function
  in PostgreSQL); downgrade puts revision 0003's back.
SQLite has no stored procedures; its Python path applies the same rule and gets the index.
The function texts below repeat revision 0003's with that change: migrations are snapshots, they never
import each other.

No '%' and no ':name' in this text (FIELD-NOTES: it passes through SQLAlchemy text() and the psycopg
paramstyle).
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

INDEX = "ix_registry_alias_history_rollbacks"
ROLLBACK_ROWS = "action = 'rollback'"

PG_MOVE_ALIAS = """
CREATE OR REPLACE FUNCTION registry_move_alias(
    p_model text, p_alias text, p_to integer, p_expect_any boolean, p_expect integer,
    p_actor text, p_reason text, p_action text, p_rollback boolean, p_force boolean, p_at timestamptz,
    OUT o_seq integer, OUT o_action text, OUT o_from integer, OUT o_to integer,
    OUT o_actor text, OUT o_reason text, OUT o_at timestamptz, OUT o_changed boolean)
LANGUAGE plpgsql AS $body$
DECLARE
    v_model_id integer;
    v_current integer;
    v_generation integer;
    v_prev integer;
    v_rollback text;
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

    -- A version a rollback moved this alias away from: an automatic publish never points the alias there again
    -- (RGRBK), a person's promote or rollback only when forced (RGFRC; DETAIL: the latest such rollback as JSON,
    -- so the caller can say who rolled it back, when and why). The partial index of this revision finds it.
    IF p_action = 'publish' OR NOT p_force THEN
        SELECT json_build_object('seq', h.seq, 'action', h.action, 'from_version', h.from_version,
                'to_version', h.to_version, 'actor', h.actor, 'reason', h.reason, 'at', h.at)::text
            INTO v_rollback FROM registry_alias_history h
            WHERE h.model_id = v_model_id AND h.alias = p_alias AND h.action = 'rollback' AND h.from_version = p_to
            ORDER BY h.seq DESC LIMIT 1;
        IF FOUND AND p_action = 'publish' THEN
            RAISE EXCEPTION USING ERRCODE = 'RGRBK', MESSAGE = 'registry: version was rolled back from this alias',
                DETAIL = p_to::text;
        ELSIF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'RGFRC', MESSAGE = 'registry: version was rolled back from this alias; '
                || 'putting it back needs force', DETAIL = v_rollback;
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

# Revision 0003's function, put back by downgrade (the code of revision 0006 calls it).
PG_MOVE_ALIAS_0003 = """
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

DROP_0003 = ("DROP FUNCTION IF EXISTS registry_move_alias(text, text, integer, boolean, integer, text, text, text, "
             "boolean, timestamptz)")
DROP = ("DROP FUNCTION IF EXISTS registry_move_alias(text, text, integer, boolean, integer, text, text, text, "
        "boolean, boolean, timestamptz)")


def upgrade() -> None:
    op.create_index(INDEX, "registry_alias_history", ["model_id", "alias", "from_version", "seq"],
                    sqlite_where=sa.text(ROLLBACK_ROWS), postgresql_where=sa.text(ROLLBACK_ROWS))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(DROP_0003)
        op.execute(PG_MOVE_ALIAS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(DROP)
        op.execute(PG_MOVE_ALIAS_0003)
    op.drop_index(INDEX, "registry_alias_history")
