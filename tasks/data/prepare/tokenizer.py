"""A Hugging Face tokenizer (`tokenizer.json`) and its EOS id, found the way transformers finds them.

EOS: `--eos-token` if given, else `eos_token` of the tokenizer directory's
`tokenizer_config.json`, else of its `special_tokens_map.json`; none is an error,
never a guess (documents would run together).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.base.errors import InvalidInputError

TOKENIZER_FILE = "tokenizer.json"
EOS_SOURCES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class TokenizerInfo:
    path: str  # the tokenizer.json
    eos_token: str
    eos_id: int
    vocab_size: int  # highest id + 1: what the shards' dtype must hold


def load_tokenizer(spec: str, eos_token: str | None = None) -> TokenizerInfo:
    """`spec` is a model directory holding tokenizer.json, or the tokenizer.json itself (local)."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise InvalidInputError(f"--tokenizer {spec}: no {TOKENIZER_FILE} there")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for any parse error
        raise InvalidInputError(f"{path}: not a Hugging Face tokenizer: {exc}") from None
    token = eos_token or configured_token(path.parent, "eos_token")
    if token is None:
        raise InvalidInputError(f"{path}: no EOS token: pass --eos-token, or set eos_token in "
                                f"{path.parent / EOS_SOURCES[0]}")
    eos_id = tok.token_to_id(token)
    if eos_id is None:
        raise InvalidInputError(f"{path}: EOS token {token!r} is not in the tokenizer's vocabulary")
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    return TokenizerInfo(path=str(path), eos_token=token, eos_id=eos_id, vocab_size=vocab_size)


def configured_token(directory: Path, key: str) -> str | None:
    """A special token (`eos_token`, `bos_token`) as the tokenizer directory's config files name it."""
    for name in EOS_SOURCES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            value: Any = json.loads(file.read_text()).get(key)
        except (OSError, ValueError, AttributeError) as exc:
            raise InvalidInputError(f"{file}: cannot read {key}: {exc}") from None
        if isinstance(value, dict):  # an AddedToken: {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None
