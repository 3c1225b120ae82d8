"""Model families by name (`model.family`): each is a `ModelFamily` (tasks/models/family.py) in its own package.

tasks.base.families names where each family object lives, so asking for one imports only
that family (and torch); the config and the planner's imports stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tasks.base.errors import InvalidInputError
from tasks.base.families import FAMILIES

if TYPE_CHECKING:
    from tasks.models.family import ModelFamily


def get_family(name: str) -> ModelFamily:
    """The family object of `model.family` `name`; an unknown name is refused, listing the known ones."""
    try:
        package = FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} is unknown; known: {', '.join(sorted(FAMILIES))}") from None
    return importlib.import_module(package).FAMILY


def family_for_architecture(architectures: object) -> ModelFamily:
    """The family that reads a config.json `architectures` value (a one-element list); others are refused."""
    known = {arch: name for name in FAMILIES for arch in get_family(name).architectures}
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in known:
        raise InvalidInputError(f"config.json architectures {architectures!r} is not supported; "
                                f"known: {', '.join(sorted(known))}")
    return get_family(known[architectures[0]])
