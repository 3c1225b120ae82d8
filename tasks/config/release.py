"""The `publish`, `retention` and `deploy` sections: who may move which alias, what is kept, how a version
reaches serving."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tasks.base.policy import AliasPolicy
from tasks.config.bounds import MAX_WAIT_S, NAME_PATTERN, Strict
from tasks.config.cluster import AbsolutePath
from tasks.config.evaluation import ENTRY_POINT_PATTERN, ExportDtype

ApprovalMode = Literal["none", "required"]
ANY_ALIAS = "*"  # publish.policy's entry for every alias not listed


class PublishConfig(Strict):
    registry_url: str = Field(description="SQLAlchemy URL of the registry database")
    store_url: str = Field(description="fsspec URL of the artifact store")
    # The door of the lifecycle: names that reach URLs, Asset URIs, locks and logs are plain.
    # (The registry API itself stores any printable name safely; it is the config that says no.)
    model_name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN,
                            description="the registry's model (default: the job's name)")
    alias: str = Field("production", min_length=1, max_length=200, pattern=NAME_PATTERN)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    export_dtype: ExportDtype = Field("bf16", description="dtype of the published safetensors")
    lora_export: Literal["adapter", "merged", "both"] = Field(
        "adapter", description="with train.lora: a PEFT adapter directory (served by vLLM --enable-lora), the base "
                               "with the adapter merged in (a normal model directory), or both")
    approval: ApprovalMode | dict[str, ApprovalMode] = Field(
        "none", description="the older form of publish.policy.<alias>.approval: one mode for every alias, or per "
                            "alias ({production: required}); kept working, but not together with `policy`")
    policy: dict[str, AliasPolicy] = Field(
        default_factory=dict, description="per alias (or \"*\" for every alias not listed): approval, approvers, "
                                          "movers, self_approval (tasks/base/policy.py; README: who may do what)")
    approval_timeout_s: float = Field(24 * 3600.0, gt=0, le=MAX_WAIT_S,
                                      description="how long an approval waits for an answer; no answer in time "
                                                  "rejects the candidate (nothing is published)")

    @field_validator("approval", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> Any:
        modes = ("none", "required")
        if isinstance(value, dict):
            bad = {alias: mode for alias, mode in value.items()
                   if mode not in modes or not isinstance(alias, str) or not re.fullmatch(NAME_PATTERN, alias)}
            if bad:
                raise ValueError(f"alias -> mode, each alias a plain name ({NAME_PATTERN}) and each mode one of "
                                 f"{modes}: got {bad}")
        elif value not in modes:
            raise ValueError(f"one of {modes}, or a mapping alias -> mode (e.g. {{production: required}}): "
                             f"got {value!r}")
        return value

    @field_validator("policy")
    @classmethod
    def _policy_aliases(cls, value: dict[str, AliasPolicy]) -> dict[str, AliasPolicy]:
        bad = [alias for alias in value if alias != ANY_ALIAS and not re.fullmatch(NAME_PATTERN, alias)]
        if bad:
            raise ValueError(f"each key is an alias ({NAME_PATTERN}) or \"{ANY_ALIAS}\" (every other alias), got {bad}")
        return value

    @model_validator(mode="after")
    def _approval_in_one_place(self) -> PublishConfig:
        """The older `approval` becomes policy entries (and reads `none` after), so every reader asks `policy_for`
        and a dumped config validates again; both given at once could disagree, so that is refused, saying
        where approval goes now."""
        if self.approval == "none":
            return self
        if self.policy:
            raise ValueError("publish.approval and publish.policy both given: state approval in the policy "
                             "(publish.policy.<alias>.approval: required; publish.approval is its older form)")
        legacy = {ANY_ALIAS: self.approval} if isinstance(self.approval, str) else self.approval
        object.__setattr__(self, "policy", {alias: AliasPolicy(approval=mode) for alias, mode in legacy.items()})
        object.__setattr__(self, "approval", "none")
        return self

    def policy_for(self, alias: str) -> AliasPolicy:
        """The rules of `alias`: its own entry, else the "*" entry, else the defaults."""
        return self.policy.get(alias) or self.policy.get(ANY_ALIAS) or AliasPolicy()

    @property
    def approval_required(self) -> bool:
        """Whether publishing to this config's alias (the run's, after a form override) waits for a person."""
        return self.policy_for(self.alias).approval == "required"


class RetentionConfig(Strict):
    """What housekeeping keeps: the pruning right after a publish and `retrainer gc` (tasks/stages/housekeeping.py).

    The artifacts of every registry version are never deleted, whatever these say: every version an
    alias ever pointed to (indeed every version) still pulls and verifies. They decide the run
    directories (checkpoints) and the store objects no version references.
    """

    prune_checkpoints: bool = Field(True, description="once a run's version is live, delete the run's other "
                                    "checkpoints (local and mirror), keeping the one it came from: right after "
                                    "the publish, and in `retrainer gc`")
    keep_versions: int = Field(2, ge=0, description="per alias, the runs of the versions it pointed to last (the "
                               "live one first) keep their checkpoint; 0: the registry artifact is enough")
    keep_runs: int = Field(3, ge=0, description="the newest run directories are kept, whatever they hold")
    keep_days: float = Field(14.0, ge=0, description="run directories active in the last days are kept")
    grace_hours: float = Field(24.0, ge=0, description="nothing younger is deleted: a store object no version "
                               "references yet (an export or publish in flight), a run directory")


_QUEUE = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]*$"  # an executor queue name (Celery: a worker's `-q` name)


class SmokeTestConfig(Strict):
    """What a deploy checks before handing a version to the hook (tasks/deploy): it loads with transformers,
    reproduces the version's evaluated held-out loss and generates tokens."""

    generate_tokens: int = Field(8, ge=1, le=4096, description="new tokens generated greedily; each must come "
                                 "with finite scores")
    prompt: str | None = Field(None, min_length=1, max_length=10_000,
                               description="text prompt (needs the export's tokenizer); None: the first tokens "
                                           "of a held-out window")
    loss_tolerance: float | None = Field(
        0.02, gt=0, le=10, description="largest relative difference between the held-out loss the served "
                                       "weights give and the one the version was evaluated at, on the same "
                                       "windows; None: not compared")
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="dtype the model is loaded in "
                                                   "(auto: the export's)")
    timeout_s: float = Field(1800.0, gt=0, le=MAX_WAIT_S,
                             description="for loading, scoring and generating together")


