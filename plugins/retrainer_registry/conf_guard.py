"""API-server middleware: a trigger of a retrainer DAG whose conf names a key that is not one of the DAG's
params is refused with HTTP 400 naming the key, before any run exists.

Airflow validates each param's value but takes any other conf key and ignores it (`{"stpes": 10}` runs
with the default steps), and offers no DAG-level hook to refuse them. This wraps the API server (a
plugin's root middleware) and looks only at `POST /api/v2/dags/{dag_id}/dagRuns` (the UI's trigger
form, the REST API, the registry page's rollback button) of DAGs tagged `retrainer`; the DAG's params
are read from its serialized form, as the trigger endpoint reads them. A caller Airflow would not let
trigger the DAG gets Airflow's own answer (401/403/404): the request passes through untouched. Runs
started any other way (CLI, `dag.test()`, another DAG) are checked by the DAG's first task.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import HTTPException
from retrainer_airflow.contract import refuse_unknown_params
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tasks.base.errors import InvalidInputError

log = logging.getLogger(__name__)

TRIGGER_PATH = re.compile(r"/api/v2/dags/(?P<dag_id>[^/]+)/dagRuns/?$")
GUARDED_TAG = "retrainer"


class RefuseUnknownConf:
    """Pure ASGI middleware: buffers a matching trigger's body, answers 400 or replays it to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = TRIGGER_PATH.search(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:  # the whole body (a trigger's is small), kept to hand on unchanged
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        refusal = await _refusal(scope, match["dag_id"], body)
        if refusal is not None:
            log.info("retrainer: trigger of %s refused: %s", match["dag_id"], refusal)
            await JSONResponse({"detail": refusal}, status_code=400)(scope, replay, send)
            return
        await self.app(scope, replay, send)


async def _refusal(scope: Scope, dag_id: str, body: bytes) -> str | None:
    """Why this trigger must be refused, or None to let Airflow handle it (also for bodies it will reject)."""
    try:
        conf = json.loads(body or b"{}").get("conf")
    except (ValueError, AttributeError):
        return None
    if not isinstance(conf, dict) or not conf:
        return None
    if not await _may_trigger(scope, dag_id):
        return None
    params = await run_in_threadpool(_guarded_params, dag_id)
    if params is None:
        return None
    try:
        refuse_unknown_params(conf, params)
    except InvalidInputError as exc:
        return f"Invalid conf for {dag_id}: {exc}"
    return None


async def _may_trigger(scope: Scope, dag_id: str) -> bool:
    """Whether Airflow's own authentication and DAG-run authorization let this caller trigger the DAG."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user, requires_access_dag

    request = Request({**scope, "path_params": {"dag_id": dag_id}})
    try:
        user = await get_user(request, None, await bearer_scheme(request))
        await run_in_threadpool(requires_access_dag(method="POST", access_entity=DagAccessEntity.RUN),
                                request, user)
    except HTTPException:
        return False
    return True


def _guarded_params(dag_id: str) -> list[str] | None:
    """The param names of the DAG's latest serialized version, if it is one of ours (tagged `retrainer`)."""
    from airflow.models.serialized_dag import SerializedDagModel

    dag: Any = SerializedDagModel.get_dag(dag_id)
    if dag is None or GUARDED_TAG not in (dag.tags or ()):
        return None
    return list(dag.params)
