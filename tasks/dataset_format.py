"""The dataset format's names and key rules, without pydantic.

Kept apart from `tasks.data` (the pydantic manifest model) so that a no-op re-warm
can recognise a dataset it already holds in milliseconds, without importing pydantic.
"""

from __future__ import annotations

import hashlib

FORMAT = "retrainer-dataset/1"
MANIFEST_KEY = "manifest.json"


def validate_key(key: str) -> str:
    """Refuse object keys that could escape a cache root or collide: `..`, absolute, NUL, empty segments."""
    if not key:
        raise ValueError("key is empty")
    if "\x00" in key:
        raise ValueError(f"key {key!r} contains NUL")
    if key.startswith("/") or "\\" in key or (len(key) > 1 and key[1] == ":"):
        raise ValueError(f"key {key!r} is absolute or uses backslashes")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"key {key!r} has an empty, '.' or '..' segment")
    if key == MANIFEST_KEY:
        raise ValueError(f"key {key!r} is reserved for the manifest itself")
    return key


def manifest_hash(raw: bytes) -> str:
    """The dataset's identity: sha256 of the manifest file's bytes as stored."""
    return hashlib.sha256(raw).hexdigest()
