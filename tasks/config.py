"""Job configuration: one YAML file per model, validated once at the edge.

Everything downstream receives a `JobConfig` and trusts it; nothing deep inside
re-checks these fields. String values may reference environment variables
(`${RETRAINER_HOME}`, or `${VAR:-default}`), expanded at load time so one config works on a
laptop and in a cluster. `RETRAINER_HOME` defaults to `./.retrainer` (made absolute).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.errors import ConfigError, validation_problems

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RopeScaling(_Strict):
    """Llama-3 rotary frequency scaling (HF `rope_scaling` with `rope_type: llama3`)."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)

    @model_validator(mode="after")
    def _bands(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})")
        return self


class ModelConfig(_Strict):
    """Decoder sizes; `family` picks the architecture (tasks.models). Llama-only fields are ignored by gpt."""

    vocab_size: int = Field(256, gt=0)
    seq_len: int = Field(64, gt=0)
    n_layers: int = Field(4, gt=0)
    d_model: int = Field(64, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int | None = Field(None, gt=0, description="defaults to n_heads (no GQA)")
    d_ff: int | None = Field(None, gt=0, description="defaults to 4 * d_model")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    family: Literal["gpt", "llama"] = "gpt"
    # Llama family only (gpt ignores them).
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    qkv_bias: bool = Field(False, description="bias on q/k/v projections (Qwen2-style)")

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.kv_heads})")
        if self.family == "llama":
            if self.dropout:
                raise ValueError(f"model.dropout ({self.dropout}) must be 0 for model.family 'llama' "
                                 "(Llama has no dropout layers)")
            if self.head_dim % 2:
                raise ValueError(f"model.d_model / model.n_heads ({self.head_dim}) must be even for rotary "
                                 "embeddings (model.family 'llama')")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class DataConfig(_Strict):
    """Where the dataset lives and where it is warmed to."""

    source_url: str = Field(description="fsspec URL of the dataset prefix (file://, s3://, ...)")
    manifest: str = Field("manifest.json", description="manifest key under source_url")
    cache_dir: str = Field(description="local SSD cache root")
    disk_budget_bytes: int | None = Field(None, gt=0)
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")


