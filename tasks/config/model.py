"""The `model` section: the decoder's sizes and family options, refused at load when its family does not
express them (tasks/families), and where the weights come from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tasks.base.dataset_format import MAX_VOCAB
from tasks.config.bounds import MAX_POSITIONS, MAX_VERSION, MAX_WIDTH, NAME_PATTERN, Strict
from tasks.families import FAMILIES, family_spec

# rope_type -> (the RopeScaling fields it requires, those it may set) besides `factor`; no other field is its.
ROPE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama3": (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "linear": ((), ()),
    "yarn": (("original_max_position_embeddings",), ("beta_fast", "beta_slow", "attention_factor")),
}


class RopeScaling(Strict):
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


class BaseModelRef(Strict):
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
                return f"model.{field} must be true for model.family {family!r} (its blocks always have it)"
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
    spec = FAMILIES[m.family]
    unknown = [n for n in target_modules if n not in spec.lora_targets]
    if unknown:
        why = (" (the routed experts: adapters on them are not supported yet, and vLLM ignores expert adapters it "
               "does not support)") if set(unknown) & set(spec.expert_targets) else ""
        return (f"train.lora.target_modules: unknown to model.family {m.family!r}: "
                f"{', '.join(map(repr, unknown))}{why}; its modules: {', '.join(sorted(spec.lora_targets))}")
    return None


class ModelConfig(Strict):
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
    # Mixture-of-experts options (Qwen3-MoE, Mixtral): which layers route, to how many of how many experts.
    num_experts: int | None = Field(None, gt=0, le=MAX_WIDTH, description="routed experts of each MoE layer")
    num_experts_per_tok: int | None = Field(None, gt=0, le=MAX_WIDTH, description="experts each token reaches "
                                                                                  "(top-k of the router)")
    moe_intermediate_size: int | None = Field(None, gt=0, le=MAX_WIDTH, description="each expert's hidden width; "
                                                                                    "null = d_ff")
    norm_topk_prob: bool = Field(False, description="the top-k routing weights renormalised to sum to 1")
    decoder_sparse_step: int = Field(1, gt=0, le=MAX_WIDTH, description="layer i routes iff (i + 1) % step == 0 "
                                                                        "(and i is not in mlp_only_layers)")
    mlp_only_layers: tuple[int, ...] = Field((), description="layers with a dense MLP of d_ff instead of experts")
    router_aux_loss_coef: float = Field(0.0, ge=0, le=1e3, description="weight of the auxiliary load-balancing "
                                                                       "loss in training (transformers'); 0 = off")
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
            if FAMILIES[self.family].routed:
                self._check_experts()
        if FAMILIES[self.family].rotary and self.head_dim % 2:
            raise ValueError(f"model.head_dim ({self.head_dim}) must be even for rotary "
                             f"embeddings (model.family {self.family!r})")
        return self

    def _check_experts(self) -> None:
        """A mixture of experts states its experts, routes to at most all of them, and names real layers."""
        if self.num_experts is None or self.num_experts_per_tok is None:
            raise ValueError(f"model.num_experts and model.num_experts_per_tok are required for model.family "
                             f"{self.family!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds model.num_experts "
                             f"({self.num_experts})")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if outside:
            raise ValueError(f"model.mlp_only_layers {outside} lie outside the model's {self.n_layers} layers")

    def routed(self, index: int) -> bool:
        """Whether layer `index` is a mixture of experts (else a dense MLP), as transformers' Qwen3-MoE decides."""
        return (self.num_experts is not None and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_ffn(self) -> int:
        """Each expert's hidden width."""
        return self.moe_intermediate_size or self.ffn

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
