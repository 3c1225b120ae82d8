"""Loading a job config: the YAML document, its `${VAR}`s expanded, dotted overrides set, and validation once per
process by content. Generic over the schema (tasks/config/schema.py passes `JobConfig`), so the schema can use it
for `with_overrides` without an import cycle.

String values may reference environment variables (`${RETRAINER_HOME}`, or `${VAR:-default}`), expanded at load
time so one config works on a laptop and in a cluster; an unset `${VAR}` without a default is refused, naming it
and its key. `RETRAINER_HOME` defaults to `./.retrainer` (made absolute).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError

from tasks.base.errors import ConfigError, validation_problems
from tasks.base.home import retrainer_home

M = TypeVar("M", bound=BaseModel)


def _section(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The config section `key` of `model` (its annotation's model class, optional or not), else None."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for candidate in (field.annotation, *get_args(field.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def apply_overrides(schema: type[BaseModel], document: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config document with dotted overrides (`{"train.steps": 5}`) set; ConfigError naming an
    override whose section or field `schema` does not have. The document need not spell out defaults."""
    data = copy.deepcopy(document)
    for dotted, value in overrides.items():
        node, model = data, schema
        *parents, leaf = dotted.split(".")
        for key in parents:
            sub = _section(model, key)
            if sub is None or not isinstance(node.get(key) or {}, dict):
                raise ConfigError(f"override {dotted!r}: unknown section {key!r}")
            node[key] = dict(node.get(key) or {})
            node, model = node[key], sub
        if leaf not in model.model_fields:
            raise ConfigError(f"override {dotted!r}: unknown field {leaf!r}")
        node[leaf] = value
    return data


_VAR = re.compile(r"\$\{(\w+)(?::-([^${}]*))?\}")
# Stands for an unset `${VAR}` without a default while its text is expanded: innermost first, such a reference may
# sit in the default of a variable that is set (`${A:-${B}}`), where it is never used. No environment value holds NUL.
_UNSET = re.compile("\0(\\w+)\0")


def _expand_str(text: str, key: str) -> str:
    """Expand `${VAR}` and `${VAR:-default}` (innermost first, so defaults may hold variables). An unset `${VAR}`
    without a default is a ConfigError naming it and `key`: left as '' it would make a path or URL that fails
    only later, in another task. The message holds no value: another variable may be a secret."""
    def value(m: re.Match[str]) -> str:
        name, default, given = m.group(1), m.group(2), os.environ.get(m.group(1))
        if given:
            return given
        if default is not None:  # `${VAR:-}` included: an explicit empty string
            return default
        return "" if given == "" else f"\0{name}\0"  # set to '' is the person's choice; unset is not

    while True:
        expanded = _VAR.sub(value, text)
        if expanded == text:
            break
        text = expanded
    if unset := _UNSET.search(text):
        raise ConfigError(f"{key}: ${{{unset.group(1)}}} is not set (no default)")
    return text


def _expand(value: Any, key: str) -> Any:
    """`value` with its `${VAR}`s expanded; `key` is its dotted place in the config (named in errors)."""
    if isinstance(value, str):
        return _expand_str(value, key)
    if isinstance(value, dict):
        return {k: _expand(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{key}.{i}") for i, v in enumerate(value)]
    return value


# Validated configs by content (the expanded document and RETRAINER_HOME, which named defaults follow): a
# process validates each config once however many tasks, triggers or launches build it.
_VALIDATED: dict[str, BaseModel] = {}


def validated(schema: type[M], data: Any, source: str) -> M:
    """`data` validated as `schema`, once per process by content; ConfigError naming `source` and each problem."""
    key = hashlib.sha256(json.dumps([schema.__name__, str(retrainer_home()), data], sort_keys=True,
                                    default=repr).encode()).hexdigest()
    if (cached := _VALIDATED.get(key)) is not None:
        return cached  # type: ignore[return-value]  # cached under its schema's name
    try:
        cfg = schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config:\n  {validation_problems(exc)}") from None
    _VALIDATED[key] = cfg
    return cfg


def read_config_document(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config file's YAML mapping as written (variables not yet expanded).

    A DAG run snapshots this once, resolved (tasks/models/resolve.py), and every later task rebuilds the
    config from the snapshot, so editing the file mid-run changes nothing under the run, and the
    snapshot holds `${VAR}` references, never the secrets they expand to.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a YAML mapping, got {type(data).__name__}")
    return data


def expand_vars(document: dict[str, Any], source: str) -> dict[str, Any]:
    """A document with its `${VAR}`s expanded (RETRAINER_HOME defaulted first, so every process agrees); an
    unset `${VAR}` without a default is a ConfigError naming `source`, the key and the variable."""
    os.environ.setdefault("RETRAINER_HOME", str(retrainer_home()))
    try:
        return _expand(document, "")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def config_from_document(schema: type[M], document: dict[str, Any], source: str) -> M:
    """Expand `${VAR}`s and validate a resolved config document as `schema` (tasks/models/resolve.py: a pretrained
    model's sizes already in it); no I/O, and validated once per process by content."""
    return validated(schema, expand_vars(document, source), source=source)
