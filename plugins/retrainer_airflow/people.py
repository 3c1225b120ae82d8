"""Who a person is to an alias's policy: their roles under Airflow's auth manager (the Airflow contract).

tasks/base/policy.py checks names and roles against `publish.policy`; only Airflow knows the roles. Its own simple
auth manager (the standalone's, the README's) lists users and roles in `[core] simple_auth_manager_users`
(`alice:op,bob:user`) and ranks them viewer < user < op < admin in its permission checks, so a person holds
their role and every role below it, and `role:op` admits op and admin alike. With
`simple_auth_manager_all_admins` everyone is admin. Other auth managers (FAB, Keycloak, ...) keep roles where a
task cannot read them: a person's roles are then unknown (`Person.roles` None) and the policy admits them by
user name only, which the refusal says.
"""

from __future__ import annotations

from typing import Any

from airflow.configuration import conf

from tasks.base.policy import NotPermittedError, Person, admits

SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"


def _simple() -> bool:
    return conf.get("core", "auth_manager", fallback=SIMPLE_AUTH_MANAGER) == SIMPLE_AUTH_MANAGER


def _all_admins() -> bool:
    return conf.getboolean("core", "simple_auth_manager_all_admins", fallback=False)


def _ranked(role: str | None) -> frozenset[str]:
    """A simple-auth-manager role and every role it outranks (what its permission checks grant it)."""
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManagerRole

    held = next((r for r in SimpleAuthManagerRole if r.name.lower() == (role or "").lower()), None)
    if held is None:
        return frozenset()
    return frozenset(r.name.lower() for r in SimpleAuthManagerRole if r.order <= held.order)


def _simple_users() -> dict[str, str | None]:
    """User name -> role, as the simple auth manager reads its configuration."""
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    return {u.username: u.role for u in SimpleAuthManager.get_users()}


def person(name: str) -> Person:
    """The person called `name` with the roles the auth manager gives them (None where it cannot be read)."""
    if not _simple():
        return Person(name, None)
    if _all_admins():
        return Person(name, _ranked("admin"))
    return Person(name, _ranked(_simple_users().get(name)))


def run_starter(context: Any) -> Person:
    """The person who started this run, for a task that acts only for a person (a rollback, a forced
    promotion); a run nobody started by hand is refused."""
    from retrainer_airflow.audit import triggering_user

    name = triggering_user(context)
    if name is None:
        raise NotPermittedError("no person started this run: an alias moves by hand only for a person the "
                                "alias's policy admits (publish.policy.<alias>.movers)")
    return person(name)


def user_person(user: Any) -> Person:
    """The person behind an API request's user object (the registry page): by name, as above."""
    return person(str(user.get_name()))


def respondents(entries: tuple[str, ...], excluding: str | None) -> list[dict[str, str]] | None:
    """The users Airflow should let answer an approval (its HITL `assigned_users`: the API refuses anyone
    else): those `entries` admit, less `excluding` (the run's own starter, where self-approval is forbidden).
    None where users cannot be listed (another auth manager, or everyone an admin): then anyone allowed to
    answer may, and the approval task checks who did."""
    if not _simple() or _all_admins():
        return None
    return [{"id": name, "name": name} for name, role in sorted(_simple_users().items())
            if name != excluding and admits(entries, Person(name, _ranked(role)))]
