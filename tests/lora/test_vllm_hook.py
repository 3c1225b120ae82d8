"""The vLLM deploy hook against a server speaking vLLM's runtime LoRA endpoints (a real HTTP server here)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.base.errors import RetrainerError
from tasks.deploy.target import DeployTarget
from tasks.deploy.vllm_lora import load_adapter
from tasks.models.lora_export import ADAPTER_CONFIG


@pytest.fixture
def vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """A server that keeps vLLM's set of loaded adapters: load refuses a name already loaded (400), unload an
    unknown one (404)."""
    state: dict = {"loaded": set(), "calls": [], "auth": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["calls"].append((self.path, body))
            state["auth"].append(self.headers.get("Authorization"))
            name = body["lora_name"]
            ok = {"/v1/load_lora_adapter": name not in state["loaded"],
                  "/v1/unload_lora_adapter": name in state["loaded"]}.get(self.path, False)
            if ok:
                (state["loaded"].add if "unload" not in self.path else state["loaded"].discard)(name)
            self.send_response(200 if ok else (400 if "load_lora" in self.path else 404))
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"refused")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("RETRAINER_VLLM_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("RETRAINER_VLLM_API_KEY", "s3cret")
    yield state
    server.shutdown()


def _version(tmp: Path, n: int, *, nested: bool) -> str:
    root = tmp / f"v{n}"
    adapter = root / "adapter" if nested else root
    adapter.mkdir(parents=True)
    (adapter / ADAPTER_CONFIG).write_text("{}")
    return str(root)


def _target(model_dir: str, version: int, moved_from: int | None, moved_by: str = "publish") -> DeployTarget:
    return DeployTarget(model="tiny-lora", alias="production", version=version, digest="0" * 64, model_dir=model_dir,
                        moved_by=moved_by, moved_from=moved_from, event_version=version)


def test_each_version_is_loaded_under_its_own_name_and_the_previous_unloaded(vllm: dict, tmp_path: Path) -> None:
    load_adapter(_target(_version(tmp_path, 1, nested=False), 1, None))
    load_adapter(_target(_version(tmp_path, 2, nested=True), 2, 1))  # lora_export both: the adapter/ inside
    assert vllm["loaded"] == {"tiny-lora-v2"}
    load_adapter(_target(str(tmp_path / "v1"), 1, 2, moved_by="rollback"))
    assert vllm["loaded"] == {"tiny-lora-v1"}
    assert vllm["calls"][1] == ("/v1/load_lora_adapter", {"lora_name": "tiny-lora-v2",
                                                          "lora_path": str(tmp_path / "v2" / "adapter")})
    assert set(vllm["auth"]) == {"Bearer s3cret"}


def test_a_refused_load_fails_the_deploy_naming_the_adapter(vllm: dict, tmp_path: Path) -> None:
    target = _target(_version(tmp_path, 1, nested=False), 1, None)
    load_adapter(target)
    with pytest.raises(RetrainerError, match="load_lora_adapter tiny-lora-v1: HTTP 400"):
        load_adapter(target)
    with pytest.raises(RetrainerError, match="not a LoRA version"):
        load_adapter(_target(str(tmp_path), 3, 1))
