"""Validation of user-supplied names before they reach the database.

Names are always stored through bound parameters, so quotes or `;` are harmless;
we still refuse what no sane name contains (control characters, NUL, which
PostgreSQL cannot store, surrounding whitespace) and cap the length so a 10 kB
string fails with a clear message instead of a driver error.
"""

from __future__ import annotations

import re
import unicodedata

from tasks.registry.errors import InvalidNameError

MAX_NAME = 200
MAX_REASON = 2000
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _bad_char(text: str) -> str | None:
    for ch in text:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cs", "Co", "Cn") or ch in "\u2028\u2029":
            return ch
    return None


def check_name(value: object, field: str, max_len: int = MAX_NAME) -> str:
    """Return `value` if it is an acceptable name, else raise InvalidNameError naming `field`."""
    if not isinstance(value, str):
        raise InvalidNameError(f"{field}: must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidNameError(f"{field}: must not be empty")
    if len(value) > max_len:
        raise InvalidNameError(f"{field}: too long ({len(value)} characters, at most {max_len})")
    bad = _bad_char(value)
    if bad is not None:
        raise InvalidNameError(f"{field}: contains a control or unassigned character (U+{ord(bad):04X})")
    if value != value.strip():
        raise InvalidNameError(f"{field}: must not start or end with whitespace")
    return value


def check_text(value: object, field: str, max_len: int = MAX_REASON) -> str:
    """Free text (a reason): may be empty or contain newlines/tabs, but no NUL and bounded."""
    if not isinstance(value, str):
        raise InvalidNameError(f"{field}: must be a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise InvalidNameError(f"{field}: too long ({len(value)} characters, at most {max_len})")
    if "\x00" in value:
        raise InvalidNameError(f"{field}: contains a NUL character")
    return value


def check_digest(value: object, field: str = "digest") -> str:
    """A sha256 hex digest (lowercase, 64 chars): the only thing that ever forms a store path."""
    if not isinstance(value, str) or not _HEX64.match(value):
        raise InvalidNameError(f"{field}: not a sha256 hex digest: {str(value)[:80]!r}")
    return value


def check_version(value: object, field: str = "version") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidNameError(f"{field}: must be a positive integer, got {value!r}")
    return value
