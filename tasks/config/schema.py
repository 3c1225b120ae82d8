"""Job configuration's schema: one YAML file per model, validated once at the edge into a `JobConfig`.

Everything downstream receives a `JobConfig` and trusts it; nothing deep inside re-checks these fields. Loading
(YAML, `${VAR}` expansion, overrides, validation once per process) is tasks/config/load.py; which fields define
the experiment key is tasks/config/key.py.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import sys
from datetime import timedelta
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from tasks import REPO_ROOT
from tasks.base.dataset_format import MAX_VOCAB
from tasks.base.home import retrainer_home
from tasks.base.layout import Layout
from tasks.base.policy import AliasPolicy
from tasks.config.duration import DURATION_HELP, Duration, format_duration
from tasks.config.key import fingerprint_of
from tasks.config.load import apply_overrides, validated
from tasks.families import FAMILIES, family_spec

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Upper bounds of the numeric fields, far above any real job: a typo or a 2^64 is refused by name at load, before
# a rank starts, and the products the planner and the ranks form stay inside int64.
# Model sizes: 2^20 is 40x the widest model today (d_model 25600, d_ff 73728) and 8000x the deepest (126 layers);
# vocabularies: what a dataset's widest token dtype holds (tasks/base/dataset_format.py).
MAX_WIDTH = 2**20
# Positions: 2^24 tokens (16.7M), above the longest context today (10M).
MAX_POSITIONS = 2**24
# Ranks, GPUs and nodes: a million (2^20) is beyond any cluster built.
MAX_RANKS = 2**20
# Steps: 10^9 is three years at 0.1 s a step; it bounds the warmup, the checkpoint interval and the checkpoints kept.
MAX_STEPS = 10**9
# Sequences in a batch, and the global batch (micro_batch_size x micro_batches x dp): 2^24, so the samples a run
# draws (global batch x steps < 2^54) stay int64 indices (tasks/train/data.py Sampler).
MAX_BATCH = 2**24
# Evaluation: batches x batch_size <= 2^28 windows, whose indices tasks/evaluate/spec.py holds at once.
MAX_EVAL_BATCHES, MAX_EVAL_BATCH_SIZE = 2**16, 2**12
# Seeds: numpy's legacy seeding takes < 2^32, and torch's generators take seed x 100_003 + layer
# (tasks/models/common/init.py) in 64 bits; numpy's SeedSequence refuses a negative seed.
MAX_SEED = 2**32 - 1
# Registry versions: the registry's version columns are 32-bit INTEGERs (sql/versions/0001_registry.py).
MAX_VERSION = 2**31 - 1
# Byte counts: 64-bit, as the OS reports sizes (off_t).
MAX_BYTES = 2**63 - 1
# Waits: a timeout longer than a year is a typo, and an unbounded one (inf, 1e300) overflows threading's waits.
MAX_WAIT_S = 365 * 24 * 3600


# rope_type -> (the RopeScaling fields it requires, those it may set) besides `factor`; no other field is its.
ROPE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama3": (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "linear": ((), ()),
    "yarn": (("original_max_position_embeddings",), ("beta_fast", "beta_slow", "attention_factor")),
}


class RopeScaling(_Strict):
    """Rotary frequency scaling (HF `rope_scaling`), as transformers computes it: `llama3` (three bands: Llama
    3.1+), `linear` (every frequency / factor: Gemma 3's global layers) or `yarn` (Qwen long context: low
    frequencies interpolated, cos/sin scaled by attention_factor). Which family takes which:
    tasks.families (each family's `rope_types`)."""

    rope_type: Literal["llama3", "linear", "yarn"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float | None = Field(None, gt=0, description="llama3")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3")
    original_max_position_embeddings: int | None = Field(None, gt=0, le=MAX_POSITIONS,
                                                         description="llama3, yarn: the pretraining context")
    beta_fast: float | None = Field(None, gt=0, description="yarn; null = 32")
    beta_slow: float | None = Field(None, gt=0, description="yarn; null = 1")
    attention_factor: float | None = Field(None, gt=0, description="yarn: the cos/sin scale; null = "
                                                                   "0.1 ln(factor) + 1")

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> RopeScaling:
        required, optional = ROPE_FIELDS[self.rope_type]
        for field in sorted({f for fields in ROPE_FIELDS.values() for group in fields for f in group}):
            value = getattr(self, field)
            if value is None and field in required:
                raise ValueError(f"model.rope_scaling.{field} is required for rope_type {self.rope_type!r}")
            if value is not None and field not in required + optional:
                raise ValueError(f"model.rope_scaling.{field} is not a field of rope_type {self.rope_type!r} "
                                 f"(its fields: {', '.join(('factor', *required, *optional))})")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})")
        return self


