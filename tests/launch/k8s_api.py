"""A stand-in for the few Kubernetes API calls the kubernetes launcher makes, served over HTTP to the official
client (a kubeconfig points it here): PyTorchJobs created, read and deleted, the pods of a job listed, a
pod's log followed. No operator runs: a test sets each pod's log, and a job reads `Failed` once every one
of its pods' logs has been served whole (a job fails after its pods wrote their last lines)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_JOB = re.compile(r"/apis/kubeflow\.org/v1/namespaces/([^/]+)/pytorchjobs(?:/([^/?]+))?")
_POD_LOG = re.compile(r"/api/v1/namespaces/[^/]+/pods/([^/?]+)/log")
_PODS = re.compile(r"/api/v1/namespaces/[^/]+/pods\b")


@dataclass
class KubernetesApi:
    """What the stand-in holds: jobs by name, each pod's log (set by the test), the pods served whole."""

    url: str = ""
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    logs: dict[str, bytes] = field(default_factory=dict)
    served: set[str] = field(default_factory=set)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "tester"}}]}))
        return path

    def job_status(self, name: str) -> dict[str, Any]:
        pods = {pod for pod in self.logs if pod.startswith(f"{name}-")}
        if pods and pods <= self.served:
            return {"conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                                    "message": f"PyTorchJob {name} is failed because 1 Worker replica(s) failed."}]}
        return {"conditions": [{"type": "Running", "status": "True"}]}


def _handler(api: KubernetesApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # the test output stays quiet
            pass

        def _json(self, code: int, obj: dict[str, Any]) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict[str, Any]:
            size = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(size)) if size else {}

        def do_POST(self) -> None:
            body = self._body()
            api.jobs[body["metadata"]["name"]] = body
            self._json(201, body)

        def do_DELETE(self) -> None:
            self._body()
            match = _JOB.match(self.path)
            if match is None or api.jobs.pop(match.group(2), None) is None:
                self._json(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                return
            self._json(200, {"kind": "Status", "status": "Success"})

        def do_GET(self) -> None:
            if (log := _POD_LOG.match(self.path)) is not None:
                self._log(log.group(1))
            elif (job := _JOB.match(self.path)) is not None and job.group(2) in api.jobs:
                self._json(200, {**api.jobs[job.group(2)], "status": api.job_status(job.group(2))})
            elif _PODS.match(self.path) is not None:
                self._json(200, {"kind": "PodList", "apiVersion": "v1", "items": []})
            else:
                self._json(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})

        def _log(self, pod: str) -> None:
            """The pod's log in small chunks, so that lines (a failure report too) fall across them."""
            if pod not in api.logs:
                self._json(400, {"kind": "Status", "message": f"container pytorch in pod {pod} is waiting to start"})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = api.logs[pod]
            for i in range(0, len(data), 700):
                chunk = data[i:i + 700]
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            api.served.add(pod)

    return Handler


@contextmanager
def kubernetes_api() -> Iterator[KubernetesApi]:
    """The stand-in, listening on a free local port until the block ends."""
    api = KubernetesApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
