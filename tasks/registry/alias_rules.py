"""The rules an alias move follows, read from the alias's history, and the refusals that name them: where a
rollback without a target goes (further back, never redo), that a version rolled back from an alias needs force to
return, that a rollback only goes back. Kept apart from the SQL (tasks/registry/core.py) so each rule reads as one
function."""

from __future__ import annotations

from collections.abc import Sequence

from tasks.registry.errors import (
    ConflictError,
    ForceRequiredError,
    NotFoundError,
    NothingToRollBackError,
    PromotionRequiredError,
    RolledBackError,
)
from tasks.registry.records import SwitchRecord


def no_model(model: str) -> NotFoundError:
    return NotFoundError(f"model {model!r} is not in the registry")


def no_version(model: str, version: int) -> NotFoundError:
    return NotFoundError(f"model {model!r} has no version {version}")


def cas_lost(model: str, alias: str, expect: int | None, current: int | None) -> ConflictError:
    want = "no version" if expect is None else f"version {expect}"
    have = "no version" if current is None else f"version {current}"
    return ConflictError(
        f"model {model!r} alias {alias!r}: expected {want} but it points to {have} "
        "(someone else moved it first); nothing changed"
    )


def points_to_nothing(model: str, alias: str) -> NothingToRollBackError:
    return NothingToRollBackError(f"model {model!r} alias {alias!r} points to nothing; nothing to roll back")


def first_version(model: str, alias: str, current: int) -> NothingToRollBackError:
    return NothingToRollBackError(
        f"model {model!r} alias {alias!r}: version {current} is the first version it ever "
        "pointed to; nothing to roll back to (use --to VERSION)"
    )


def already_there(model: str, alias: str, to: int) -> NothingToRollBackError:
    return NothingToRollBackError(f"model {model!r} alias {alias!r} already points to version {to}")


def rolled_back(model: str, alias: str, version: int) -> RolledBackError:
    return RolledBackError(
        f"model {model!r} alias {alias!r}: version {version} was rolled back from it; an automatic publish never "
        f"points it there again (an explicit, forced promotion can, audited: the promote_model DAG, or "
        f"`retrainer promote CONFIG --version {version} --force --reason WHY`)"
    )


def never_held(model: str, alias: str, version: int, held: Sequence[int] | None) -> PromotionRequiredError:
    before = "" if held is None else f" (it held: {', '.join(f'v{v}' for v in held) or 'none'})"
    return PromotionRequiredError(
        f"model {model!r} alias {alias!r}: version {version} was never live on it{before}; a rollback "
        f"only goes back. Putting v{version} on {alias} is a promotion, through {alias}'s gate and approvers: the "
        f"promote_model DAG, or `retrainer promote CONFIG --alias {alias} --version {version}`"
    )


def rollback_text(rec: SwitchRecord) -> str:
    return f"by {rec.actor} at {rec.at} (reason: {rec.reason!r})"


def needs_force(model: str, alias: str, version: int, rec: SwitchRecord) -> ForceRequiredError:
    return ForceRequiredError(
        f"model {model!r} alias {alias!r}: version {version} was rolled back from it {rollback_text(rec)}; "
        "to point it there again, force it and say why (CLI: --force --reason WHY; the rollback_model DAG "
        "and the registry page: force)"
    )


def nothing_left(model: str, alias: str, current: int, history: Sequence[SwitchRecord]) -> NothingToRollBackError:
    """Why a rollback without a target has nowhere to go: each earlier version was rolled back from the alias."""
    rolled = rolled_back_from(history)
    earlier = [v for v in dict.fromkeys(r.from_version for r in reversed(history)) if v is not None and v != current]
    if not earlier:
        return first_version(model, alias, current)
    why = "; ".join(f"v{v} {rollback_text(rolled[v])}" for v in earlier)
    return NothingToRollBackError(
        f"model {model!r} alias {alias!r}: every version live on it before version {current} was rolled back "
        f"from it ({why}); nothing to roll back to (to put one back anyway: --to VERSION --force --reason WHY)"
    )


def rolled_back_from(history: Sequence[SwitchRecord]) -> dict[int, SwitchRecord]:
    """Versions a rollback moved the alias away from, each with its latest such rollback; `history` is one
    alias's, oldest first."""
    return {r.from_version: r for r in history if r.action == "rollback" and r.from_version is not None}


def default_target(history: Sequence[SwitchRecord], current: int) -> int | None:
    """Where a rollback without a target goes: the newest version live on the alias before `current` that no
    rollback moved it away from (rolling back twice means further back, never redo); None if there is none."""
    rolled = rolled_back_from(history)
    for rec in reversed(history):
        if rec.from_version is not None and rec.from_version != current and rec.from_version not in rolled:
            return rec.from_version
    return None


def disagree(model: str, alias: str) -> ConflictError:
    return ConflictError(f"model {model!r} alias {alias!r}: pointer and history disagree")