class BaseModelRef(_Strict):
    """A registry version as a LoRA run's frozen base (`model.base`): a version number or an alias's version."""

    model: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN, description="registered model name")
    version: int | None = Field(None, ge=1, le=MAX_VERSION)
    alias: str | None = Field(None, min_length=1, max_length=200, pattern=NAME_PATTERN)

    @model_validator(mode="after")
    def _one(self) -> BaseModelRef:
        if (self.version is None) == (self.alias is None):
            raise ValueError("model.base: give exactly one of version and alias")
        return self


# ModelConfig fields every family has (sizes, where the model comes from): not options. A new ModelConfig field
# is an option no family has until a family's spec (tasks/families) lists it.
NOT_OPTIONS = frozenset({"vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "family",
                         "pretrained", "pretrained_storage_options", "base"})


def family_refusal(m: ModelConfig) -> str | None:
    """Why `m` cannot be trained as its family: the first option set that the family does not express,
    named with the family's supported ones; None when every option it sets is one the family has."""
    spec = FAMILIES[m.family]
    family, supported = m.family, spec.supported_options()
    for field, info in type(m).model_fields.items():
        if field in NOT_OPTIONS or field == "rope_scaling":  # rope_scaling: by its type, below
            continue
        value = getattr(m, field)
        if field in spec.always:
            if value is not True:
                return f"model.{field} must be true for model.family {family!r} (its attention always has it)"
            continue
        plain = m.d_model // m.n_heads if field == "head_dim" else info.default
        if value != plain and field not in supported:
            return (f"model.{field} ({value!r}) is not supported by model.family {family!r} "
                    f"(its options: {', '.join(supported)})")
    if m.rope_scaling is not None and m.rope_scaling.rope_type not in spec.rope_types:
        return (f"model.rope_scaling.rope_type {m.rope_scaling.rope_type!r} is not supported by model.family "
                f"{family!r} (supported: {spec.rope_types_text()})")
    return None


def lora_refusal(m: ModelConfig, target_modules: tuple[str, ...]) -> str | None:
    """Why `train.lora` cannot adapt `m`: target modules the family does not have (listing the ones it has);
    None when it can. A tied embedding is frozen base weight like any other (tasks/train/pipeline.py)."""
    known = FAMILIES[m.family].lora_targets
    unknown = [n for n in target_modules if n not in known]
    if unknown:
        return (f"train.lora.target_modules: unknown to model.family {m.family!r}: "
                f"{', '.join(map(repr, unknown))}; its modules: {', '.join(sorted(known))}")
    return None


