"""Registry error types; each maps to a CLI exit code through its base class."""

from __future__ import annotations

from tasks.base.errors import InvalidInputError, RetrainerError


class NotFoundError(InvalidInputError):
    """A model, version or alias named by the caller does not exist."""


class InvalidNameError(InvalidInputError):
    """A model/alias/actor name is empty, too long or contains control characters."""


class ConflictError(RetrainerError):
    """Compare-and-swap lost: the pointer was moved by someone else first."""


class RolledBackError(ConflictError):
    """An automatic publish tried to point an alias back at a version that was rolled back from it."""


class ForceRequiredError(RolledBackError):
    """An explicit promote or rollback named a version rolled back from the alias, without force."""


class PromotionRequiredError(InvalidInputError):
    """A rollback named a version the alias never held: putting it there is a promotion, through the alias's gate
    and approvers (revision 0009's trigger refuses it in the database too)."""


class NothingToRollBackError(RetrainerError):
    """The alias has no earlier version to go back to."""


class CorruptArtifactError(RetrainerError):
    """An artifact's bytes do not match its content address."""


class SchemaVersionError(RetrainerError):
    """The registry database is not at the schema revision this code needs (`retrainer db upgrade` fixes it).

    Exit code 1: the database is not ready (a deployment step is missing, or another process is upgrading
    it right now), not a wrong argument.
    """
