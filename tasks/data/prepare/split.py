"""The held-out split is a pure function of a document's text.

sha256 of the UTF-8 bytes, first 8 bytes as an integer, below `fraction * 2**64`
-> held out. The same document lands in the same split in every run, with any
worker count, chunk size or input order, and duplicates never straddle the split.
"""

from __future__ import annotations

import hashlib


def heldout_threshold(fraction: float) -> int:
    return int(fraction * 2**64)


def is_heldout(text: str, threshold: int) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < threshold
