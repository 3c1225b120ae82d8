"""Reference names of block parameters (`blocks.<index>.<name inside the block>`): shard rules, Hugging Face
mappings and LoRA parse them here."""

from __future__ import annotations

import re

BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def relative(name: str) -> str:
    """A block parameter's name inside its block (`blocks.3.attn.o.weight` -> `attn.o.weight`); others as they are."""
    match = BLOCK.fullmatch(name)
    return match.group(2) if match else name
