"""Example deploy hook for LoRA versions: load the pulled adapter into a running vLLM, unload the previous one.

`deploy.entry_point: tasks.deploy.vllm_lora:load_adapter`, with the server started as
`vllm serve <base> --enable-lora --max-lora-rank <r>` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.
`RETRAINER_VLLM_URL` (default http://127.0.0.1:8000) is the server; a bearer token, if the server needs one,
comes from `RETRAINER_VLLM_API_KEY` (the environment, never a file or argv).

Why a name per version (`<model>-v<N>`): reloading new weights under a name vLLM already serves can keep
serving the old ones (vllm-project/vllm#42125), so each version is loaded under its own name, clients
switch to it, and only then is the previous version's adapter unloaded (a rollback does the same, back).
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path

from tasks.base.errors import RetrainerError
from tasks.deploy.target import DeployTarget
from tasks.models.lora_export import ADAPTER_CONFIG

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 60.0


def adapter_name(model: str, version: int) -> str:
    """The name a version's adapter is served under (what clients put in `model`)."""
    return f"{model}-v{version}"


def adapter_dir(model_dir: str | Path) -> Path:
    """The PEFT directory of a pulled LoRA version: the tree itself, or `adapter/` of a merged+adapter tree."""
    root = Path(model_dir)
    for candidate in (root, root / "adapter"):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise RetrainerError(f"{root}: not a LoRA version (no {ADAPTER_CONFIG}); publish it with train.lora")


def load_adapter(target: DeployTarget) -> None:
    """POST /v1/load_lora_adapter for this version, then /v1/unload_lora_adapter for the one live before it."""
    url = os.environ.get("RETRAINER_VLLM_URL", DEFAULT_URL).rstrip("/")
    name = adapter_name(target.model, target.version)
    _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir(target.model_dir))})
    log.info("vLLM %s: loaded %s", url, name)
    if target.moved_from is not None and target.moved_from != target.version:
        previous = adapter_name(target.model, target.moved_from)
        try:
            _post(url, "/v1/unload_lora_adapter", {"lora_name": previous})
            log.info("vLLM %s: unloaded %s", url, previous)
        except RetrainerError as exc:  # not loaded (a server restarted since): nothing to unload
            log.warning("vLLM %s: %s was not unloaded: %s", url, previous, exc)


def _post(url: str, path: str, body: dict[str, str]) -> None:
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get("RETRAINER_VLLM_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        raise RetrainerError(f"vLLM {url}{path} {body['lora_name']}: HTTP {exc.code}: "
                             f"{exc.read().decode(errors='replace')[:500]}") from None
    except OSError as exc:
        raise RetrainerError(f"vLLM {url}{path}: {exc}") from None
