"""CLI verbs for the registry: db upgrade, publish, rollback, registry show/history/models/pull (promote, which
runs the alias's gate, is tasks/cli/promote.py).

The registry URL comes from `--db`, else `RETRAINER_DB_URL`, else
`sqlite:///$RETRAINER_HOME/registry.db` (`publish` uses the config's
publish.registry_url unless `--db` is given). Only `db upgrade` changes the schema;
every other verb checks it and, on a database that is not at the newest revision
(or was never migrated), stops with one line naming the database and exit code 1
(SchemaVersionError). `--json` prints machine-readable output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from tasks.base.audit import default_actor
from tasks.base.errors import InvalidInputError

MAIN_ALIAS = "production"


def _db(args: argparse.Namespace) -> str:
    from tasks.config.endpoints import registry_url

    return registry_url(given=args.db)


def _expect(text: str) -> int | str | None:
    if text.upper() == "ANY":
        return "ANY"
    if text.lower() in ("none", "empty"):
        return None
    try:
        return _positive(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'none', 'ANY')") from None  # argparse names --expect


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a version number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a version number must be >= 1, got {value}")
    return value


def _storage_options(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--storage-options: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options: must be a JSON object")
    return value


def _emit(args: argparse.Namespace, obj: Any, human: str) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) if args.json else human)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _switch_text(rec: Any) -> str:
    if not rec.changed:
        return f"{rec.model} {rec.alias}: already at version {rec.to_version}; nothing changed"
    frm = "nothing" if rec.from_version is None else f"version {rec.from_version}"
    return f"{rec.model} {rec.alias}: {frm} -> version {rec.to_version} ({rec.action}, seq {rec.seq})"


# -- handlers ---------------------------------------------------------------
def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from tasks.registry.migrate import current, upgrade

    url = _db(args)
    applied = upgrade(url)
    head = current(url)
    _emit(args, {"applied": applied, "current": head},
          f"applied: {', '.join(applied)}" if applied else f"schema already at {head}; nothing applied")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from tasks.models.resolve import load_config
    from tasks.stages.publish import publish

    cfg = load_config(args.config)
    try:
        metrics = json.loads(Path(args.metrics).read_text())
    except OSError as exc:
        raise InvalidInputError(f"{args.metrics}: cannot read metrics file: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidInputError(f"{args.metrics}: metrics file is not JSON: {exc}") from None
    result = publish(cfg, Path(args.checkpoint), metrics, serving_bytes=args.serving_bytes, actor=args.actor,
                     reason=args.reason, registry_url=args.db)
    verb = "published" if result.created else "already published as"
    prev = "nothing" if result.previous_version is None else f"version {result.previous_version}"
    _emit(args, dataclasses.asdict(result),
          f"{result.model}: {verb} version {result.version} ({result.digest[:12]}); "
          f"{result.alias}: {prev} -> version {result.version}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from tasks.registry import Registry

    with Registry(_db(args)) as reg:
        rec = reg.rollback(args.model, args.alias, to=args.to, expect=args.expect,
                           actor=args.actor or default_actor(), reason=args.reason, force=args.force)
    _emit(args, rec.to_dict(), _switch_text(rec))
    return 0


def _number(value: Any) -> str | None:
    """A recorded metric for a table cell (4 decimals), or None when the record has none."""
    return f"{value:.4f}" if isinstance(value, int | float) and not isinstance(value, bool) else None


def _gate(metrics: dict[str, Any]) -> str | None:
    """The gate's verdict at publish: pass (every rule passed), FAIL (one did not), None (no gate recorded)."""
    rules = [r for r in metrics.get("gate") or [] if isinstance(r, dict)]
    if not rules:
        return None
    return "pass" if all(r.get("passed") for r in rules) else "FAIL"


