"""The registry page: FastAPI routes over `tasks.registry`, behind Airflow's own authentication.

Every route depends on Airflow's `get_user` (JWT from the Authorization header or the
UI's session cookie), so an anonymous request gets 401/403. The rollback button does
not touch the registry itself: it triggers the `rollback_model` DAG through Airflow's
REST API with the caller's own credentials, so Airflow authorizes it, validates the
Params, and the switch is audited like any other run.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

import httpx
import sqlalchemy as sa
from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
from airflow.api_fastapi.core_api.security import get_user
from fastapi import Depends, FastAPI, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from retrainer_registry import render
from retrainer_registry.render import esc
from retrainer_registry.source import Sources, load_sources, training_losses
from tasks.registry import NotFoundError, Registry

log = logging.getLogger(__name__)

ROLLBACK_DAG = "rollback_model"

app = FastAPI(
    title="retrainer model registry",
    description="Models, aliases, versions with lineage and metrics, pointer history, rollback.",
    dependencies=[Depends(get_user)],
)


# -- reading the registry -------------------------------------------------------------------
def _registries(sources: Sources) -> list[Registry]:
    return [Registry(url) for url in sources.registry_urls]


def _all_models(sources: Sources, errors: list[str] | None = None) -> list[dict[str, Any]]:
    """Models across the configured registries; a registry that cannot be read is reported, not fatal."""
    seen: dict[str, dict[str, Any]] = {}
    for reg in _registries(sources):
        with reg:
            try:
                rows = reg.models()
            except Exception as exc:  # an unmigrated or unreachable registry must not blank the page
                where = sa.make_url(reg.db_url).render_as_string(hide_password=True)
                log.warning("registry page: cannot read registry %s: %s", where, type(exc).__name__)
                if errors is not None:
                    errors.append(f"cannot read registry {where}: {type(exc).__name__}")
                continue
            for row in rows:
                seen.setdefault(row["model"], row)
    return [seen[k] for k in sorted(seen)]


def _model_view(sources: Sources, model: str) -> dict[str, Any]:
    """show() + history() of a model, from the first registry that knows it."""
    for reg in _registries(sources):
        with reg:
            try:
                view = reg.show(model)
                view["history"] = [h.to_dict() for h in reg.history(model)]
            except NotFoundError:
                continue
            except Exception as exc:
                log.warning("registry page: cannot read a registry: %s", type(exc).__name__)
                continue
            return view
    raise HTTPException(status_code=404, detail=f"model {model!r} is not in the registry")


def _base(request: Request) -> str:
    """This app's absolute path prefix (the plugin mount, under any Airflow base path)."""
    return request.scope.get("root_path", "").rstrip("/")


# -- JSON ----------------------------------------------------------------------------------
@app.get("/api/models")
def api_models() -> list[dict[str, Any]]:
    return _all_models(load_sources())


@app.get("/api/models/{model:path}")
def api_model(model: str) -> dict[str, Any]:
    sources = load_sources()
    view = _model_view(sources, model)
    job = sources.jobs_by_model.get(model)
    for version in view["versions"]:
        version["train_losses"] = training_losses(version, job)
    return view


# -- HTML (model names may contain "/": the path converters take them whole) --------------------
@app.get("/", response_class=HTMLResponse)
def index(request: Request) -> str:
    sources = load_sources()
    base = _base(request)
    errors: list[str] = []
    models = _all_models(sources, errors)
    rows = []
    for m in models:
        aliases = ", ".join(f"{esc(a)} → v{esc(v)}" for a, v in sorted(m["aliases"].items())) or "—"
        rows.append([f"<a href='{base}/{render.model_href(m['model'])}'>{esc(m['model'])}</a>",
                     esc(m["versions"]), aliases])
    body = "<h1>Model registry</h1>"
    if not sources.registry_urls:
        body += "<p class='msg'>No registry configured: set RETRAINER_DB_URL or RETRAINER_CONFIG_DIR.</p>"
    body += "".join(f"<p class='msg'>{esc(e)}</p>" for e in errors)
    body += render.table(["model", "versions", "aliases (live version)"], rows) if rows else (
        "<p class='muted'>No models published yet.</p>")
    return render.page("Model registry", body)