class ModelConfig(_Strict):
    """Decoder sizes; `family` picks the architecture (tasks.models). An option the family does not express is
    refused here (tasks.families), never ignored."""

    vocab_size: int = Field(256, gt=0, le=MAX_VOCAB)
    seq_len: int = Field(64, gt=0, le=MAX_POSITIONS)
    n_layers: int = Field(4, gt=0, le=MAX_WIDTH)
    d_model: int = Field(64, gt=0, le=MAX_WIDTH)
    n_heads: int = Field(4, gt=0, le=MAX_WIDTH)
    n_kv_heads: int | None = Field(None, gt=0, le=MAX_WIDTH, description="defaults to n_heads (no GQA)")
    d_ff: int | None = Field(None, gt=0, le=MAX_WIDTH, description="defaults to 4 * d_model")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    family: str = Field("llama", description="a name in tasks.families.FAMILIES")
    # The rotary families' options (tasks.families says which family takes which).
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    qkv_bias: bool = Field(False, description="bias on q/k/v projections (Qwen2-style)")
    # Options of the llama-style blocks that families beyond Llama turn on (Qwen3, Mistral; Gemma next).
    head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="per-head width; null = d_model / n_heads")
    qk_norm: bool = Field(False, description="per-head RMSNorm on queries and keys before rotary (Qwen3-style)")
    sliding_window: int | None = Field(
        None, gt=0, le=MAX_POSITIONS, description="each position attends to the last W positions, itself included "
                                                  "(Mistral-style); null = full causal attention")
    # Gemma's options (tasks/models/gemma3): which layers slide, their rotary base, the softmax scale.
    sliding_window_pattern: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="with sliding_window: every Nth layer (N, 2N, ...) attends globally, "
                                              "the others slide (Gemma 3: 6); null = every layer slides")
    rope_local_base_freq: float | None = Field(None, gt=0, description="rotary base of the sliding layers; "
                                                                       "null = rope_theta")
    query_pre_attn_scalar: int | None = Field(None, gt=0, le=MAX_WIDTH,
                                              description="softmax scale = this ** -0.5; null = head_dim")
    attn_logit_softcapping: float | None = Field(None, gt=0, description="attention scores -> tanh(s / c) * c "
                                                                          "before the mask (Gemma 2); null = off")
    final_logit_softcapping: float | None = Field(None, gt=0, description="logits -> tanh(z / c) * c; null = off")
    pretrained: str | None = Field(
        None, min_length=1,
        description="a Hugging Face model directory (local path or fsspec URL): the sizes come from its "
                    "config.json, and train.init_from 'pretrained' (or 'live' before a first version) starts "
                    "from its weights",
    )
    pretrained_storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")
    base: BaseModelRef | None = Field(None, description="with train.lora: the registry version the adapter is "
                                                        "trained on (else model.pretrained is the base)")

    @field_validator("family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        family_spec(name)  # refuses an unknown name, listing the known ones
        return name

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                                 f"({self.n_heads}) unless model.head_dim is given")
            # Resolved once here (not a property) so the YAML field and every reader agree; not "set" by the user.
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.kv_heads})")
        # An option the family would ignore or could not export is refused. Without model.family a pretrained
        # config.json decides the family (checked again once it has).
        if not (self.pretrained and "family" not in self.model_fields_set):
            problem = family_refusal(self)
            if problem:
                raise ValueError(problem)
        if self.family != "gpt" and self.head_dim % 2:  # the llama-style families: rotary
            raise ValueError(f"model.head_dim ({self.head_dim}) must be even for rotary "
                             f"embeddings (model.family {self.family!r})")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def attention_span(self) -> int:
        """Positions one query attends to at most: seq_len, or the sliding window where it is shorter."""
        if self.sliding_window_pattern is not None and self.sliding_window_pattern <= self.n_layers:
            return self.seq_len  # some layers attend globally
        return min(self.seq_len, self.sliding_window or self.seq_len)


class ReplaySource(_Strict):
    """An earlier snapshot mixed into training (replay, against forgetting), drawn with `weight`."""

    source_url: str = Field(min_length=1, description="fsspec URL of the snapshot's prefix")
    weight: float = Field(gt=0, lt=1, description="share of every step's samples drawn from it")
    manifest: str = Field("manifest.json", description="manifest key under source_url")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")


class DataConfig(_Strict):
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


class ParallelConfig(_Strict):
    """3D layout: tensor x pipeline x data parallel."""

    tp: int = Field(1, ge=1, le=MAX_RANKS)
    pp: int = Field(1, ge=1, le=MAX_RANKS)
    dp: int = Field(1, ge=1, le=MAX_RANKS)
    zero_stage: Literal[0, 1, 2, 3] = 1
    micro_batches: int = Field(1, ge=1, le=MAX_BATCH,
                               description="gradient accumulation steps (pipeline micro-batches)")

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp)

    @model_validator(mode="after")
    def _world(self) -> ParallelConfig:
        if self.layout.world_size > MAX_RANKS:
            raise ValueError(f"tp x pp x dp = {self.layout.world_size} ranks, more than {MAX_RANKS}")
        return self


