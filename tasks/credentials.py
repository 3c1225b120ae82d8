"""Storage credentials: find them in fsspec storage options, and move them into environment variables.

Why: a training rank's input file lives in the (often shared) run directory and a Kubernetes manifest
in the API server, so neither may hold a credential; s3fs (and obstore) read the standard AWS variables
when the options do not name a key, so the ranks get those through their environment instead.
"""

from __future__ import annotations

import re
from typing import Any

from tasks.errors import InvalidInputError

_CREDENTIAL = re.compile(r"(key|secret|token|password|credential)", re.IGNORECASE)
# s3fs's own option names and the environment variables botocore reads in their place.
S3_ENV = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}


def credential_keys(options: Any, prefix: str = "") -> list[str]:
    """Dotted names of the options that look like credentials (a key, secret, token, password)."""
    if not isinstance(options, dict):
        return []
    found = []
    for key, value in options.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += credential_keys(value, name + ".")
        elif _CREDENTIAL.search(str(key)) and value not in (None, "", False):
            found.append(name)
    return found


def split_credentials(options: dict[str, Any], field: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(options without credentials, the environment that carries them); a credential s3fs cannot take from
    the environment is refused, naming `field` and the option."""
    public = {k: v for k, v in options.items() if k not in S3_ENV}
    env = {S3_ENV[k]: str(v) for k, v in options.items() if k in S3_ENV and v}
    left = credential_keys(public)
    if left:
        raise InvalidInputError(f"{field}: {', '.join(left)} cannot be passed to the ranks safely; use key/secret/"
                                "token (sent as AWS_* environment variables) or the nodes' own credentials")
    return public, env
