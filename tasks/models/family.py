"""The model-family protocol: what every family states once, and what it inherits.

Why a class and not a bare module: the planner, the trainer, evaluate, import and
export all ask a family the same questions (layers, shard rules, exact counts and
FLOPs, KV bytes, Hugging Face names and config.json); an abstract base says which
answers a new family must give and keeps the ones that are the same maths for
every decoder (totals, FLOPs, KV bytes) in one place.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from tasks.base.layout import ONE_RANK, Coord, Layout
from tasks.families.spec import FamilySpec
from tasks.models.shapes import ParamCounts

if TYPE_CHECKING:
    import torch

    from tasks.config.model import ModelConfig
    from tasks.models.parallel import TPGroup

# Reference-model prefixes of the first and last pipeline layers (tasks/models/weights.py reads by them).
EMBED, HEAD = "embed", "head"
# The flat rotary keys of `hf_config` that transformers 5's `rope_parameters` replaces.
FLAT_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_local_base_freq")
# The protocol's layer classes and functions a family's parts (its model.py, sharding.py, hf.py) may define.
PARTS = ("Embedding", "TransformerBlock", "Head", "Reference", "pipeline_layers", "make_loss_fn", "make_token_nll_fn",
         "full_shapes", "shard_spec", "unshard", "param_counts", "hf_name", "ref_name", "hf_config",
         "model_fields_from_hf", "hf_rope_parameters", "unrouted_params", "expert_piece", "hf_tensors")


class ModelFamily(ABC):
    """One decoder family. Layers take (m, seed, tp) (blocks: (m, index, seed, tp)); `seed` None = no draw; `tp`
    carries the layout and this rank's coordinates with its TP process group.

    Reference names (the Reference's state-dict names) are the contract between the
    layers, the shard rules, checkpoints and the Hugging Face mapping.

    A family class names its torch-free spec and its parts: `class Qwen3(Llama, spec=QWEN3, parts=(hf,))`; each
    class or function of PARTS a part defines is the family's (what the class body states itself, or a part
    only imports, is not taken), the rest is inherited.
    """

    spec: ClassVar[FamilySpec]  # the family's facts (tasks/families)
    name: ClassVar[str]  # `model.family` (spec.name)
    architectures: ClassVar[tuple[str, ...]]  # config.json `architectures` this family reads (spec.architectures)
    vocab_parallel: ClassVar[bool]  # embedding, LM head and cross entropy split by vocab rows across TP
    Embedding: ClassVar[type]
    TransformerBlock: ClassVar[type]
    Head: ClassVar[type]
    Reference: ClassVar[type]  # the whole model in one module (tasks.models.common.reference.Reference)

    def __init_subclass__(cls, spec: FamilySpec | None = None, parts: tuple[ModuleType, ...] = (),
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if spec is not None:
            cls.spec, cls.name, cls.architectures = spec, spec.name, spec.architectures
        for part in parts:
            for attr in PARTS:
                value = vars(part).get(attr)
                if value is None or attr in vars(cls) or getattr(value, "__module__", None) != part.__name__:
                    continue
                setattr(cls, attr, value if isinstance(value, type) else staticmethod(value))

    # ---- layers ----
    @abstractmethod
    def pipeline_layers(self, m: ModelConfig, seed: int | None, tp: TPGroup) -> list[object]:
        """DeepSpeed LayerSpecs [embedding, n_layers blocks, head (, tied logits)]."""

    @abstractmethod
    def make_loss_fn(self, tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """loss_fn(logits as the last stage emits them, labels): mean next-token cross entropy."""

    @abstractmethod
    def make_token_nll_fn(self, tp: TPGroup) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """token_nll(logits, labels): per-token cross entropy in fp32 (evaluation)."""

    # ---- shapes and shard rules ----
    @abstractmethod
    def full_shapes(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Reference name -> full (unsharded) shape of every parameter, without building the model."""

    @abstractmethod
    def shard_spec(self, m: ModelConfig, name: str, layout: Layout, coord: Coord) -> tuple[int, torch.Tensor] | None:
        """(dim, indices) of the full tensor `name` the rank at `coord` of `layout` holds; None = replicated."""

    @abstractmethod
    def unshard(self, m: ModelConfig, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from its TP pieces (ordered by TP rank)."""

    # ---- counts for the planner and telemetry ----
    @abstractmethod
    def param_counts(self, m: ModelConfig, layout: Layout = ONE_RANK) -> ParamCounts:
        """Parameters one rank of `layout` holds per layer kind (of a stage holding it), as DeepSpeed places them."""

    def total_params(self, m: ModelConfig) -> int:
        """Unique parameters of the whole model (a tied matrix once)."""
        return sum(math.prod(s) for s in self.full_shapes(m).values())

    def unrouted_params(self, m: ModelConfig) -> int:
        """Parameters a token does not reach: the experts it is not routed to, in every MoE layer (dense: 0)."""
        return 0

    def active_params(self, m: ModelConfig) -> int:
        """Parameters one token reaches: the whole model less the experts it is not routed to."""
        return self.total_params(m) - self.unrouted_params(m)

    def flops_per_token(self, m: ModelConfig) -> float:
        """Training FLOPs per token, PaLM appendix B / Megatron style: 6N + 12 * n_layers * span * n_heads * head_dim.

        N = the parameters that take part in matmuls for a token: all blocks (less a MoE layer's experts it is not
        routed to) plus the head (final
        norm + the d x vocab LM-head matrix, counted even when tied, because the
        logits matmul runs either way); the input embedding is a lookup and is left
        out. The attention term counts QK^T and AV over the full (not causal-halved)
        score row of `m.attention_span` keys (seq_len, or the sliding window where shorter),
        n_heads * head_dim wide (d_model unless head_dim says otherwise).
        """
        c = self.param_counts(m)
        matmul = c.blocks(0, m.n_layers) + c.head - self.unrouted_params(m)
        return 6.0 * matmul + 12.0 * m.n_layers * m.attention_span * m.n_heads * m.head_dim

    def kv_bytes_per_token(self, m: ModelConfig, element_bytes: int) -> int:
        """KV-cache bytes one token takes when serving: a key and a value per layer and kv head."""
        return m.n_layers * m.kv_heads * m.head_dim * 2 * element_bytes

    def kv_positions(self, m: ModelConfig, context: int) -> int:
        """Positions of one sequence the KV cache holds at `context` tokens: a sliding layer keeps the last W."""
        return min(context, m.sliding_window or context)

    def kv_cache_bytes(self, m: ModelConfig, element_bytes: int, context: int) -> int:
        """KV-cache bytes of one sequence at `context` tokens (a family mixing sliding and global layers sums them)."""
        return self.kv_bytes_per_token(m, element_bytes) * self.kv_positions(m, context)

    # ---- Hugging Face in/out ----
    @abstractmethod
    def hf_name(self, ref: str) -> str:
        """The exported tensor name of a reference name."""

    @abstractmethod
    def ref_name(self, hf: str) -> str:
        """The reference name of an exported tensor name (inverse of `hf_name`); a foreign name is refused."""

    @abstractmethod
    def hf_config(self, m: ModelConfig, *, dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        """The family's own config.json of the model (an export from scratch; `export_config` keeps a parent's)."""

    @abstractmethod
    def model_fields_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields a config.json implies; an unsupported feature fails naming its key."""

    def hf_tensors(self, ref: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The exported tensors (Hugging Face name, view) of reference tensor `ref`, as transformers'
        `save_pretrained` writes them: one, or a stacked expert tensor's per-expert parts. A meta tensor gives
        their names and shapes."""
        return [(self.hf_name(ref), tensor)]

    def expert_piece(self, hf: str) -> tuple[str, int, int] | None:
        """(reference name, expert, part) of a tensor holding one routed expert's part of a stacked reference
        tensor (the per-expert layout of a mixture of experts: `mlp.experts.3.up_proj.weight` is part 1 of expert
        3's rows of `mlp.experts.gate_up`); None: a tensor `ref_name` names whole."""
        return None

    def hf_rope_parameters(self, m: ModelConfig) -> dict[str, Any] | None:
        """The model's rotary as transformers 5's `rope_parameters` (None: the family states no rotary)."""
        return None

    def export_config(self, m: ModelConfig, parent: dict[str, Any], *, dtype: str) -> dict[str, Any]:
        """config.json of an export whose parent (the model the run started from) has `parent` as its config.json;
        `{}` (from scratch): the family's own `hf_config`.

        Why: a pulled model's config.json must diff against its input's only in what changed. So the parent's
        keys and spelling stay (transformers 5's `rope_parameters`, `pad_token_id`, keys no family reads); a key
        of the family's config is written from the model only where the parent, read as the family reads it,
        says otherwise; and `dtype` (or the parent's `torch_dtype`) is the exported weights'."""
        ours = self.hf_config(m, dtype=dtype, max_position_embeddings=parent.get("max_position_embeddings"),
                              bos_token_id=parent.get("bos_token_id"), eos_token_id=parent.get("eos_token_id"))
        if not parent:
            return ours
        rope = self.hf_rope_parameters(m)
        if "rope_parameters" in parent and rope is not None:
            ours = {k: v for k, v in ours.items() if k not in FLAT_ROPE_KEYS} | {"rope_parameters": rope}
        config, means = dict(parent), self.model_fields_from_hf(parent)
        for key, value in ours.items():
            written = {**config, key: value}
            if (meant := self.model_fields_from_hf(written)) != means:
                config, means = written, meant
        config["torch_dtype" if "torch_dtype" in parent and "dtype" not in parent else "dtype"] = dtype
        return config