INIT_FROM_HELP = ("scratch, pretrained (model.pretrained), live (the alias's version when the run starts; "
                  "before a first version: model.pretrained if set, else scratch), version:N, or a path of weights")


# The adapter ranks vLLM serves (`--max-lora-rank` choices): an adapter of another rank cannot be deployed.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(_Strict):
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


class TrainConfig(_Strict):
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


# A Kubernetes resource.Quantity ("8", "500m", "64Gi"), as the PyTorchJob CRD checks it (tasks/launch/k8s_schema).
K8S_QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?"
                        r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_K8S_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # a DNS-1123 subdomain
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_LOGIN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"  # never a leading "-": ssh would read it as an option
_HOST = r"^[A-Za-z0-9_\[][A-Za-z0-9_.:%\[\]-]*$"
# sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (fields after the first below 60, hours after D- below 24).
_SLURM_TIME = re.compile(r"^(?:\d+-(?:[01]?\d|2[0-3])(?::[0-5]?\d){0,2}|\d+(?::[0-5]?\d){0,2})$")
# Planner fields renamed so the unit is in the name; an old name is refused with its new one.
_RENAMED = {
    "gpu_memory_gb": "gpu_memory_gib (GiB per GPU)",
    "intra_node_gbps": "intra_node_gbytes_per_s (GB/s per GPU inside a node)",
    "inter_node_gbps": "inter_node_gbytes_per_s (GB/s per node between nodes), or inter_node_gbits_per_s "
                       "(Gbit/s per node, as NICs are sold)",
}


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"must be an absolute path, got {path!r}")
    return path


def _quantity(value: str) -> str:
    if not re.fullmatch(K8S_QUANTITY_PATTERN, value):
        raise ValueError(f'not a Kubernetes quantity ({value!r}): e.g. "8", "500m", "64Gi"')
    return value


AbsolutePath = Annotated[str, AfterValidator(_absolute)]
Quantity = Annotated[str, AfterValidator(_quantity)]