class DeployConfig(Strict):
    """The deploy DAG (dags/deploy.py): on every move of `alias`, pull the version now live onto the serving
    host, smoke-test it and hand it to the hook; a failure rolls the alias back (audited)."""

    enabled: bool = False
    alias: str | None = Field(None, min_length=1, max_length=200, pattern=NAME_PATTERN,
                              description="the alias whose moves are deployed; None: publish.alias")
    models_dir: AbsolutePath | None = Field(
        None, description="where versions land on the serving host (<models_dir>/v<N>-<digest>); "
                          "None: <data.cache_dir>/deploy/<publish.model_name>")
    smoke_test: SmokeTestConfig = SmokeTestConfig()
    command: str | None = Field(None, min_length=1, max_length=10_000,
                                description="shell command that deploys; the version reaches it as "
                                            "RETRAINER_DEPLOY_* environment variables")
    entry_point: str | None = Field(None, pattern=ENTRY_POINT_PATTERN, description="module:function(DeployTarget) "
                                    "that deploys, called in a process of its own")
    hook_timeout_s: float = Field(600.0, gt=0, le=MAX_WAIT_S)
    queue: str | None = Field(None, max_length=200, pattern=_QUEUE,
                              description="executor queue of the deploy tasks: the serving host's workers; "
                                          "None: the default queue")

    @model_validator(mode="after")
    def _one_hook(self) -> DeployConfig:
        if self.command is not None and self.entry_point is not None:
            raise ValueError("deploy: set one of deploy.command and deploy.entry_point, not both")
        if self.enabled and self.command is None and self.entry_point is None:
            raise ValueError("deploy.enabled needs a hook that deploys: deploy.command (a shell command) or "
                             "deploy.entry_point (module:function)")
        return self
