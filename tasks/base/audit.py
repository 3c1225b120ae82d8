"""Who an audit record names (a version's `created_by`, an alias move's actor): the person behind the action.

The one resolver of that name: at a command line it is `$RETRAINER_ACTOR`, else the OS user; from Airflow
the caller passes the person who triggered or approved the run (plugins/retrainer_airflow reads them from
the run), joined to the run that acted for them by `via`. A run nobody started by hand (a schedule, a data
arrival) names only itself.
"""

from __future__ import annotations

import getpass
import os

MAX_PERSON = 100  # characters of a person's name kept in an actor (the registry caps actors at 200)


def default_actor() -> str:
    """The person at this command line: $RETRAINER_ACTOR, else the OS user."""
    try:
        return os.environ.get("RETRAINER_ACTOR") or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def via(person: str | None, system: str) -> str:
    """`alice via airflow rollback_model/<run>`: the person and what acted for them; `system` alone without one."""
    name = " ".join((person or "").split())[:MAX_PERSON]
    return f"{name} via {system}" if name else system