class SshConfig(_Strict):
    """`ssh` engine: how each host in `cluster.hosts` is reached, and what runs there."""

    user: str | None = Field(None, pattern=_LOGIN, description="login user; None: ssh's default")
    port: int = Field(22, ge=1, le=65535)
    identity_file: str | None = Field(None, min_length=1, description="private key (with IdentitiesOnly=yes)")
    ssh_options: tuple[str, ...] = Field((), description="extra `-o Key=Value` options")
    python: str = Field(default_factory=lambda: sys.executable, min_length=1, description="interpreter on every node")
    workdir: AbsolutePath = Field(str(REPO_ROOT), description="the repository on every node (shared filesystem)")
    connect_timeout_s: int = Field(10, ge=1, le=MAX_WAIT_S, description="ssh ConnectTimeout (whole seconds)")
    grace_s: float = Field(15.0, gt=0, le=MAX_WAIT_S, description="SIGTERM-to-SIGKILL grace when a node is stopped")

    @field_validator("ssh_options")
    @classmethod
    def _key_value(cls, options: tuple[str, ...]) -> tuple[str, ...]:
        bad = [o for o in options if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*[= ]\S.*", o)]
        if bad:
            raise ValueError(f"each option must be Key=Value (as for ssh -o), got {bad}")
        return options


class SlurmConfig(_Strict):
    """`slurm` engine: the allocation `sbatch` asks for."""

    nodes: int = Field(1, ge=1, le=MAX_RANKS)
    time_limit: str = Field("24:00:00", description="sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S")
    gpus_per_node: int | None = Field(None, ge=1, le=MAX_RANKS,
                                      description="sbatch --gpus-per-node; None: not requested")
    sbatch_args: tuple[str, ...] = Field((), description="extra #SBATCH lines, e.g. --account=ml")
    python: str = Field(default_factory=lambda: sys.executable, min_length=1, description="interpreter on every node")
    workdir: AbsolutePath = Field(str(REPO_ROOT), description="the repository on every node (shared filesystem)")
    cancel_timeout_s: float = Field(180.0, gt=0, le=MAX_WAIT_S,
                                    description="how long scancel may take to end every step")
    qos: str | None = Field(None, pattern=r"^[-_.a-zA-Z0-9]+$", description="sbatch --qos (how most sites rank "
                            "jobs: e.g. a high-priority QoS for production retrains)")
    job_priority: bool = Field(False, description="also pass schedule.priority as sbatch --priority (needs Slurm "
                               "operator rights, which most users lack: QoS is the usual way)")

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if value.upper() not in ("UNLIMITED", "INFINITE") and not _SLURM_TIME.fullmatch(value):
            raise ValueError(f"not a Slurm time ({value!r}): use M, M:S, H:M:S, D-H, D-H:M or D-H:M:S, "
                             "e.g. 90, 02:00:00, 1-12")
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _options(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        bad = [a for a in args if not a.startswith("-") or "\n" in a]
        if bad:
            raise ValueError(f"each entry is one sbatch option starting with '-', on one line, got {bad}")
        return args


class SecretRef(_Strict):
    """One key of a Kubernetes Secret, read into an environment variable by the kubelet."""

    secret: str = Field(pattern=_K8S_NAME, max_length=253)
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)


class KubernetesConfig(_Strict):
    """`kubernetes` engine: the PyTorchJob's pods."""

    nodes: int = Field(1, ge=1, le=MAX_RANKS, description="pods: one Master plus nodes - 1 Workers")
    gpus_per_node: int | None = Field(None, ge=0, le=MAX_RANKS,
                                      description="nvidia.com/gpu per pod; None: one per rank, 0: none")
    cpu: Quantity | None = Field(None, description='cpu limit (and request) per pod, e.g. "8"')
    memory: Quantity | None = Field(None, description='memory limit (and request) per pod, e.g. "64Gi"')
    output_claim: str = Field("retrainer-output", pattern=_K8S_NAME, max_length=253,
                              description="PVC mounted at train.output_dir")
    cache_volume: Literal["host_path", "claim", "ephemeral"] = Field(
        "host_path", description="what backs data.cache_dir in each pod: the node's directory (cache_host_path), "
                                 "a PersistentVolumeClaim (cache_claim, e.g. a local PV) or an emptyDir")
    cache_host_path: AbsolutePath | None = Field(None, description="node directory for data.cache_dir; "
                                                 "None: the same path")
    cache_claim: str | None = Field(None, pattern=_K8S_NAME, max_length=253,
                                    description="PVC for data.cache_dir when cache_volume is 'claim'")
    python: str = Field("python", min_length=1, description="interpreter in the image")
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(
        default_factory=dict, description="plain (non-secret) environment of the pods")
    env_from_secrets: dict[Annotated[str, Field(pattern=_ENV_NAME)], SecretRef] = Field(
        default_factory=dict, description="ENV_NAME: {secret, key}, rendered as valueFrom.secretKeyRef")
    service_account: str | None = Field(None, pattern=_K8S_NAME, max_length=253)
    kube_context: str | None = Field(None, min_length=1, description="kubeconfig context; in-cluster config first")
    cancel_timeout_s: float = Field(300.0, gt=0, le=MAX_WAIT_S,
                                    description="how long the pods may take to go after delete")
    priority_class_name: str | None = Field(None, pattern=_K8S_NAME, max_length=253,
                                            description="pods' priorityClassName (preemption order on the cluster)")
    kueue_queue: str | None = Field(None, pattern=_K8S_NAME, max_length=253,
                                    description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name): the job waits "
                                    "in Kueue's queue, admitted by quota and priority")

    @model_validator(mode="after")
    def _env_once(self) -> KubernetesConfig:
        if self.cache_volume == "claim" and not self.cache_claim:
            raise ValueError("cluster.kubernetes.cache_volume 'claim' needs cluster.kubernetes.cache_claim")
        both = sorted(set(self.env) & set(self.env_from_secrets))
        if both:
            raise ValueError(f"cluster.kubernetes.env and env_from_secrets both set {both}; keep each in one place")
        return self


