"""Error types shared across stages; each carries the CLI exit code it maps to."""

from __future__ import annotations

from typing import Any


class RetrainerError(RuntimeError):
    """A stage failed for a reason the user should read; `exit_code` is what the CLI returns."""

    exit_code = 1


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the file and field. CLI exit code 2."""


class InvalidInputError(RetrainerError):
    """Bad input (file, manifest, argument): the message names the culprit."""

    exit_code = 2


class PlanDoesNotFitError(RetrainerError):
    """The preflight plan says the launch cannot work."""

    exit_code = 3


class TrainingFailedError(RetrainerError):
    """Training stopped (non-finite loss, crashed rank, hang); nothing may be published."""


class LiveMovedError(RetrainerError):
    """The alias moved since the gate judged the candidate (e.g. a rollback while a person decided): the
    candidate was compared with another model than the one it would replace, so it is not published."""


class LockHeldError(RetrainerError):
    """Another run of the same experiment holds the lock."""


def validation_problems(exc: Any, prefix: str = "") -> str:
    """One line per problem of a pydantic ValidationError, each naming its dotted field (under `prefix`)."""
    return "\n  ".join(f"{'.'.join([prefix] * bool(prefix) + [str(p) for p in err['loc']]) or '(top level)'}: "
                        f"{err['msg']}" for err in exc.errors())
