"""Model families by name (`model.family`): each is a `ModelFamily` (tasks/models/family.py) in its own package.

The torch-free registry tasks.families names each family's package, so asking for one imports only
that family (and torch); the config and the planner's imports stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tasks.families import family_spec, spec_for_architecture

if TYPE_CHECKING:
    from tasks.models.family import ModelFamily


def get_family(name: str) -> ModelFamily:
    """The family object of `model.family` `name`; an unknown name is refused, listing the known ones."""
    return importlib.import_module(family_spec(name).package).FAMILY


def family_for_architecture(architectures: object) -> ModelFamily:
    """The family that reads a config.json `architectures` value (a one-element list); others are refused."""
    return get_family(spec_for_architecture(architectures).name)