class ParallelConfig(_Strict):
    """3D layout: tensor x pipeline x data parallel."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 1
    micro_batches: int = Field(1, ge=1, description="gradient accumulation steps (pipeline micro-batches)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class TrainConfig(_Strict):
    steps: int = Field(50, gt=0)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    micro_batch_size: int = Field(8, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 on GPU, fp32 on CPU")
    activation_checkpointing: bool = False
    checkpoint_every: int = Field(10, gt=0)
    keep_last: int = Field(3, ge=1)
    seed: int = 1234
    output_dir: str = Field(description="run directory: checkpoints, telemetry, summary")
    nan_at_step: int | None = Field(
        None, ge=1, description="fault injection: make the loss non-finite at this step (tests)"
    )


class ClusterConfig(_Strict):
    launcher: Literal["local", "ssh", "slurm", "kubernetes"] = "local"
    nproc_per_node: int | None = Field(None, ge=1, description="defaults to world size / nodes")
    hosts: list[str] = Field(default_factory=list, description="ssh: one host per node")
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, gt=0, lt=65536)
    partition: str | None = None
    namespace: str = "default"
    image: str | None = None
    hang_timeout_s: float = Field(600.0, gt=0)
    # Hardware, for the planner.
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpus_per_node: int = Field(8, ge=1)
    intra_node_gbps: float = Field(450.0, gt=0, description="GB/s per GPU inside a node (NVLink)")
    inter_node_gbps: float = Field(50.0, gt=0, description="GB/s per node between nodes")
    peak_tflops: float = Field(989.0, gt=0, description="dense bf16 peak per GPU")
    assumed_mfu: float = Field(0.4, gt=0, le=1)


class GateConfig(_Strict):
    metric: Literal["loss"] = "loss"
    tolerance: float = Field(0.0, ge=0, description="publish if new <= live * (1 + tolerance)")


class EvaluateConfig(_Strict):
    batches: int = Field(8, gt=0)
    batch_size: int = Field(8, gt=0)
    gate: GateConfig = GateConfig()


class PublishConfig(_Strict):
    registry_url: str = Field(description="SQLAlchemy URL of the registry database")
    store_url: str = Field(description="fsspec URL of the artifact store")
    # The door of the lifecycle: names that reach URLs, Asset URIs, locks and logs are plain.
    # (The registry API itself stores any printable name safely; it is the config that says no.)
    model_name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    alias: str = Field("production", min_length=1, max_length=200, pattern=NAME_PATTERN)
    storage_options: dict[str, Any] = Field(default_factory=dict)


class JobConfig(_Strict):
    name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    schedule: str | None = Field(None, description="cron expression or preset for the retrain DAG")
    model: ModelConfig = ModelConfig()
    data: DataConfig
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig
    cluster: ClusterConfig = ClusterConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    publish: PublishConfig

    @model_validator(mode="after")
    def _layout(self) -> JobConfig:
        m, p = self.model, self.parallel
        if m.n_heads % p.tp or m.kv_heads % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.n_heads and n_kv_heads")
        if m.ffn % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.d_ff ({m.ffn})")
        if p.pp > m.n_layers:
            raise ValueError(f"parallel.pp ({p.pp}) cannot exceed model.n_layers ({m.n_layers})")
        if p.pp > 1 and p.zero_stage > 1:
            raise ValueError("parallel.zero_stage must be 0 or 1 with pipeline parallelism (pp > 1)")
        if p.tp > 1 and p.zero_stage == 0 and self.train.grad_clip > 0:
            # DeepSpeed's non-ZeRO clipping path mis-counts TP-sharded parameters: the weights drift from
            # the single-process reference (seen in the 3D-equality test). ZeRO-1 clips exactly.
            raise ValueError("parallel.zero_stage 0 with parallel.tp > 1 and train.grad_clip > 0 clips with a "
                             "wrong gradient norm; use zero_stage 1")
        return self

    def experiment_key(self) -> str:
        """sha256 of the canonical JSON of the fields that define the experiment.

        Run-time knobs (cluster, cache location, publish target, evaluation,
        fault injection) are left out: changing them does not make a new experiment.
        """
        defining = {
            "name": self.name,
            "model": self.model.model_dump(mode="json"),
            "data": {"source_url": self.data.source_url, "manifest": self.data.manifest},
            "parallel": self.parallel.model_dump(mode="json"),
            "train": self.train.model_dump(mode="json", exclude={"output_dir", "nan_at_step"}),
        }
        return sha256_json(defining)

    def with_overrides(self, overrides: dict[str, Any]) -> JobConfig:
        """Apply dotted overrides (`{"train.steps": 5}`) and validate the result again."""
        data = self.model_dump(mode="json")
        for dotted, value in overrides.items():
            node = data
            *parents, leaf = dotted.split(".")
            for key in parents:
                if not isinstance(node.get(key), dict):
                    raise ConfigError(f"override {dotted!r}: unknown section {key!r}")
                node = node[key]
            if leaf not in node:
                raise ConfigError(f"override {dotted!r}: unknown field {leaf!r}")
            node[leaf] = value
        return _validate(data, source="overrides")


def sha256_json(obj: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def retrainer_home() -> Path:
    return Path(os.environ.get("RETRAINER_HOME") or ".retrainer").resolve()


_VAR = re.compile(r"\$\{(\w+)(?::-([^${}]*))?\}")


def _expand_str(text: str) -> str:
    """Expand `${VAR}` and `${VAR:-default}` (innermost first, so defaults may hold variables)."""
    while True:
        expanded = _VAR.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), text)
        if expanded == text:
            return expanded
        text = expanded


def _expand(value: Any) -> Any:
    if isinstance(value, str):
        return _expand_str(value)
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def _validate(data: Any, source: str) -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config:\n  {validation_problems(exc)}") from None


def load_config(path: str | os.PathLike[str]) -> JobConfig:
    """Read, expand and validate a job config; raise ConfigError naming file and field."""
    path = Path(path)
    os.environ.setdefault("RETRAINER_HOME", str(retrainer_home()))
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
    return _validate(_expand(data), source=str(path))
