"""Job configuration's schema: one YAML file per model, validated once at the edge into a `JobConfig`; its
`model`, `cluster`, `evaluate`/`serving`, `publish`/`retention`/`deploy` and `tracking` sections have their own
modules.

Everything downstream receives a `JobConfig` and trusts it; nothing deep inside re-checks these fields. Loading
(YAML, `${VAR}` expansion, overrides, validation once per process) is tasks/config/load.py; which fields define
the experiment key is tasks/config/key.py.
"""

from __future__ import annotations

import math
import os
import re
from datetime import timedelta
from fractions import Fraction
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tasks.base.home import retrainer_home
from tasks.base.layout import Layout
from tasks.config.bounds import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_RANKS,
    MAX_SEED,
    MAX_STEPS,
    MAX_VERSION,
    MAX_WAIT_S,
    NAME_PATTERN,
    Strict,
)
from tasks.config.cluster import ClusterConfig, default_master_port
from tasks.config.duration import DURATION_HELP, Duration, format_duration
from tasks.config.evaluation import EvaluateConfig, ServingConfig
from tasks.config.key import fingerprint_of
from tasks.config.load import apply_overrides, validated
from tasks.config.model import ModelConfig, lora_refusal
from tasks.config.release import DeployConfig, PublishConfig, RetentionConfig
from tasks.config.tracking import TrackingConfig
from tasks.families import FAMILIES


class ReplaySource(Strict):
    """An earlier snapshot mixed into training (replay, against forgetting), drawn with `weight`."""

    source_url: str = Field(min_length=1, description="fsspec URL of the snapshot's prefix")
    weight: float = Field(gt=0, lt=1, description="share of every step's samples drawn from it")
    manifest: str = Field("manifest.json", description="manifest key under source_url")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")


class DataConfig(Strict):
    """Where the dataset lives and where it is warmed to.

    `replay` mixes earlier snapshots into training: each is warmed and verified like the primary
    `source_url`, which gets the rest of the weight (1 - the replay weights). Evaluation reads only
    the primary's held-out split: the gate compares models on the new data.
    """

    source_url: str = Field(description="fsspec URL of the dataset prefix (file://, s3://, ...)")
    manifest: str = Field("manifest.json", description="manifest key under source_url")
    cache_dir: str = Field(description="local SSD cache root")
    disk_budget_bytes: int | None = Field(None, gt=0, le=MAX_BYTES)
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")
    asset: str | None = Field(
        None, min_length=1, max_length=1500,
        description="Airflow Asset URI whose events start a retrain (data arrival); an event's "
                    "extra.source_url names the new snapshot to train on (default retrainer-data://<name>; "
                    "null: no data arrival)",
    )
    replay: tuple[ReplaySource, ...] = Field((), description="earlier snapshots drawn by weight besides "
                                             "source_url (which gets 1 - their sum)")

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        total = sum(r.weight for r in self.replay)
        if self.replay and total >= 1:
            raise ValueError(f"data.replay: the weights sum to {total:g}; data.source_url gets 1 - that, which "
                             "must be > 0")
        urls = [r.source_url.rstrip("/") for r in self.replay]
        twice = sorted({u for u in urls if urls.count(u) > 1 or u == self.source_url.rstrip("/")})
        if twice:
            raise ValueError(f"data.replay: {twice} listed twice (a source is mixed in once, with one weight)")
        return self


class ParallelConfig(Strict):
    """3D layout: tensor x pipeline x data parallel."""

    tp: int = Field(1, ge=1, le=MAX_RANKS)
    pp: int = Field(1, ge=1, le=MAX_RANKS)
    dp: int = Field(1, ge=1, le=MAX_RANKS)
    ep: int = Field(1, ge=1, le=MAX_RANKS, description="expert parallel: each mixture-of-experts layer's experts "
                    "split over ep of the data-parallel ranks (divides dp and model.num_experts)")
    zero_stage: Literal[0, 1, 2, 3] = 1
    micro_batches: int = Field(1, ge=1, le=MAX_BATCH,
                               description="gradient accumulation steps (pipeline micro-batches)")

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep)

    @model_validator(mode="after")
    def _world(self) -> ParallelConfig:
        if self.dp % self.ep:
            raise ValueError(f"parallel.ep ({self.ep}) must divide parallel.dp ({self.dp}): the expert-parallel "
                             "ranks are data-parallel ranks")
        if self.layout.world_size > MAX_RANKS:
            raise ValueError(f"tp x pp x dp = {self.layout.world_size} ranks, more than {MAX_RANKS}")
        return self