def cmd_show(args: argparse.Namespace) -> int:
    from tasks.registry import Registry
    from tasks.registry.records import origin

    with Registry(_db(args)) as reg:
        info = reg.show(args.model)
    lines = [f"model {info['model']}", "aliases:"]
    lines += [f"  {name} -> {a['version']}  (by {a['updated_by']} at {a['updated_at']})"
              for name, a in info["aliases"].items()] or ["  (none)"]
    rows = [[v["version"], origin(v["started_from"], v["parent_version"], v["init_digest"]),
             _number(v["metrics"].get("loss")), _number(v["metrics"].get("perplexity")), _gate(v["metrics"]),
             v["artifact_digest"][:12], v["size_bytes"], v["checkpoint_tag"], v["created_by"], v["created_at"],
             "; ".join(f"rolled back from {a}" for a in sorted(v["rolled_back_from"])) or None]
            for v in info["versions"]]
    lines += ["versions:", _table(rows, ["VERSION", "FROM", "LOSS", "PERPLEXITY", "GATE", "DIGEST", "BYTES",
                                         "CHECKPOINT", "BY", "AT", "NOTE"])]
    lines.append("(--json: each version's whole record: metrics, training config, lineage)")
    _emit(args, info, "\n".join(lines))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    from tasks.registry import Registry

    with Registry(_db(args)) as reg:
        recs = reg.history(args.model, args.alias)
        parents = {v.version: v.parent_version for v in reg.list_versions(args.model)}
    rows = [[r.alias, r.seq, r.action, r.from_version,
             f"{r.to_version} (from v{parents[r.to_version]})" if parents.get(r.to_version) else r.to_version,
             r.actor, r.at, r.reason] for r in recs]
    _emit(args, [{**r.to_dict(), "to_parent_version": parents.get(r.to_version)} for r in recs],
          _table(rows, ["ALIAS", "SEQ", "ACTION", "FROM", "TO", "ACTOR", "AT", "REASON"]))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tasks.registry import Registry

    with Registry(_db(args)) as reg:
        models = reg.models()
    rows = [[m["model"], m["versions"], ", ".join(f"{a}={v}" for a, v in sorted(m["aliases"].items()))]
            for m in models]
    _emit(args, models, _table(rows, ["MODEL", "VERSIONS", "ALIASES"]))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Fetch a version, verified, into an empty or new DEST: a tree as the directory itself, ready for
    `from_pretrained(DEST)`; a single-file version as DEST/consolidated.pt. Nothing is left on failure."""
    from tasks.registry import ArtifactStore, NotFoundError, Registry

    with Registry(_db(args)) as reg:
        if args.version is not None:
            rec = reg.get_version(args.model, args.version)
        else:
            alias = args.alias or MAIN_ALIAS
            rec = reg.live_version(args.model, alias)
            if rec is None:
                raise NotFoundError(f"model {args.model!r} alias {alias!r} points to no version")
    store = ArtifactStore.of_version(rec, args.storage_options, store_url=args.store)
    dest = store.pull(rec, args.dest)
    _emit(args, {"model": rec.model, "version": rec.version, "kind": rec.artifact_kind, "digest": rec.artifact_digest,
                 "size_bytes": rec.size_bytes, "store": store.url, "dest": str(dest)},
          f"{rec.model} v{rec.version}: {rec.artifact_kind} {rec.artifact_digest[:12]} ({rec.size_bytes} bytes, "
          f"verified) -> {dest}")
    return 0


# -- wiring -----------------------------------------------------------------


def _common(p: argparse.ArgumentParser, *, db_help: str = "registry database URL") -> None:
    p.add_argument("--db", help=f"{db_help} (default: $RETRAINER_DB_URL or sqlite under $RETRAINER_HOME)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _switch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--alias", default=MAIN_ALIAS, help=f"pointer to move (default {MAIN_ALIAS})")
    p.add_argument("--expect", type=_expect, default="ANY",
                   help="compare-and-swap: switch only if the alias is at this version ('none': empty; default: any)")
    p.add_argument("--actor", help="who (default $RETRAINER_ACTOR or the OS user)")
    p.add_argument("--force", action="store_true",
                   help="allow a version that was rolled back from this alias (say why with --reason)")


def register(subparsers: argparse._SubParsersAction) -> None:
    db = subparsers.add_parser("db", help="registry database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="SUBCOMMAND")
    up = db_sub.add_parser("upgrade", help="apply registry schema migrations (idempotent)")
    _common(up)
    up.set_defaults(handler=cmd_db_upgrade)

    pub = subparsers.add_parser("publish", help="publish a checkpoint as a new version and move the alias")
    pub.add_argument("config", help="job config YAML")
    pub.add_argument("--checkpoint", required=True, help="committed checkpoint dir (has COMPLETE); its Hugging "
                     "Face export is published")
    pub.add_argument("--metrics", required=True, help="JSON file with evaluation metrics")
    pub.add_argument("--serving-bytes", type=int, help="serving memory estimate in bytes")
    pub.add_argument("--reason", default="publish")
    pub.add_argument("--actor")
    _common(pub, db_help="registry URL overriding the config's publish.registry_url")
    pub.set_defaults(handler=cmd_publish)

    rb = subparsers.add_parser("rollback", help="move an alias back (default: to the newest version live before "
                               "the current one that was not itself rolled back from it)")
    _switch_args(rb)
    rb.add_argument("--to", type=_positive, help="roll back to this version instead")
    rb.add_argument("--reason", default="rollback")
    _common(rb)
    rb.set_defaults(handler=cmd_rollback)

    reg = subparsers.add_parser("registry", help="inspect the model registry")
    reg_sub = reg.add_subparsers(dest="registry_command", required=True, metavar="SUBCOMMAND")
    show = reg_sub.add_parser("show", help="aliases and versions of a model")
    show.add_argument("--model", required=True)
    _common(show)
    show.set_defaults(handler=cmd_show)
    hist = reg_sub.add_parser("history", help="audit trail of alias moves")
    hist.add_argument("--model", required=True)
    hist.add_argument("--alias")
    _common(hist)
    hist.set_defaults(handler=cmd_history)
    models = reg_sub.add_parser("models", help="all models with version counts and aliases")
    _common(models)
    models.set_defaults(handler=cmd_models)
    pull = reg_sub.add_parser("pull", help="fetch a version, verified, into an empty or new directory")
    pull.add_argument("--model", required=True)
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--alias", help=f"the version this alias points to (default {MAIN_ALIAS})")
    which.add_argument("--version", type=_positive, help="this version")
    pull.add_argument("dest", metavar="DEST", help="destination directory (must be absent or empty)")
    pull.add_argument("--store", help="artifact store URL (default: the store the version's artifact URL names)")
    pull.add_argument("--storage-options", type=_storage_options, default={}, metavar="JSON",
                      help="fsspec options for the store, e.g. an endpoint_url (credentials: from the environment)")
    _common(pull)
    pull.set_defaults(handler=cmd_pull)
