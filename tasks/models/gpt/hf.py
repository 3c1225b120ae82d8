"""GPT-family export names and config.json (no transformers class: our own config.json)."""

from __future__ import annotations

from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.config.model import ModelConfig
from tasks.families.gpt import GPT
from tasks.models.common.names import relative

[ARCHITECTURE] = GPT.architectures


def hf_name(ref: str) -> str:
    """Exported tensor names are the reference names (there is no Hugging Face GPT of this shape)."""
    return ref


def ref_name(name: str) -> str:
    """The reference name of an exported tensor (the same name); anything else is refused."""
    if relative(name) not in _GPT_NAMES:
        raise ValueError(f"{name!r} is not a GPT-family tensor name")
    return name


_GPT_NAMES = {
    "embed.tok.weight", "embed.pos.weight", "head.ln.weight", "head.ln.bias", "head.out.weight",
    "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "attn.out.bias",
    "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
}
_FIELDS = ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "dropout")


def hf_config(m: ModelConfig, *, dtype: str = "bfloat16", **_: Any) -> dict[str, Any]:
    """config.json of an exported GPT: our architecture name and the model fields (read back by
    `model_fields_from_hf`); transformers has no class for it, retrainer's evaluate reads it."""
    return {"architectures": [ARCHITECTURE], "model_type": "retrainer-gpt", "dtype": dtype,
            **{f: getattr(m, f) for f in _FIELDS}}


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("architectures") != [ARCHITECTURE]:
        raise InvalidInputError(f"config.json architectures {config.get('architectures')!r} is not "
                                f"model.family 'gpt' ({ARCHITECTURE})")
    missing = [f for f in _FIELDS if f not in config]
    if missing:
        raise InvalidInputError(f"config.json lacks {', '.join(missing)}")
    return {"family": GPT.name, **{f: config[f] for f in _FIELDS}}
