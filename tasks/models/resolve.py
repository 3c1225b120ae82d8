"""A job config resolved once: the file's document with what it leaves to the outside filled in.

A config may leave a pretrained model's sizes to that model's config.json (model.pretrained). A run
resolves that once, when it starts (its plan task), and freezes the resolved document with the
run's overrides in its `ConfigSnapshot`: every later task, trigger and rank builds its config from
the snapshot with no network I/O, so a run never re-derives itself from mutable external state.
The snapshot keeps `${VAR}`s unexpanded: no secret is frozen into XCom or a trigger's row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tasks.base.errors import ConfigError, validation_problems
from tasks.config.load import apply_overrides, config_from_document, expand_vars, read_config_document
from tasks.config.model import ModelConfig
from tasks.config.schema import JobConfig
from tasks.models.pretrained import sizes_from_pretrained


def resolve_document(document: dict[str, Any], source: str) -> dict[str, Any]:
    """The document with a pretrained model's sizes (and family) written into its model section; the
    fields the document gives stay as written (`${VAR}`s included). A document without model.pretrained
    is resolved as it is. Every `${VAR}` of the document is checked set first, before anything is read."""
    model = expand_vars(document, source).get("model")
    if not (isinstance(model, dict) and model.get("pretrained")):
        return document
    try:
        given = ModelConfig.model_validate(model)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config:\n  {validation_problems(exc, 'model')}") from None
    # The sizes come from the pretrained config.json before the layout is checked against them.
    return {**document, "model": {**sizes_from_pretrained(given, source), **document["model"]}}


@dataclass(frozen=True)
class ConfigSnapshot:
    """A run's config, frozen when the run starts: the resolved document with the run's overrides set."""

    source: str
    document: dict[str, Any]

    @classmethod
    def take(cls, config_path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> ConfigSnapshot:
        """Read and resolve the file now; unset (None) overrides keep the config's values."""
        source = str(config_path)
        document = resolve_document(read_config_document(config_path), source)
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        return cls(source, apply_overrides(JobConfig, document, given))

    def config(self) -> JobConfig:
        """The validated config (no I/O; once per process)."""
        return config_from_document(JobConfig, self.document, source=self.source)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "document": self.document}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConfigSnapshot:
        return cls(data["source"], data["document"])


def load_config(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> JobConfig:
    """Read, resolve, expand and validate a job config with run-time overrides (a CLI flag, a DAG Param);
    ConfigError naming file and field."""
    return ConfigSnapshot.take(path, overrides).config()
