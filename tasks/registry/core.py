"""The registry: immutable versions and audited alias pointers in one SQL database.

Same code for SQLite and PostgreSQL (SQLAlchemy Core). Concurrency:
- version numbers: the model row is locked (`FOR NO KEY UPDATE`, which does not
  block foreign-key checks of other writers) and the next number is max + 1, so
  numbers are unique and gap-free; a failed publish commits nothing.
- pointer switch: one transaction that locks the alias row (`FOR UPDATE`),
  checks the optional compare-and-swap expectation, moves the pointer and appends
  one history row, so the history is a single chain. On PostgreSQL an automatic
  publish's switch is one call of the `registry_move_alias` function (migrations
  0002/0003) in autocommit mode: one round trip, so the row lock is held only while
  the server works.
- promote and rollback (a person's decisions) read the alias history under that same
  row lock: the default rollback target, the "rolled back from this alias: needs
  force" rule and the "a rollback only goes back (to a version the alias held)" rule
  come from it, so nothing can move the alias between that read and the move. The
  database enforces the last one itself too (migration 0009's trigger on the history).
  On PostgreSQL a plain promote is one call of that function too (migration 0007 moved
  the rule into it, with an index on the rollback rows); a rollback or a forced move
  runs from Python, in one transaction, on both databases.
SQLite has no row locks; its engine starts every transaction with BEGIN IMMEDIATE,
and it runs the same steps from Python (it has no stored procedures).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from tasks.base.errors import InvalidInputError
from tasks.registry import schema as t
from tasks.registry.alias_rules import (
    already_there,
    cas_lost,
    default_target,
    disagree,
    needs_force,
    never_held,
    no_model,
    no_version,
    nothing_left,
    points_to_nothing,
    rollback_text,
    rolled_back,
    rolled_back_from,
)
from tasks.registry.db import make_engine
from tasks.registry.errors import (
    NotFoundError,
)
from tasks.registry.lineage_checks import check_config, check_metrics, check_replay
from tasks.registry.migrate import upgrade
from tasks.registry.names import check_digest, check_name, check_text, check_version
from tasks.registry.records import ArtifactKind, ArtifactRef, Lineage, SwitchRecord, VersionRecord
from tasks.registry.schema import blank_sqlite, require_head

log = logging.getLogger(__name__)

ANY: Literal["ANY"] = "ANY"
Expect = int | None | Literal["ANY"]

# PostgreSQL publish or plain promote: one bound-parameter call of the function of migration 0002, with the
# "rolled back from this alias" rule of migrations 0003 (a publish: never) and 0007 (a person: only forced).
# Executed on the pooled psycopg connection itself: the switch is the registry's hot path, and the
# SQLAlchemy statement machinery around one function call cost as much as the round trip.
_PG_MOVE = (
    "SELECT * FROM registry_move_alias(%(model)s::text, %(alias)s::text, %(to)s::integer, "
    "%(expect_any)s::boolean, %(expect)s::integer, %(actor)s::text, %(reason)s::text, "
    "%(action)s::text, %(rollback)s::boolean, %(force)s::boolean, %(at)s::timestamptz)"
)


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:  # SQLite returns naive datetimes; we only ever store UTC
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat()


def _check_expect(expect: Any) -> Expect:
    if expect is None or expect == ANY:
        return expect
    return check_version(expect, "expect")


class Registry:
    """Python API over the registry database; one instance per process is enough (it pools connections).

    The schema is checked, not changed: the first query finds out once whether the database is at the
    revision this code speaks (SchemaVersionError naming it otherwise; `retrainer db upgrade` migrates).
    A blank SQLite database (the embedded default's first use) is migrated then instead.
    """

    def __init__(self, db_url: str, *, engine: sa.Engine | None = None) -> None:
        self.db_url = db_url
        self.engine = engine or make_engine(db_url)
        self._pg = self.engine.dialect.name == "postgresql"
        self._schema_checked = False

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------
    def _db(self) -> sa.Engine:
        """The engine, once the database is known to be at the schema revision this code needs."""
        if not self._schema_checked:
            if blank_sqlite(self.engine):
                log.info("registry: %s is a new SQLite database: creating the schema", self.engine.url.database)
                upgrade(self.db_url, self.engine)
            require_head(self.engine)
            self._schema_checked = True
        return self.engine

    def _insert_ignore(self, conn: sa.Connection, table: sa.Table, values: dict[str, Any], keys: list[str]) -> None:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        conn.execute(dialect.insert(table).values(**values).on_conflict_do_nothing(index_elements=keys))

    def _model_id(self, conn: sa.Connection, model: str, *, lock: bool = False) -> int:
        q = sa.select(t.models.c.id).where(t.models.c.name == model)
        if lock:
            q = q.with_for_update(key_share=True)  # FOR NO KEY UPDATE: FK checks of others still pass
        mid = conn.execute(q).scalar()
        if mid is None:
            raise no_model(model)
        return int(mid)

    @staticmethod
    def _version(row: sa.Row[Any], model: str, created: bool = False) -> VersionRecord:
        m = row._mapping
        return VersionRecord(
            model=model, version=m["version"], artifact_digest=m["artifact_digest"],
            artifact_url=m["artifact_url"], size_bytes=m["size_bytes"], config_hash=m["config_hash"],
            data_manifest_hash=m["data_manifest_hash"], code_revision=m["code_revision"],
            checkpoint_tag=m["checkpoint_tag"], metrics=m["metrics"], serving_bytes=m["serving_bytes"],
            created_by=m["created_by"], created_at=_iso(m["created_at"]) or "", parent_version=m["parent_version"],
            init_digest=m["init_digest"], data_url=m["data_url"], artifact_kind=m["artifact_kind"],
            data_replay=m["data_replay"] or [], config=m["config"], started_from=m["started_from"],
            base_version=m["base_version"], base_digest=m["base_digest"], created=created,
        )

    @staticmethod
    def _switch(row: sa.Row[Any], model: str, changed: bool = True) -> SwitchRecord:
        m = row._mapping
        return SwitchRecord(
            model=model, alias=m["alias"], seq=m["seq"], action=m["action"], from_version=m["from_version"],
            to_version=m["to_version"], actor=m["actor"], reason=m["reason"], at=_iso(m["at"]) or "",
            changed=changed,
        )

    def _get_version(self, conn: sa.Connection, model_id: int, model: str, version: int) -> VersionRecord:
        row = conn.execute(
            sa.select(t.versions).where(t.versions.c.model_id == model_id, t.versions.c.version == version)
        ).first()
        if row is None:
            raise no_version(model, version)
        return self._version(row, model)

    # -- publishing ---------------------------------------------------------
    def publish_version(
        self, model: str, artifact: ArtifactRef, lineage: Lineage, metrics: dict[str, Any], created_by: str
    ) -> VersionRecord:
        """Insert an immutable version with the next number; idempotent on the artifact digest.

        `artifact` is a single file (`ArtifactStore.put`) or a committed tree (`ArtifactStore.commit_tree`):
        its `kind` is recorded with the version."""
        check_name(model, "model")
        check_name(created_by, "created_by")
        check_digest(artifact.digest, "artifact.digest")
        for field in ("config_hash", "data_manifest_hash", "code_revision", "checkpoint_tag"):
            check_name(getattr(lineage, field), f"lineage.{field}")
        if artifact.kind not in get_args(ArtifactKind):
            raise InvalidInputError(f"artifact.kind: must be one of {get_args(ArtifactKind)}, got {artifact.kind!r}")
        if not isinstance(artifact.size, int) or artifact.size < 0:
            raise InvalidInputError(f"artifact.size: must be a non-negative integer, got {artifact.size!r}")
        if lineage.serving_bytes is not None and (
            not isinstance(lineage.serving_bytes, int) or lineage.serving_bytes < 0
        ):
            raise InvalidInputError("lineage.serving_bytes: must be a non-negative integer or None")
        if lineage.parent_version is not None:
            check_version(lineage.parent_version, "lineage.parent_version")
        if lineage.init_digest is not None:
            check_digest(lineage.init_digest, "lineage.init_digest")
        if lineage.data_url is not None:
            check_text(lineage.data_url, "lineage.data_url", max_len=4096)
        check_text(artifact.url, "artifact.url", max_len=4096)
        if lineage.started_from is not None:
            check_text(lineage.started_from, "lineage.started_from", max_len=4096)
        if lineage.base_version is not None:
            check_version(lineage.base_version, "lineage.base_version")
        if lineage.base_digest is not None:
            check_digest(lineage.base_digest, "lineage.base_digest")
        replay = check_replay(lineage.data_replay)
        config = check_config(lineage.config)
        metrics = check_metrics(metrics)
        now = _now()
        with self._db().begin() as conn:
            self._insert_ignore(conn, t.models, {"name": model, "created_at": now}, ["name"])
            model_id = self._model_id(conn, model, lock=True)
            existing = conn.execute(
                sa.select(t.versions).where(
                    t.versions.c.model_id == model_id, t.versions.c.artifact_digest == artifact.digest
                )
            ).first()
            if existing is not None:
                log.info("model %r: artifact %s is already version %d", model, artifact.digest[:12],
                         existing._mapping["version"])
                return self._version(existing, model, created=False)
            last = conn.execute(
                sa.select(sa.func.max(t.versions.c.version)).where(t.versions.c.model_id == model_id)
            ).scalar()
            number = int(last or 0) + 1
            values = {
                "model_id": model_id, "version": number, "artifact_digest": artifact.digest,
                "artifact_url": artifact.url, "size_bytes": artifact.size, "config_hash": lineage.config_hash,
                "data_manifest_hash": lineage.data_manifest_hash, "code_revision": lineage.code_revision,
                "checkpoint_tag": lineage.checkpoint_tag, "metrics": metrics,
                "serving_bytes": lineage.serving_bytes, "created_by": created_by, "created_at": now,
                "parent_version": lineage.parent_version, "init_digest": lineage.init_digest,
                "data_url": lineage.data_url, "artifact_kind": artifact.kind,
                "data_replay": replay or None,  # NULL: no replay, as for every version before revision 0005
                "config": config, "started_from": lineage.started_from,
                "base_version": lineage.base_version, "base_digest": lineage.base_digest,
            }
            conn.execute(sa.insert(t.versions).values(**values))
        log.info("model %r: published version %d (%s)", model, number, artifact.digest[:12])
        return VersionRecord(model=model, created=True, created_at=_iso(now) or "",
                             **{k: v for k, v in values.items() if k not in ("model_id", "created_at", "data_replay")},
                             data_replay=replay)

    # -- pointer switching ----------------------------------------------------
    def switch_alias(
        self, model: str, alias: str, to_version: int, *, expect: Expect = ANY, actor: str, reason: str = "",
        action: str = "promote", force: bool = False,
    ) -> SwitchRecord:
        """Point `alias` at `to_version` in one transaction; with `expect`, only if it still points there.

        A version a rollback moved this alias away from goes back only by an explicit promote or rollback
        with `force` (ForceRequiredError otherwise, naming that rollback; the forced move's reason says
        what it overrode); a publish never puts it back (RolledBackError)."""
        check_name(model, "model")
        check_name(alias, "alias")
        check_version(to_version, "to_version")
        check_name(actor, "actor")
        check_text(reason, "reason")
        expect = _check_expect(expect)
        if action not in ("promote", "publish", "rollback"):
            raise InvalidInputError(f"action: unknown switch action {action!r}")
        # The function applies the "rolled back from this alias" rule itself; a move recorded as a rollback takes the
        # Python path, which names the versions the alias held when it refuses one it never did.
        if self._pg and (action == "publish" or (action == "promote" and not force)):
            return self._pg_move(model, alias, to_version, expect, actor, reason, action, force)
        with self._db().begin() as conn:
            model_id = self._model_id(conn, model)
            # Versions are immutable: checking the target before taking the lock is as good as after.
            self._get_version(conn, model_id, model, to_version)
            locked = self._lock_alias(conn, model_id, alias)
            if locked is None:
                self._insert_ignore(conn, t.aliases, {"model_id": model_id, "name": alias, "version": None,
                                                      "generation": 0}, ["model_id", "name"])
                locked = self._lock_alias(conn, model_id, alias)
            assert locked is not None
            return self._move(conn, model_id, model, alias, locked, to_version, expect, actor, reason, action,
                              checked=True, force=force)

    def _pg_move(
        self, model: str, alias: str, to: int, expect: Expect, actor: str, reason: str, action: str, force: bool,
    ) -> SwitchRecord:
        """Switch through `registry_move_alias` (migration 0002) in one round trip: one statement in autocommit
        mode, i.e. one implicit transaction. The function refuses a rolled-back target itself (a publish always,
        migration 0003; a promote unless forced, migration 0007).

        The function runs the same steps as the SQLite path under the same row lock;
        its `RG...` SQLSTATEs are mapped back to our exceptions and messages here.
        """
        params = {"model": model, "alias": alias, "to": to, "expect_any": expect == ANY,
                  "expect": None if expect == ANY else expect, "actor": actor, "reason": reason,
                  "action": action, "rollback": False, "force": force, "at": _now()}
        import psycopg
        from psycopg.rows import dict_row

        pooled = self._db().raw_connection()  # the pool's checkout checks still run
        try:
            pg = pooled.driver_connection
            pg.autocommit = True  # one statement = one implicit transaction, no BEGIN/COMMIT
            try:
                with pg.cursor(row_factory=dict_row) as cur:
                    row = cur.execute(_PG_MOVE, params).fetchone()
            finally:
                pg.autocommit = False
        except psycopg.Error as exc:
            mapped = self._pg_error(exc, model, alias, to, expect)
            if mapped is exc:
                raise
            raise mapped from None
        finally:
            pooled.close()  # back to the pool
        rec = SwitchRecord(model=model, alias=alias, seq=row["o_seq"], action=row["o_action"],
                           from_version=row["o_from"], to_version=row["o_to"], actor=row["o_actor"],
                           reason=row["o_reason"], at=_iso(row["o_at"]) or "", changed=row["o_changed"])
        if rec.changed:
            log.info("model %r alias %r: %s -> %d (%s by %s)", model, alias, rec.from_version, rec.to_version,
                     action, actor)
        else:
            log.info("model %r alias %r already at version %d; nothing to switch", model, alias, rec.to_version)
        return rec

    @staticmethod
    def _pg_error(exc: Exception, model: str, alias: str, to: int, expect: Expect) -> Exception:
        """Our exception for a `registry_move_alias` SQLSTATE; anything else is re-raised as it was."""
        code = getattr(exc, "sqlstate", None)
        diag = getattr(exc, "diag", None)
        detail = (getattr(diag, "message_detail", None) or "") if diag is not None else ""
        if code == "RGNOM":
            return no_model(model)
        if code == "RGNOV":
            return no_version(model, int(detail))
        if code == "RGCAS":
            return cas_lost(model, alias, None if expect == ANY else expect, int(detail) if detail else None)
        if code == "RGHIS":
            return disagree(model, alias)
        if code == "RGRBK":
            return rolled_back(model, alias, int(detail))
        if code == "RGPRM":  # revision 0009's trigger: a 'rollback' row onto a version the alias never held
            return never_held(model, alias, int(detail), None)
        if code == "RGFRC":  # DETAIL: the rollback that moved the alias away from `to`, as JSON (migration 0007)
            removed = json.loads(detail)
            return needs_force(model, alias, to, SwitchRecord(
                model=model, alias=alias, **{**removed, "at": _iso(datetime.fromisoformat(removed["at"])) or ""}))
        return exc

    def _lock_alias(self, conn: sa.Connection, model_id: int, alias: str) -> tuple[int | None, int] | None:
        """Lock the alias row; return (version or None if empty, generation), or None if there is no such alias.

        The generation counts switches, so the next history sequence number is generation + 1.
        """
        row = conn.execute(
            sa.select(t.aliases.c.version, t.aliases.c.generation)
            .where(t.aliases.c.model_id == model_id, t.aliases.c.name == alias)
            .with_for_update()
        ).first()
        return None if row is None else (row[0], int(row[1]))

    def _alias_history(self, conn: sa.Connection, model_id: int, model: str, alias: str,
                       rollbacks_from: int | None = None) -> list[SwitchRecord]:
        """One alias's moves, oldest first; with `rollbacks_from`, only the rollbacks away from that version."""
        q = sa.select(t.history).where(t.history.c.model_id == model_id, t.history.c.alias == alias)
        if rollbacks_from is not None:
            # 'rollback' inline, not bound: only then can SQLite use the partial index on these rows (0007)
            q = q.where(t.history.c.action == sa.literal_column("'rollback'"),
                        t.history.c.from_version == rollbacks_from)
        return [self._switch(r, model) for r in conn.execute(q.order_by(t.history.c.seq)).all()]

    @staticmethod
    def _held_before(conn: sa.Connection, model_id: int, alias: str, version: int) -> bool:
        """Whether `alias` ever pointed at `version` (an index lookup: revision 0009's trigger asks the same)."""
        h = t.history.c
        return conn.execute(sa.select(sa.literal(1)).where(
            h.model_id == model_id, h.alias == alias, h.to_version == version).limit(1)).first() is not None

    @staticmethod
    def _held(conn: sa.Connection, model_id: int, alias: str) -> list[int]:
        """Every version `alias` ever pointed at, ascending."""
        h = t.history.c
        return list(conn.execute(sa.select(h.to_version).distinct().where(
            h.model_id == model_id, h.alias == alias).order_by(h.to_version)).scalars())

    def _move(
        self, conn: sa.Connection, model_id: int, model: str, alias: str, locked: tuple[int | None, int],
        to_version: int, expect: Expect, actor: str, reason: str, action: str, checked: bool = False,
        force: bool = False,
    ) -> SwitchRecord:
        current, generation = locked
        if expect != ANY and expect != current:
            raise cas_lost(model, alias, expect, current)
        if not checked:
            self._get_version(conn, model_id, model, to_version)  # refuses missing / other model's versions
        if current == to_version:
            log.info("model %r alias %r already at version %d; nothing to switch", model, alias, to_version)
            last = conn.execute(
                sa.select(t.history).where(t.history.c.model_id == model_id, t.history.c.alias == alias,
                                           t.history.c.seq == generation)
            ).first()
            if last is not None:
                return self._switch(last, model, changed=False)
            raise disagree(model, alias)
        if action == "rollback" and not self._held_before(conn, model_id, alias, to_version):
            raise never_held(model, alias, to_version, self._held(conn, model_id, alias))
        removed = self._alias_history(conn, model_id, model, alias, rollbacks_from=to_version)
        if removed:
            if action == "publish":
                raise rolled_back(model, alias, to_version)
            if not force:
                raise needs_force(model, alias, to_version, removed[-1])
            if not reason.strip():
                raise InvalidInputError(f"reason: putting version {to_version} back on {alias!r} over its "
                                        "rollback needs a reason")
            reason = f"{reason} [forced: v{to_version} had been rolled back from {alias} {rollback_text(removed[-1])}]"
        now = _now()
        seq = generation + 1
        conn.execute(
            sa.update(t.aliases)
            .where(t.aliases.c.model_id == model_id, t.aliases.c.name == alias)
            .values(version=to_version, generation=seq, updated_by=actor, updated_at=now)
        )
        row = {"model_id": model_id, "alias": alias, "seq": seq, "action": action, "from_version": current,
               "to_version": to_version, "actor": actor, "reason": reason, "at": now}
        conn.execute(sa.insert(t.history).values(**row))
        log.info("model %r alias %r: %s -> %d (%s by %s)", model, alias, current, to_version, action, actor)
        return SwitchRecord(model=model, alias=alias, seq=seq, action=action, from_version=current,
                            to_version=to_version, actor=actor, reason=reason, at=_iso(now) or "")

    def rollback(
        self, model: str, alias: str, *, to: int | None = None, expect: Expect = ANY, actor: str,
        reason: str = "rollback", force: bool = False,
    ) -> SwitchRecord:
        """Move `alias` back: to `to`, or to `rollback_target` (the newest version live before the current
        one that was not itself rolled back from it). `to` naming a rolled-back version needs `force`; `to` naming
        a version the alias never held is refused, forced or not (PromotionRequiredError: that is a promotion,
        which goes through the alias's gate and approvers; revision 0009's trigger refuses it too)."""
        check_name(model, "model")
        check_name(alias, "alias")
        check_name(actor, "actor")
        check_text(reason, "reason")
        expect = _check_expect(expect)
        if to is not None:
            check_version(to, "to")
        with self._db().begin() as conn:
            model_id = self._model_id(conn, model)
            locked = self._lock_alias(conn, model_id, alias)
            current = None if locked is None else locked[0]
            if locked is None or current is None:
                raise points_to_nothing(model, alias)
            if expect != ANY and expect != current:  # the caller's premise is gone: that, not the target, is news
                raise cas_lost(model, alias, expect, current)
            if to is None:
                to = self._target(conn, model_id, model, alias, current)
            elif to == current:
                raise already_there(model, alias, to)
            return self._move(conn, model_id, model, alias, locked, to, expect, actor, reason, "rollback",
                              force=force)

    def _target(self, conn: sa.Connection, model_id: int, model: str, alias: str, current: int) -> int:
        history = self._alias_history(conn, model_id, model, alias)
        target = default_target(history, current)
        if target is None:
            raise nothing_left(model, alias, current, history)
        return target

    # -- reading ------------------------------------------------------------
    def rollback_target(self, model: str, alias: str) -> int:
        """The version `rollback(model, alias)` without `to` would move the alias to now (the registry page
        shows it on its button); NothingToRollBackError saying why when there is none."""
        check_name(model, "model")
        check_name(alias, "alias")
        with self._db().connect() as conn:
            model_id = self._model_id(conn, model)
            current = conn.execute(sa.select(t.aliases.c.version).where(
                t.aliases.c.model_id == model_id, t.aliases.c.name == alias)).scalar()
            if current is None:
                raise points_to_nothing(model, alias)
            return self._target(conn, model_id, model, alias, int(current))

    def rollbacks(self, model: str, alias: str) -> dict[int, SwitchRecord]:
        """Versions a rollback moved `alias` away from, each with its latest such rollback (who, when, why)."""
        try:
            return rolled_back_from(self.history(model, alias))
        except NotFoundError:  # a model never published has nothing rolled back
            return {}

    def find_version(self, model: str, config_hash: str, checkpoint_tag: str) -> VersionRecord | None:
        """The version published from this run's checkpoint (same experiment key and tag), if any."""
        check_name(model, "model")
        with self._db().connect() as conn:
            row = conn.execute(
                sa.select(t.versions).select_from(t.versions.join(t.models, t.models.c.id == t.versions.c.model_id))
                .where(t.models.c.name == model, t.versions.c.config_hash == config_hash,
                       t.versions.c.checkpoint_tag == checkpoint_tag)
                .order_by(t.versions.c.version).limit(1)
            ).first()
        return None if row is None else self._version(row, model)

    def live_version(self, model: str, alias: str) -> VersionRecord | None:
        """The version an alias points to, or None (unknown model/alias or empty pointer)."""
        check_name(model, "model")
        check_name(alias, "alias")
        with self._db().connect() as conn:
            row = conn.execute(
                sa.select(t.versions)
                .select_from(t.aliases.join(t.models, t.models.c.id == t.aliases.c.model_id).join(
                    t.versions,
                    sa.and_(t.versions.c.model_id == t.aliases.c.model_id,
                            t.versions.c.version == t.aliases.c.version)))
                .where(t.models.c.name == model, t.aliases.c.name == alias)
            ).first()
        return None if row is None else self._version(row, model)

    def get_version(self, model: str, version: int) -> VersionRecord:
        check_name(model, "model")
        check_version(version)
        with self._db().connect() as conn:
            return self._get_version(conn, self._model_id(conn, model), model, version)

    def list_versions(self, model: str) -> list[VersionRecord]:
        check_name(model, "model")
        with self._db().connect() as conn:
            mid = self._model_id(conn, model)
            rows = conn.execute(
                sa.select(t.versions).where(t.versions.c.model_id == mid).order_by(t.versions.c.version)
            ).all()
        return [self._version(r, model) for r in rows]

    def history(self, model: str, alias: str | None = None) -> list[SwitchRecord]:
        """Alias moves, oldest first (per alias, by sequence number)."""
        check_name(model, "model")
        q = sa.select(t.history)
        if alias is not None:
            check_name(alias, "alias")
            q = q.where(t.history.c.alias == alias)
        with self._db().connect() as conn:
            mid = self._model_id(conn, model)
            rows = conn.execute(
                q.where(t.history.c.model_id == mid).order_by(t.history.c.alias, t.history.c.seq)
            ).all()
        return [self._switch(r, model) for r in rows]

    def aliases(self, model: str) -> dict[str, dict[str, Any]]:
        check_name(model, "model")
        with self._db().connect() as conn:
            mid = self._model_id(conn, model)
            rows = conn.execute(
                sa.select(t.aliases).where(t.aliases.c.model_id == mid).order_by(t.aliases.c.name)
            ).all()
        return {
            r._mapping["name"]: {"version": r._mapping["version"], "updated_by": r._mapping["updated_by"],
                                 "updated_at": _iso(r._mapping["updated_at"])}
            for r in rows
        }

    def models(self) -> list[dict[str, Any]]:
        """Every model with its version count and alias pointers."""
        with self._db().connect() as conn:
            counts = dict(conn.execute(
                sa.select(t.models.c.name, sa.func.count(t.versions.c.version))
                .select_from(t.models.outerjoin(t.versions, t.versions.c.model_id == t.models.c.id))
                .group_by(t.models.c.name)
            ).all())
            pointers = conn.execute(
                sa.select(t.models.c.name, t.aliases.c.name, t.aliases.c.version)
                .select_from(t.aliases.join(t.models, t.models.c.id == t.aliases.c.model_id))
            ).all()
        out: dict[str, dict[str, Any]] = {
            name: {"model": name, "versions": int(n), "aliases": {}} for name, n in counts.items()
        }
        for model, alias, version in pointers:
            out[model]["aliases"][alias] = version
        return [out[k] for k in sorted(out)]

    def show(self, model: str) -> dict[str, Any]:
        """JSON-able view of one model: its alias pointers and all versions, each with its lineage and the
        aliases it was rolled back from (`rolled_back_from`, alias -> the rollback's who/when/why)."""
        rolled: dict[int, dict[str, dict[str, Any]]] = {}
        for rec in self.history(model):
            if rec.action == "rollback" and rec.from_version is not None:
                rolled.setdefault(rec.from_version, {})[rec.alias] = {
                    "actor": rec.actor, "at": rec.at, "reason": rec.reason, "to_version": rec.to_version}
        return {
            "model": model,
            "aliases": self.aliases(model),
            "versions": [{**v.to_dict(), "rolled_back_from": rolled.get(v.version, {})}
                         for v in self.list_versions(model)],
        }
