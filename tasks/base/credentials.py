"""Storage credentials: find them in fsspec storage options, and move them into environment variables.

Why: a training rank's input file lives in the (often shared) run directory and a Kubernetes manifest
in the API server, so neither may hold a credential; s3fs (and obstore) read the standard AWS variables
when the options do not name a key, so the ranks get those through their environment instead.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tasks.base.errors import InvalidInputError

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


# What a recorded credential reads as (a version's config, tasks/registry: the record keeps the field, not the value).
REDACTED = "<redacted>"
_URL_SECRET = re.compile(r"(key|secret|token|password|credential|signature|sig|auth)", re.IGNORECASE)


def _redact_url(text: str) -> str:
    """A URL with its password (user:PASSWORD@host) and credential-named query values replaced by REDACTED."""
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:
        return text
    if not parts.scheme or not parts.netloc:
        return text
    netloc = parts.netloc
    if password:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{REDACTED}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if v and _URL_SECRET.search(k) else v) for k, v in pairs], safe="<>")
    return urlunsplit(parts._replace(netloc=netloc, query=query)) if (netloc, query) != (
        parts.netloc, parts.query) else text


def _secret_env_values() -> list[str]:
    """Values of this process's credential-named environment variables (what a `${VAR}` may have expanded to)."""
    return [v for k, v in os.environ.items() if _CREDENTIAL.search(k) and len(v) >= 8]


def redact(value: Any) -> Any:
    """A JSON-shaped value (a resolved job config) fit for a record: options named like credentials hold
    REDACTED, URLs lose their password and credential query values, and no string keeps the value of a
    credential-named environment variable. Why all three: a secret reaches a config as an option
    (`storage_options.secret`), inside a URL (`postgresql://u:pw@host`), or through `${VAR}` anywhere."""
    secrets = sorted(_secret_env_values(), key=len, reverse=True)

    def walk(x: Any, key: str = "") -> Any:
        if isinstance(x, dict):
            return {k: walk(v, str(k)) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, key) for v in x]
        if not isinstance(x, str) or not x:
            return x
        if _CREDENTIAL.search(key):
            return REDACTED
        x = _redact_url(x)
        for secret in secrets:
            x = x.replace(secret, REDACTED)
        return x

    return walk(value)


def unredacted_credentials(value: Any, prefix: str = "") -> list[str]:
    """Dotted names of what `redact` would have hidden and still holds a value (empty: nothing leaks)."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict | list):
                found += unredacted_credentials(v, name + ".")
            elif isinstance(v, str) and v and v != REDACTED and (_CREDENTIAL.search(str(k)) or _redact_url(v) != v):
                found.append(name)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += unredacted_credentials(v if isinstance(v, dict | list) else {f"[{i}]": v}, prefix.rstrip("."))
    return found