class ClusterConfig(_Strict):
    """Where the ranks run (`launcher` and its section) and the hardware the planner budgets for.

    Only the section of the chosen launcher is used; a config may carry others. On CPU under
    `local` a "GPU" is one rank process: `gpus_per_node` caps the ranks this machine runs and
    `gpu_memory_gib` is each rank's memory budget.
    """

    launcher: Literal["local", "ssh", "slurm", "kubernetes"] = "local"
    nproc_per_node: int | None = Field(None, ge=1, le=MAX_RANKS, description="ranks per node; unset: tp x pp x dp / "
                                       "nodes, which the planner requires to be gpus_per_node (whole nodes)")
    hosts: list[Annotated[str, Field(pattern=_HOST)]] = Field(default_factory=list,
                                                              description="ssh: one host per node")
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, gt=0, lt=65536, description="rank rendezvous port (default: from the job's "
                             "name, see default_master_port)")
    partition: str | None = None
    namespace: str = "default"
    image: str | None = None
    hang_timeout_s: float = Field(600.0, gt=0, le=MAX_WAIT_S)
    deferrable: bool | None = Field(None, description="the Airflow task submits the job and defers while it runs "
                                    "(no worker held); None: yes for slurm and kubernetes, whose jobs outlive "
                                    "the task, no for local and ssh, whose ranks die with it")
    startup_timeout_s: float | None = Field(None, gt=0, le=MAX_WAIT_S, description="allowance before the first "
                                            "step of a launch (imports, rendezvous, op builds); None: hang_timeout_s")
    ssh: SshConfig = SshConfig()
    slurm: SlurmConfig = SlurmConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    # Hardware, for the planner.
    gpu_memory_gib: float = Field(80.0, gt=0, description="GiB per GPU")
    gpus_per_node: int = Field(8, ge=1, le=MAX_RANKS, description="GPUs in one node: the planner's node size (the "
                               "engine sections' gpus_per_node is what a job asks for)")
    intra_node_gbytes_per_s: float = Field(450.0, gt=0, description="GB/s per GPU inside a node (NVLink)")
    inter_node_gbytes_per_s: float | None = Field(None, gt=0, description="GB/s per node between nodes; "
                                                  "default 50 (or give inter_node_gbits_per_s)")
    inter_node_gbits_per_s: float | None = Field(None, gt=0, description="Gbit/s per node, as NICs are sold")
    peak_tflops: float = Field(989.0, gt=0, description="dense bf16 peak per GPU")
    assumed_mfu: float = Field(0.4, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        old = [name for name in _RENAMED if isinstance(data, dict) and name in data]
        if old:
            raise ValueError("; ".join(f"cluster.{name} was renamed to cluster.{_RENAMED[name]}" for name in old))
        return data

    @model_validator(mode="after")
    def _deferrable_engine(self) -> ClusterConfig:
        if self.deferrable and self.launcher in ("local", "ssh"):
            raise ValueError(f"cluster.deferrable: the {self.launcher} launcher's ranks die with the process that "
                             "started them (by design: a killed task takes its ranks along), so its task cannot "
                             "defer; use slurm or kubernetes, or deferrable: false")
        return self

    @property
    def defers(self) -> bool:
        """Whether the Airflow task defers while the job runs (see `deferrable`)."""
        return self.launcher in ("slurm", "kubernetes") if self.deferrable is None else self.deferrable

    @model_validator(mode="after")
    def _one_inter_node_unit(self) -> ClusterConfig:
        if self.inter_node_gbytes_per_s is not None and self.inter_node_gbits_per_s is not None:
            raise ValueError("set one of cluster.inter_node_gbytes_per_s (GB/s) and cluster.inter_node_gbits_per_s "
                             "(Gbit/s), not both")
        return self

    @property
    def inter_node_bytes_per_s(self) -> float:
        """Bytes/s per node between nodes, from whichever unit the config gave (default 50 GB/s)."""
        if self.inter_node_gbits_per_s is not None:
            return self.inter_node_gbits_per_s * 1e9 / 8
        return (50.0 if self.inter_node_gbytes_per_s is None else self.inter_node_gbytes_per_s) * 1e9


class ServingConfig(_Strict):
    """What the published model is sized for when served (the serving memory estimate)."""

    concurrency: int = Field(1, ge=1, le=MAX_BATCH, description="concurrent sequences")
    context_len: int | None = Field(None, ge=1, le=MAX_POSITIONS,
                                    description="tokens per sequence; None: model.seq_len")
    dtype: Literal["bf16", "fp16", "fp32", "int8"] = "bf16"


_SUITE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"  # no dots: a metric's name is <suite>.<metric>
_ENTRY_POINT = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
BUILTIN_METRICS = ("loss", "perplexity")  # what every suite reports (tasks/evaluate/worker.py)


class EvalSuite(_Strict):
    """A named, manifest-verified held-out set every evaluation scores (the candidate and the live model)."""

    name: str = Field(min_length=1, max_length=100, pattern=_SUITE_NAME)
    source_url: str | None = Field(None, min_length=1, description="dataset prefix; None: the run's training data")
    manifest: str = "manifest.json"
    split: str = Field("heldout", min_length=1, pattern=_SUITE_NAME, description="key prefix of the windows")


class UserMetric(_Strict):
    """A user's metric: `module:function(model, tokenizer, dataset_dir) -> {name: float}` on one suite's data."""

    entry_point: str = Field(pattern=_ENTRY_POINT)
    suite: str = Field(description="the suite whose dataset directory the function receives")
    names: tuple[str, ...] = Field(min_length=1, description="the names it returns (recorded as <suite>.<name>)")


class GateRule(_Strict):
    """One condition a candidate must meet to be published."""

    metric: str = Field(description="<suite>.loss, <suite>.perplexity or <suite>.<user metric name>")
    direction: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher is better")
    against: Literal["live", "absolute"] = "live"
    tolerance: float = Field(0.0, ge=0, description="how much worse than live is allowed")
    tolerance_kind: Literal["relative", "absolute"] = "relative"
    threshold: float | None = Field(None, description="the bound when against is absolute")

    @model_validator(mode="after")
    def _bound(self) -> GateRule:
        if self.against == "absolute" and self.threshold is None:
            raise ValueError(f"rule on {self.metric!r}: against 'absolute' needs a threshold")
        if self.against == "live" and self.threshold is not None:
            raise ValueError(f"rule on {self.metric!r}: a threshold is only for against 'absolute'")
        return self


class GateConfig(_Strict):
    metric: Literal["loss"] = Field("loss", description="(without rules) the first suite's loss")
    tolerance: float = Field(0.0, ge=0, description="(without rules) publish if new <= live * (1 + tolerance)")
    rules: tuple[GateRule, ...] = Field((), description="every rule must pass; empty: the first suite's loss "
                                                        "against live with `tolerance`")


class EvalParallel(_Strict):
    """The evaluation ranks' own layout (default: the training layout)."""

    tp: int = Field(1, ge=1, le=MAX_RANKS)
    pp: int = Field(1, ge=1, le=MAX_RANKS)
    dp: int = Field(1, ge=1, le=MAX_RANKS)

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp)