INIT_FROM_HELP = ("scratch, pretrained (model.pretrained), live (the alias's version when the run starts; "
                  "before a first version: model.pretrained if set, else scratch), version:N, or a path of weights")


# The adapter ranks vLLM serves (`--max-lora-rank` choices): an adapter of another rank cannot be deployed.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Strict):
    """Train a low-rank adapter on the frozen base instead of every weight (tasks/models/lora.py)."""

    rank: int = Field(description=f"adapter rank r, one of vLLM's {VLLM_LORA_RANKS}")
    alpha: float = Field(gt=0, description="the update is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input (PEFT's lora_dropout)")
    target_modules: tuple[str, ...] = Field(min_length=1, description="the family's block linears by their Hugging "
                                            "Face module names (q_proj, v_proj, ...), as PEFT names them")

    @field_validator("rank")
    @classmethod
    def _vllm_rank(cls, rank: int) -> int:
        if rank not in VLLM_LORA_RANKS:
            raise ValueError(f"{rank} is not a rank vLLM serves; use one of {', '.join(map(str, VLLM_LORA_RANKS))}")
        return rank


class TrainConfig(Strict):
    init_from: str = Field("scratch", min_length=1, description=INIT_FROM_HELP)
    steps: int = Field(50, gt=0, le=MAX_STEPS)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    micro_batch_size: int = Field(8, gt=0, le=MAX_BATCH)
    grad_clip: float = Field(1.0, ge=0)
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 on GPU, fp32 on CPU")
    activation_checkpointing: bool = False
    checkpoint_every: int = Field(10, gt=0, le=MAX_STEPS)
    checkpoint_url: str | None = Field(
        None, min_length=1, description="fsspec URL every committed checkpoint is mirrored to (needed when "
                                        "the checkpoint directory is each node's own disk)")
    checkpoint_storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")
    keep_last: int = Field(3, ge=1, le=MAX_STEPS)
    seed: int = Field(1234, ge=0, le=MAX_SEED)
    output_dir: str = Field(description="run directory: checkpoints, telemetry, summary (default "
                                        "$RETRAINER_HOME/runs/<name>)")
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter on the frozen base; None: full "
                                                        "fine-tuning")
    deadline: Duration | None = Field(
        None, description=f"alert (the DAG's deadline callback) when a retrain run is still not done this long "
                          f"after it was queued: {DURATION_HELP}; None: no alert")

    @field_validator("deadline")
    @classmethod
    def _positive(cls, value: timedelta | None) -> timedelta | None:
        if value is not None and value <= timedelta(0):
            raise ValueError(f"must be longer than zero, got {value.total_seconds():g} s")
        if value is not None and value.total_seconds() > MAX_WAIT_S:
            raise ValueError(f"must be at most {format_duration(MAX_WAIT_S)}, got {format_duration(value)}")
        return value

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: str) -> str:
        if value.startswith("version:") and not re.fullmatch(r"version:[1-9][0-9]*", value):
            raise ValueError(f"{value!r} must be version:N with N >= 1 ({INIT_FROM_HELP})")
        if value.startswith("version:") and int(value.removeprefix("version:")) > MAX_VERSION:
            raise ValueError(f"{value!r}: a version number is at most {MAX_VERSION}")
        return value


class RankCluster(Strict):
    """What a rank needs of `cluster`: the collective timeout, the peak for its MFU figure, and the device the
    run was planned for with the field that says so (`ClusterConfig.ranks_device`; None: the node decides)."""

    hang_timeout_s: float = Field(gt=0)
    peak_tflops: float = Field(gt=0)
    planned_device: tuple[Literal["gpu", "cpu"], str] | None = None


class TrainingJob(Strict):
    """What the training ranks receive: the job without data source, registry, store or engine options.

    Nothing here is a credential, so the file a launcher writes into the (often shared) run directory
    and every rank's environment stay free of secrets."""

    name: str
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    cluster: RankCluster


