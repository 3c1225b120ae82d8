"""Who may move an alias and who may approve a move onto it: `publish.policy`, one entry per alias.

An alias is a promise to whoever serves it: `production` holds only a version that passed production's gate
and, where the policy says so, a person's approval. The policy names the people for each alias:
- `approval`: whether a publish or promotion onto the alias waits for a person (`required`) or not;
- `approvers`: who may give that approval, and `self_approval`: whether the person who started the run may
  approve it (by default not: a second pair of eyes is the point);
- `movers`: who may move the alias by hand outside the gate: roll it back, or force a promotion past its gate.
Each entry is a user name (`alice`) or a role (`role:op`). The rules here are plain: a `Person` (a name, and the
roles the auth manager gives them, or None where they cannot be read) against those lists. Who a person is
and which roles they hold is Airflow's knowledge (plugins/retrainer_airflow/people.py resolves it); a command
line has no authenticated person, so the CLI enforces only what needs none (README: who may do what).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.base.errors import RetrainerError

ROLE = "role:"
ENTRY_PATTERN = r"^(role:)?[A-Za-z0-9_.@+-][A-Za-z0-9_.@+ -]{0,199}$"  # a user name, or role:<name>
DEFAULT_PEOPLE = (f"{ROLE}op",)  # under Airflow's simple auth manager: op and admin (roles rank up)


class NotPermittedError(RetrainerError):
    """A person asked for something an alias's policy does not let them do. CLI exit code 2."""

    exit_code = 2


class AliasPolicy(BaseModel):
    """One alias's rules (`publish.policy.<alias>`); an alias not listed gets `publish.policy."*"` or these
    defaults: no approval, approvers and movers `role:op` (op and admin under the simple auth manager)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    approval: Literal["none", "required"] = Field(
        "none", description="required: a person in `approvers` approves a publish or promotion onto the alias")
    approvers: tuple[str, ...] = Field(DEFAULT_PEOPLE, min_length=1,
                                       description="who may approve: user names and role:<name> entries")
    movers: tuple[str, ...] = Field(DEFAULT_PEOPLE, min_length=1,
                                    description="who may roll the alias back, or force a promotion past its gate")
    self_approval: Literal["forbidden", "allowed"] = Field(
        "forbidden", description="whether the person who triggered a run may approve it")

    @field_validator("approvers", "movers")
    @classmethod
    def _entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [e for e in value if not re.fullmatch(ENTRY_PATTERN, e)]
        if bad:
            raise ValueError(f"each entry is a user name or role:<name>, got {bad}")
        return value


@dataclass(frozen=True)
class Person:
    """Someone acting through Airflow: their user name, and their roles (lower case), or None where the
    auth manager's roles cannot be read (then only entries naming them by user name admit them)."""

    name: str
    roles: frozenset[str] | None

    def describe(self) -> str:
        if self.roles is None:
            return f"{self.name} (roles unknown to retrainer under this auth manager: name users in the policy)"
        return f"{self.name} (role {', '.join(sorted(self.roles)) or 'none'})"


def admits(entries: tuple[str, ...], person: Person) -> bool:
    """Whether `person` is one of `entries`: named as a user, or holding a named role."""
    for entry in entries:
        if entry.startswith(ROLE):
            if person.roles is not None and entry[len(ROLE):].lower() in person.roles:
                return True
        elif entry == person.name:
            return True
    return False


def _people(entries: tuple[str, ...]) -> str:
    return ", ".join(entries)


def check_mover(policy: AliasPolicy, alias: str, person: Person, action: str) -> None:
    """Refuse `action` (a rollback, a forced promotion) on `alias` by someone its movers do not admit."""
    if not admits(policy.movers, person):
        raise NotPermittedError(
            f"{person.describe()} may not {action} {alias!r}: publish.policy.{alias}.movers is "
            f"[{_people(policy.movers)}]")


def check_approver(policy: AliasPolicy, alias: str, person: Person, triggered_by: str | None) -> None:
    """Refuse an approval of a move onto `alias` by someone its approvers do not admit, or by the person who
    started the run when the alias forbids self-approval."""
    if not admits(policy.approvers, person):
        raise NotPermittedError(
            f"{person.describe()} may not approve a move onto {alias!r}: publish.policy.{alias}.approvers is "
            f"[{_people(policy.approvers)}]")
    if policy.self_approval == "forbidden" and triggered_by is not None and person.name == triggered_by:
        raise NotPermittedError(
            f"{person.name} started this run and may not approve it: publish.policy.{alias}.self_approval is "
            "forbidden (another approver answers)")