ExportDtype = Literal["bf16", "fp32"]


class EvaluateConfig(_Strict):
    batches: int = Field(8, gt=0, le=MAX_EVAL_BATCHES)
    # bf16: the dtype the model is published in and vLLM serves, half the memory of fp32, and the matmul units'
    # own dtype (GPU tensor cores; CPUs with AMX or AVX512-BF16: a 300M forward 3.6x faster than fp32 on one
    # Xeon core). The loss is still taken in fp32. fp32 gives every layout the same numbers to float32 rounding.
    dtype: ExportDtype = Field("bf16", description="dtype the evaluation ranks hold the weights and compute in")
    batch_size: int = Field(8, gt=0, le=MAX_EVAL_BATCH_SIZE)
    parallel: EvalParallel | None = None
    suites: tuple[EvalSuite, ...] = Field((EvalSuite(name="heldout"),), min_length=1)
    metrics: tuple[UserMetric, ...] = ()
    gate: GateConfig = GateConfig()

    @model_validator(mode="after")
    def _names(self) -> EvaluateConfig:
        names = [s.name for s in self.suites]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluate.suites: suite names must be unique, got {names}")
        for i, metric in enumerate(self.metrics):
            if metric.suite not in names:
                raise ValueError(f"evaluate.metrics[{i}].suite: unknown suite {metric.suite!r} (suites: {names})")
        known = self.metric_names()
        for i, rule in enumerate(self.rules()):
            if rule.metric not in known:
                raise ValueError(f"evaluate.gate.rules[{i}].metric: unknown metric {rule.metric!r} "
                                 f"(known: {', '.join(known)})")
        return self

    def metric_names(self) -> list[str]:
        """Every metric an evaluation reports, as the gate rules name them."""
        out = [f"{s.name}.{m}" for s in self.suites for m in BUILTIN_METRICS]
        out += [f"{m.suite}.{n}" for m in self.metrics for n in m.names]
        if len(set(out)) != len(out):
            raise ValueError(f"evaluate.metrics: two metrics report the same name ({out})")
        return out

    def rules(self) -> tuple[GateRule, ...]:
        """The gate's rules: as configured, or the first suite's loss against live within `gate.tolerance`."""
        if self.gate.rules:
            return self.gate.rules
        return (GateRule(metric=f"{self.suites[0].name}.loss", tolerance=self.gate.tolerance),)