@app.get("/models/{model:path}/versions/{version:int}", response_class=HTMLResponse)
def version_page(request: Request, model: str, version: int) -> str:
    sources = load_sources()
    view = _model_view(sources, model)
    match = [v for v in view["versions"] if v["version"] == version]
    if not match:
        raise HTTPException(status_code=404, detail=f"model {model!r} has no version {version}")
    v = match[0]
    mref = f"{_base(request)}/{render.model_href(model)}"
    lineage = [[esc(k), f"<code>{esc(v[k])}</code>"] for k in
               ("parent_version", "init_digest", "data_url", "config_hash", "data_manifest_hash", "code_revision",
                "checkpoint_tag", "artifact_digest", "artifact_url", "size_bytes", "serving_bytes", "created_by",
                "created_at")]
    if v["data_replay"]:  # the training mixture's earlier snapshots, after the primary data
        lineage.insert(5, ["data_replay", "<br>".join(
            f"<code>{esc(r['url'])}</code> (manifest <code>{esc(r['manifest_hash'][:12])}</code>, "
            f"weight {esc(r['weight'])})" for r in v["data_replay"])])
    body = (f"<p><a href='{mref}'>← {esc(model)}</a></p><h1>{esc(model)} v{version}</h1>"
            f"<h2>Training loss</h2>{render.loss_svg(training_losses(v, sources.jobs_by_model.get(model)))}"
            f"<h2>Metrics</h2>{render.metrics_cell(v['metrics'])}"
            f"<h2>Lineage</h2>{render.table(['field', 'value'], lineage)}")
    return render.page(f"{model} v{version}", body)


@app.get("/models/{model:path}", response_class=HTMLResponse)
def model_page(request: Request, model: str, message: str | None = None) -> str:
    sources = load_sources()
    view = _model_view(sources, model)
    job = sources.jobs_by_model.get(model)
    base = _base(request)
    mref = f"{base}/{render.model_href(model)}"
    live = {a["version"] for a in view["aliases"].values()}
    body = f"<p><a href='{base}/'>← all models</a></p><h1>{esc(model)}</h1>"
    if message:
        body += f"<p class='msg'>{esc(message)}</p>"

    body += "<h2>Aliases</h2>"
    alias_rows = []
    for name, info in view["aliases"].items():
        alias_rows.append([esc(name), f"v{esc(info['version'])}", esc(info["updated_by"]), esc(info["updated_at"]),
                           _rollback_form(mref, name, job is not None)])
    body += render.table(["alias", "live version", "moved by", "at", "rollback"], alias_rows)
    if job is None:
        body += "<p class='muted'>No job config publishes this model here: rollback is not offered.</p>"

    body += "<h2>Versions</h2>"
    version_rows, classes = [], []
    for v in reversed(view["versions"]):
        origin = ("from scratch" if v["parent_version"] is None else
                  f"from <a href='{mref}/versions/{v['parent_version']}'>v{esc(v['parent_version'])}</a>")
        rolled = "".join(f"<br><span class='msg'>rolled back from {esc(a)}</span>" for a in v["rolled_back_from"])
        version_rows.append([
            f"<a href='{mref}/versions/{v['version']}'>v{v['version']}</a><br>{origin}{rolled}",
            render.metrics_cell(v["metrics"]),
            (f"config <code>{esc(v['config_hash'][:12])}</code><br>data <code>{esc(v['data_manifest_hash'][:12])}"
             f"</code><br>code <code>{esc(v['code_revision'][:12])}</code><br>ckpt {esc(v['checkpoint_tag'])}"),
            f"<code>{esc(v['artifact_digest'][:12])}</code> ({esc(v['size_bytes'])} B)",
            f"{esc(v['created_by'])}<br>{esc(v['created_at'])}",
        ])
        classes.append("live" if v["version"] in live else "")
    body += render.table(["version", "metrics", "lineage", "artifact", "created"], version_rows, classes)

    body += "<h2>Pointer history</h2>"
    hist_rows = [[esc(h["alias"]), esc(h["seq"]), esc(h["action"]),
                  f"v{esc(h['from_version'])}" if h["from_version"] else "—", f"v{esc(h['to_version'])}",
                  esc(h["actor"]), esc(h["reason"]), esc(h["at"])]
                 for h in reversed(view["history"])]
    body += render.table(["alias", "#", "action", "from", "to", "by", "reason", "at"], hist_rows)

    newest = view["versions"][-1] if view["versions"] else None
    if newest:
        body += f"<h2>Training loss, v{newest['version']}</h2>" + render.loss_svg(training_losses(newest, job))
    return render.page(f"{model} · model registry", body)