class ScheduleConfig(Strict):
    """When the retrain DAG runs and how it ranks against other models' runs for the GPUs.

    `schedule: "0 3 * * 1"` is short for `schedule: {cron: "0 3 * * 1"}`."""

    cron: str | None = Field(None, description="cron expression or preset; None: manual or data arrival only")
    priority: int = Field(0, ge=-10_000, le=10_000, description="higher trains first when the cluster's pool is "
                          "full: the train and evaluate tasks' Airflow priority_weight (and Slurm --priority with "
                          "cluster.slurm.job_priority)")

    @model_validator(mode="before")
    @classmethod
    def _cron_shorthand(cls, data: Any) -> Any:
        return {"cron": data} if isinstance(data, str) else data


class JobConfig(Strict):
    name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    schedule: ScheduleConfig = ScheduleConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig
    cluster: ClusterConfig = ClusterConfig()
    serving: ServingConfig = ServingConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    publish: PublishConfig
    retention: RetentionConfig = RetentionConfig()
    deploy: DeployConfig = DeployConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("schedule", mode="before")
    @classmethod
    def _no_schedule(cls, value: Any) -> Any:
        return ScheduleConfig() if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _named_defaults(cls, data: Any) -> Any:
        """What two models must not share follows `name` unless the config gives it (explicit values win, an
        explicit `data.asset: null` included): a second model is a copy of the config with a new name."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return data
        name = data["name"]
        data = dict(data)
        for (section, key), value in named_defaults(name).items():
            given = data.get(section, {}) if section == "cluster" else data.get(section)  # cluster is optional
            if isinstance(given, dict) and key not in given:
                data[section] = {**given, key: value}
        return data

    @model_validator(mode="after")
    def _layout(self) -> JobConfig:
        m, p = self.model, self.parallel
        if m.n_heads % p.tp or m.kv_heads % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.n_heads and n_kv_heads")
        if m.ffn % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.d_ff ({m.ffn})")
        if p.ep > 1:
            if m.num_experts is None:
                raise ValueError(f"parallel.ep ({p.ep}) splits a mixture of experts' experts; model.family "
                                 f"{m.family!r} has none")
            if m.num_experts % p.ep:
                raise ValueError(f"parallel.ep ({p.ep}) must divide model.num_experts ({m.num_experts})")
            if p.zero_stage not in (1, 2):
                # Each rank's share of the experts' optimizer state is saved by that rank only under ZeRO;
                # without it DeepSpeed saves the optimizer once per replica, from data-parallel rank 0.
                raise ValueError(f"parallel.ep ({p.ep}) needs parallel.zero_stage 1 or 2")
            if self.train.lora is not None:
                raise ValueError(f"parallel.ep ({p.ep}) with train.lora: the adapters leave the experts frozen, "
                                 "so there is nothing to split; use parallel.ep 1")
        if m.num_experts is not None and m.expert_ffn % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide the experts' width (model.moe_intermediate_size, "
                             f"null: model.d_ff: {m.expert_ffn})")
        if self.data.asset == f"dataset://{self.name}":
            raise ValueError(f"data.asset: {self.data.asset!r} is the Asset the warm task itself emits; "
                             "a retrain scheduled on it would trigger itself")
        if self.deploy.enabled and not FAMILIES[m.family].transformers_model:
            raise ValueError(f"deploy.enabled: the smoke test loads the export with transformers, and model.family "
                             f"{m.family!r} exports are not transformers models (every other family is)")
        if self.train.init_from == "pretrained" and m.pretrained is None:
            raise ValueError("train.init_from 'pretrained' needs model.pretrained (a Hugging Face model directory)")
        if p.pp > m.n_layers:
            raise ValueError(f"parallel.pp ({p.pp}) cannot exceed model.n_layers ({m.n_layers})")
        if (e := self.evaluate.parallel) is not None:
            if m.n_heads % e.tp or m.kv_heads % e.tp or m.ffn % e.tp:
                raise ValueError(f"evaluate.parallel.tp ({e.tp}) must divide model.n_heads, n_kv_heads and d_ff")
            if e.pp > m.n_layers:
                raise ValueError(f"evaluate.parallel.pp ({e.pp}) cannot exceed model.n_layers ({m.n_layers})")
        if p.pp > 1 and p.zero_stage > 1:
            raise ValueError("parallel.zero_stage must be 0 or 1 with pipeline parallelism (pp > 1)")
        if self.train.precision == "bf16" and (device := self.cluster.ranks_device) and device[0] == "cpu":
            raise ValueError(f"train.precision bf16 needs GPU ranks, and {device[1]} says they are CPU ranks; "
                             "use auto or fp32")
        batch = self.train.micro_batch_size * p.micro_batches * p.dp
        if batch > MAX_BATCH:
            raise ValueError(f"the global batch of {batch} (train.micro_batch_size x parallel.micro_batches x "
                             f"parallel.dp) exceeds {MAX_BATCH}")
        drawn = sum(math.ceil(Fraction(r.weight) * batch) for r in self.data.replay)
        if drawn > batch:  # tasks/train/data.py: the primary takes what the replay sources leave of a step
            raise ValueError(f"data.replay: the replay sources draw up to {drawn} samples in one step, more than "
                             f"the global batch of {batch} (train.micro_batch_size x parallel.micro_batches x "
                             "parallel.dp); use fewer replay sources or a larger batch")
        if m.base is not None and self.train.lora is None:
            raise ValueError("model.base names the frozen base of a LoRA adapter: set train.lora (or use "
                             "train.init_from to fine-tune a version in full)")
        if m.base is not None and m.pretrained is not None:
            raise ValueError("model.base and model.pretrained both name the base; give one")
        if self.train.lora is not None and (problem := lora_refusal(m, self.train.lora.target_modules)):
            raise ValueError(problem)
        if p.tp > 1 and p.zero_stage == 0 and self.train.grad_clip > 0:
            # DeepSpeed's non-ZeRO clipping path mis-counts TP-sharded parameters: the weights drift from
            # the single-process reference (seen in the 3D-equality test). ZeRO-1 clips exactly.
            raise ValueError("parallel.zero_stage 0 with parallel.tp > 1 and train.grad_clip > 0 clips with a "
                             "wrong gradient norm; use zero_stage 1")
        return self

    @property
    def lora_saves_adapters_only(self) -> bool:
        """Whether this run's checkpoints hold only the adapters and their optimizer states: a LoRA run whose
        frozen base is weights (model.base or model.pretrained, tasks/inputs/adapter.py `resolve_base`) reloads
        that base on resume; on a seeded base it saves everything."""
        return self.train.lora is not None and (self.model.base is not None or self.model.pretrained is not None)

    def fingerprint(self) -> str:
        """sha256 of the config fields that define what training computes, by the rules of tasks/config/key.py
        (tasks/runs/identity.py adds data and weights)."""
        return fingerprint_of(self.name, self.model.model_dump(mode="json"), self.parallel.model_dump(mode="json"),
                              self.train.model_dump(mode="json"))

    def training_job(self) -> TrainingJob:
        c = self.cluster
        from tasks.base.credentials import split_credentials

        model = self.model.model_copy(update={"pretrained_storage_options": {}})  # ranks get local weights
        public, _ = split_credentials(self.train.checkpoint_storage_options, "train.checkpoint_storage_options")
        train = self.train.model_copy(update={"checkpoint_storage_options": public})  # keys: by environment
        return TrainingJob(name=self.name, model=model, parallel=self.parallel, train=train,
                           cluster=RankCluster(hang_timeout_s=c.hang_timeout_s, peak_tflops=c.peak_tflops,
                                               planned_device=c.ranks_device))

    def with_overrides(self, overrides: dict[str, Any]) -> JobConfig:
        """Apply dotted overrides (`{"train.steps": 5}`) and validate the result again."""
        return validated(JobConfig, apply_overrides(JobConfig, self.model_dump(mode="json"), overrides),
                         source="overrides")

    def with_output_dir(self, output_dir: str | os.PathLike[str]) -> JobConfig:
        """This config writing under `output_dir` (a rank job's own directory, derived from a validated config):
        a copy, not a revalidation; no other field depends on where the output goes."""
        return self.model_copy(update={"train": self.train.model_copy(update={"output_dir": str(output_dir)})})


def named_defaults(name: str) -> dict[tuple[str, str], Any]:
    """(section, field) -> the default the model called `name` gets where its config leaves the field out."""
    return {("publish", "model_name"): name,
            ("data", "asset"): f"retrainer-data://{name}",
            ("train", "output_dir"): str(retrainer_home() / "runs" / name),
            ("cluster", "master_port"): default_master_port(name)}