ApprovalMode = Literal["none", "required"]
ANY_ALIAS = "*"  # publish.policy's entry for every alias not listed


class PublishConfig(_Strict):
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


class RetentionConfig(_Strict):
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


class SmokeTestConfig(_Strict):
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


class DeployConfig(_Strict):
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
    entry_point: str | None = Field(None, pattern=_ENTRY_POINT, description="module:function(DeployTarget) "
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


class RankCluster(_Strict):
    """What a rank needs of `cluster`: the collective timeout and the peak for its MFU figure."""

    hang_timeout_s: float = Field(gt=0)
    peak_tflops: float = Field(gt=0)


class TrainingJob(_Strict):
    """What the training ranks receive: the job without data source, registry, store or engine options.

    Nothing here is a credential, so the file a launcher writes into the (often shared) run directory
    and every rank's environment stay free of secrets."""

    name: str
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    cluster: RankCluster


class ScheduleConfig(_Strict):
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


class JobConfig(_Strict):
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
        if self.data.asset == f"dataset://{self.name}":
            raise ValueError(f"data.asset: {self.data.asset!r} is the Asset the warm task itself emits; "
                             "a retrain scheduled on it would trigger itself")
        if self.deploy.enabled and m.family == "gpt":
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
                           cluster=RankCluster(hang_timeout_s=c.hang_timeout_s, peak_tflops=c.peak_tflops))

    def with_overrides(self, overrides: dict[str, Any]) -> JobConfig:
        """Apply dotted overrides (`{"train.steps": 5}`) and validate the result again."""
        return validated(JobConfig, apply_overrides(JobConfig, self.model_dump(mode="json"), overrides),
                         source="overrides")

    def with_output_dir(self, output_dir: str | os.PathLike[str]) -> JobConfig:
        """This config writing under `output_dir` (a rank job's own directory, derived from a validated config):
        a copy, not a revalidation; no other field depends on where the output goes."""
        return self.model_copy(update={"train": self.train.model_copy(update={"output_dir": str(output_dir)})})


MASTER_PORTS = range(20000, 30000)  # under Linux's ephemeral ports (32768+), which the OS hands out


def default_master_port(name: str) -> int:
    """The rank rendezvous port of a model that names none: sha256 of its name into MASTER_PORTS, the same on
    every machine and run; two names share one with odds 1 in 10000."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return MASTER_PORTS[digest % len(MASTER_PORTS)]


def named_defaults(name: str) -> dict[tuple[str, str], Any]:
    """(section, field) -> the default the model called `name` gets where its config leaves the field out."""
    return {("publish", "model_name"): name,
            ("data", "asset"): f"retrainer-data://{name}",
            ("train", "output_dir"): str(retrainer_home() / "runs" / name),
            ("cluster", "master_port"): default_master_port(name)}