def _rollback_form(mref: str, alias: str, enabled: bool) -> str:
    if not enabled:
        return "<span class='muted'>n/a</span>"
    return (f"<form method='post' action='{mref}/rollback'>"
            f"<input type='hidden' name='alias' value='{esc(alias)}'>"
            "<input name='to_version' size='4' placeholder='prev' title='target version (default: previous)'> "
            "<input name='reason' size='16' value='rollback from the registry page'> "
            "<button type='submit'>Roll back</button></form>")


# -- rollback: trigger the DAG through Airflow's REST API as the caller -----------------------
def _caller_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    token = request.cookies.get(COOKIE_NAME_JWT_TOKEN)
    if not token:
        raise HTTPException(status_code=401, detail="Not authenticated")
    # A cookie rides along with cross-site form posts: accept it only from our own origin.
    origin = request.headers.get("origin") or request.headers.get("referer") or ""
    if urlsplit(origin).netloc != request.url.netloc:
        raise HTTPException(status_code=403, detail="rollback: cross-origin request refused")
    return token


@app.post("/models/{model:path}/rollback")
async def rollback(
    request: Request,
    model: str,
    alias: Annotated[str, Form(min_length=1, max_length=200)],
    reason: Annotated[str, Form(min_length=1, max_length=500)] = "rollback from the registry page",
    to_version: Annotated[str, Form()] = "",
) -> Any:
    """Trigger `rollback_model` for this model's job; the DAG run does the audited switch."""
    token = _caller_token(request)
    job = load_sources().jobs_by_model.get(model)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job config publishes model {model!r}")
    target: int | None = None
    if to_version.strip():
        if not to_version.strip().isdigit() or int(to_version) < 1:
            raise HTTPException(status_code=400, detail=f"to_version: not a version number: {to_version!r}")
        target = int(to_version)
    conf = {"model": job.name, "alias": alias, "to_version": target, "reason": reason}
    root = request.scope.get("app_root_path", "").rstrip("/")
    url = f"{request.url.scheme}://{request.url.netloc}{root}/api/v2/dags/{ROLLBACK_DAG}/dagRuns"
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(url, json={"logical_date": None, "conf": conf},
                                 headers={"Authorization": f"Bearer {token}"})
    if resp.status_code >= 300:
        detail = resp.json().get("detail", resp.text) if resp.headers.get("content-type", "").startswith(
            "application/json") else resp.text
        raise HTTPException(status_code=resp.status_code, detail=f"triggering {ROLLBACK_DAG} failed: {detail}")
    run = resp.json()
    log.info("registry page: rollback of %s/%s triggered as run %s", model, alias, run.get("dag_run_id"))
    if "text/html" in request.headers.get("accept", ""):
        message = f"Triggered {ROLLBACK_DAG} run {run.get('dag_run_id')} for alias {alias}."
        return RedirectResponse(f"{_base(request)}/{render.model_href(model)}?message={quote(message)}",
                                status_code=303)
    return JSONResponse({"dag_id": ROLLBACK_DAG, "dag_run_id": run.get("dag_run_id"), "conf": conf})
