"""Which version a deploy puts into service: the one the alias points to now, and how it became live.

`DeployTarget` is also what a hook receives (rebuilt from the `RETRAINER_DEPLOY_*` environment in the hook's
process), so its fields are the hook's contract.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tasks.base.errors import RetrainerError
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig

log = logging.getLogger(__name__)

ENV_PREFIX = "RETRAINER_DEPLOY_"


class DeployError(RetrainerError):
    """A deploy stage failed; the message names the stage and why (the rollback's audited reason)."""


@dataclass(frozen=True)
class DeployTarget:
    """The version a deploy puts into service, and how it became live: what the hook receives."""

    model: str
    alias: str
    version: int
    digest: str
    model_dir: str  # the verified local copy on the serving host
    moved_by: str  # the action of the alias move that made it live: publish, promote or rollback
    moved_from: int | None  # the version live before that move
    event_version: int | None  # what the triggering event said (None: no event, e.g. the CLI)

    @property
    def via_rollback(self) -> bool:
        return self.moved_by == "rollback"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> DeployTarget:
        return cls(**{f.name: obj[f.name] for f in fields(cls)})

    def env(self) -> dict[str, str]:
        """Each field as RETRAINER_DEPLOY_<FIELD> (RETRAINER_DEPLOY_MODEL_DIR, ..._VERSION, ...; None: empty)."""
        return {f"{ENV_PREFIX}{k.upper()}": "" if v is None else str(v) for k, v in self.to_dict().items()}

    @classmethod
    def from_env(cls, env: dict[str, str]) -> DeployTarget:
        values: dict[str, Any] = {f.name: env[f"{ENV_PREFIX}{f.name.upper()}"] for f in fields(cls)}
        for name in ("version", "moved_from", "event_version"):
            values[name] = int(values[name]) if values[name] else None
        return cls(**values)


def deploy_alias(cfg: JobConfig) -> str:
    return cfg.deploy.alias or cfg.publish.alias


def models_dir(cfg: JobConfig) -> Path:
    """Where pulled versions live on the serving host."""
    return Path(cfg.deploy.models_dir or Path(cfg.data.cache_dir) / "deploy" / cfg.publish.model_name)


def event_version(event_extras: list[dict[str, Any]]) -> int | None:
    """The version the newest alias-moved event names (`extra.version`), if any."""
    for extra in reversed(event_extras):
        version = (extra or {}).get("version")
        if isinstance(version, int) and not isinstance(version, bool):
            return version
    return None


def resolve_target(cfg: JobConfig, event_extras: list[dict[str, Any]] | None = None) -> DeployTarget:
    """The version the alias points to now, with the history row of the move that made it live."""
    model, alias = cfg.publish.model_name, deploy_alias(cfg)
    registry = registry_for(cfg)
    history = registry.history(model, alias)  # a pointer and its history row are written in one transaction
    if not history:
        raise DeployError(f"pull failed: {model} alias {alias!r} points to no version; nothing to deploy")
    last = history[-1]
    rec = registry.get_version(model, last.to_version)
    said = event_version(event_extras or [])
    if said is not None and said != rec.version:
        log.warning("deploy: the event said %s/%s moved to v%d, it points to v%d now: deploying v%d (the later "
                    "move's own event deploys again)", model, alias, said, rec.version, rec.version)
    target = DeployTarget(model=model, alias=alias, version=rec.version, digest=rec.artifact_digest,
                          model_dir=str(models_dir(cfg) / f"v{rec.version}-{rec.artifact_digest[:12]}"),
                          moved_by=last.action, moved_from=last.from_version, event_version=said)
    log.info("deploy: %s/%s is v%d (%s by %s from %s: %s)", model, alias, rec.version, last.action, last.actor,
             "nothing" if last.from_version is None else f"v{last.from_version}", last.reason)
    return target
