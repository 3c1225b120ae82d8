"""The registry page: FastAPI routes over `tasks.registry`, behind Airflow's own authentication.

Every route depends on Airflow's `get_user` (JWT from the Authorization header or the UI's session
cookie), so an anonymous request gets 401/403, and FastAPI's own docs pages are off. The rollback
button is shown only to the alias's movers (`publish.policy.<alias>.movers`; anyone else reads why
not), and it does not touch the registry itself: it triggers the `rollback_model` DAG through
Airflow's REST API with the caller's own credentials, so Airflow authorizes it, validates the Params,
and the switch is audited like any other run (under the caller's name: Airflow keeps the triggering
user on the run). The button names the version it moves the alias to, as the registry computes it
(`Registry.rollback_target`); the page it lands on reloads itself until that run is done.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

import httpx
import sqlalchemy as sa
from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, get_user
from airflow.models.dagrun import DagRun
from fastapi import Depends, FastAPI, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from retrainer_airflow.people import user_person
from sqlalchemy.orm import Session

from retrainer_registry import render
from retrainer_registry.render import esc
from retrainer_registry.source import Sources, VersionFacts, dag_run_of, load_sources, training_losses, version_facts
from tasks.base.policy import NotPermittedError, Person, check_mover
from tasks.config.endpoints import registry_at
from tasks.config.schema import JobConfig
from tasks.registry import NotFoundError, NothingToRollBackError, Registry

log = logging.getLogger(__name__)

ROLLBACK_DAG = "rollback_model"

# No /docs, /redoc or /openapi.json: FastAPI serves those outside the app's dependencies, i.e. without login.
app = FastAPI(
    title="retrainer model registry",
    description="Models, aliases, versions with lineage and metrics, pointer history, rollback.",
    dependencies=[Depends(get_user)],
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)


# -- reading the registry -------------------------------------------------------------------
def _registries(sources: Sources) -> list[Registry]:
    """The page process's Registry of each URL (tasks.config.endpoints: one per URL, kept across requests)."""
    return [registry_at(url) for url in sources.registry_urls]


def _all_models(sources: Sources, errors: list[str] | None = None) -> list[dict[str, Any]]:
    """Models across the configured registries; a registry that cannot be read is reported, not fatal."""
    seen: dict[str, dict[str, Any]] = {}
    for reg in _registries(sources):
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


def _rollback_plan(reg: Registry, model: str, alias: str) -> dict[str, Any]:
    """Where a rollback of `alias` without a target goes now ({"to_version": n}), or why it has nowhere to go."""
    try:
        return {"to_version": reg.rollback_target(model, alias)}
    except NothingToRollBackError as exc:
        return {"to_version": None, "refused": str(exc)}


def _model_view(sources: Sources, model: str) -> dict[str, Any]:
    """show() + history() of a model, from the first registry that knows it, with each alias's rollback plan."""
    for reg in _registries(sources):
        try:
            view = reg.show(model)
            view["history"] = [h.to_dict() for h in reg.history(model)]
            view["rollback"] = {alias: _rollback_plan(reg, model, alias) for alias in view["aliases"]}
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
                     render.num(m["versions"]), aliases])
    body = "<h1>Model registry</h1>"
    if not sources.registry_urls:
        body += "<p class='msg'>No registry configured: set RETRAINER_DB_URL or RETRAINER_CONFIG_DIR.</p>"
    body += "".join(f"<p class='msg'>{esc(e)}</p>" for e in errors)
    body += render.table(["model", "versions", "aliases (live version)"], rows) if rows else (
        "<p class='muted'>No models published yet.</p>")
    return render.page("Model registry", body)


def _airflow_root(request: Request) -> str:
    """The Airflow app's own path prefix (its UI and REST API live under it)."""
    return request.scope.get("app_root_path", "").rstrip("/")


class _Cells:
    """HTML cells about versions, with the links of one model page (its own URLs and the Airflow UI's)."""

    def __init__(self, request: Request, model: str) -> None:
        self.mref = f"{_base(request)}/{render.model_href(model)}"
        self.root = _airflow_root(request)

    def version(self, number: int | None) -> str:
        return "—" if number is None else f"<a href='{self.mref}/versions/{int(number)}'>v{int(number)}</a>"

    def parent(self, f: VersionFacts) -> str:
        """Where its training started: a link to the parent version, else the recorded origin (scratch, a
        pretrained directory, a weights path)."""
        if f.parent_version is not None:
            return f"from {self.version(f.parent_version)}"
        return f"from {esc(f.started_from)}"

    def actor(self, actor: str | None) -> str:
        """Who did it; an Airflow run (the DAGs' actors) links to that run's page in the Airflow UI."""
        run = dag_run_of(actor)
        if run is None:
            return esc(actor)
        return render.top_link(render.dag_run_href(self.root, *run), esc(actor))

    @staticmethod
    def data(f: VersionFacts) -> str:
        out = (f"<code>{esc(f.data_url or '—')}</code><br><span class='muted'>manifest</span> "
               f"<code>{esc(f.data_manifest_hash[:12])}</code>")
        for r in f.data_replay:  # the training mixture's earlier snapshots, after the primary data
            out += (f"<br>+ replay <code>{esc(r.get('url'))}</code> (manifest "
                    f"<code>{esc(str(r.get('manifest_hash', ''))[:12])}</code>, weight {esc(r.get('weight'))})")
        return out

    @staticmethod
    def gate(f: VersionFacts) -> str:
        """Each rule's result at publish, compactly; the rule's full sentence is its tooltip."""
        if not f.gate:
            return "<span class='muted'>no gate recorded</span>"
        parts = []
        for rule in f.gate:
            if render.number(rule.get("candidate")) is not None:
                limit = render.number(rule.get("limit"))
                cmp = "≤" if rule.get("direction", "min") == "min" else "≥"
                what = (f"{esc(rule.get('metric'))} {render.num(rule['candidate'])} "
                        + ("(no live model)" if limit is None else f"{cmp} {render.num(limit)}"))
            else:  # a record from before the rules carried their numbers
                what = esc(rule.get("note", rule.get("metric")))
            parts.append(f"{_verdict(rule)} <span title='{esc(rule.get('note', ''))}'>{what}</span>")
        return "<br>".join(parts)


def _verdict(rule: dict[str, Any]) -> str:
    return "<span class='pass'>pass</span>" if rule.get("passed") else "<span class='fail'>FAIL</span>"


def _other_metrics(f: VersionFacts) -> dict[str, float]:
    """The suite metrics beyond the first suite's loss/perplexity/tokens (shown in their own columns)."""
    first = f"{f.suites[0].get('name')}." if f.suites else None
    return {k: v for k, v in f.suite_metrics.items() if not k.endswith(".tokens")
            and not (first and k in (first + "loss", first + "perplexity"))}


def _gate_rows(f: VersionFacts) -> list[list[str]]:
    return [[esc(r.get("rule")), _verdict(r), esc(r.get("metric")), render.num(r.get("candidate")),
             render.num(r.get("reference")), render.num(r.get("limit")), esc(r.get("note"))] for r in f.gate]


@app.get("/models/{model:path}/versions/{version:int}", response_class=HTMLResponse)
def version_page(request: Request, model: str, version: int) -> str:
    sources = load_sources()
    view = _model_view(sources, model)
    match = [v for v in view["versions"] if v["version"] == version]
    if not match:
        raise HTTPException(status_code=404, detail=f"model {model!r} has no version {version}")
    v = match[0]
    f = version_facts(v, sources.jobs_by_model.get(model))
    cells = _Cells(request, model)
    live_on = [a for a, info in view["aliases"].items() if info["version"] == version]
    badges = "".join(f"<span class='badge'>live: {esc(a)}</span>" for a in live_on)
    badges += "".join(f"<span class='badge fail'>rolled back from {esc(a)}</span>" for a in v["rolled_back_from"])
    numbers = [["held-out loss", render.num(f.loss)], ["perplexity", render.num(f.perplexity)],
               ["held-out tokens", render.num(f.eval_tokens)], ["trained to step", render.num(f.step)],
               ["trained on", cells.data(f)], ["parent", cells.parent(f)], ["made by", cells.actor(f.created_by)],
               ["created", render.when(f.created_at)]]
    body = (f"<p><a href='{cells.mref}'>← {esc(model)}</a></p><h1>{esc(model)} v{version} {badges}</h1>"
            + render.table(["", f"v{version}"], numbers))
    live = f.evaluated_live
    if f.suite_metrics:
        head = ["metric", f"v{version}"]
        if live is not None:
            head.append(f"live v{live.get('version')} in the same evaluation")
        rows = [[esc(k), render.num(val)] + ([render.num(live["metrics"].get(k))] if live else [])
                for k, val in f.suite_metrics.items()]
        body += render.section("metrics", "Metrics", render.table(head, rows))
    if f.gate:
        body += render.section("gate", "Gate rules at publish", render.table(
            ["rule", "result", "metric", "candidate", "live", "limit", "rule and verdict"], _gate_rows(f)))
    if f.suites:
        body += render.section("suites", "Evaluated on", render.table(
            ["suite", "data", "split", "manifest"],
            [[esc(s.get("name")), f"<code>{esc(s.get('source_url'))}</code>", esc(s.get("split")),
              f"<code>{esc(str(s.get('manifest_hash', ''))[:12])}</code>"] for s in f.suites]))
    body += render.section("curve", "Training loss", render.curves_svg(
        [render.Curve(f"v{version}", f.train_losses, f.step)], f"training loss of v{version}"))
    lineage = [[esc(k), f"<code>{esc(v[k])}</code>"] for k in
               ("parent_version", "init_digest", "data_url", "config_hash", "data_manifest_hash", "code_revision",
                "checkpoint_tag", "artifact_digest", "artifact_url", "size_bytes", "serving_bytes", "created_by",
                "created_at")]
    if v["data_replay"]:
        lineage.insert(5, ["data_replay", "<br>".join(
            f"<code>{esc(r['url'])}</code> (manifest <code>{esc(r['manifest_hash'][:12])}</code>, "
            f"weight {esc(r['weight'])})" for r in v["data_replay"])])
    body += render.section("lineage", "Lineage", render.table(["field", "value"], lineage))
    body += render.section("config", "Training config", _config(v.get("config")))
    return render.page(f"{model} v{version}", body)


def _config(config: dict[str, Any] | None) -> str:
    """The resolved job config the version was trained with (credentials redacted at publish): a one-line
    summary of what people compare first, the whole of it folded below."""
    if not config:
        return "<p class='muted'>Not recorded (published before versions kept their config).</p>"
    train, par, model = config.get("train") or {}, config.get("parallel") or {}, config.get("model") or {}
    parts = [f"{train['steps']} steps" if "steps" in train else None,
             f"lr {train['lr']}" if "lr" in train else None,
             f"layout tp {par.get('tp')} pp {par.get('pp')} dp {par.get('dp')}" if par else None,
             f"{model.get('n_layers')} layers × d_model {model.get('d_model')}" if model else None,
             f"init_from {train['init_from']}" if "init_from" in train else None]
    summary = ", ".join(p for p in parts if p) or "the whole config"
    return render.collapsible(esc(summary), render.json_block(config))


OVERLAID = 5  # versions whose curves share the overlay chart (the newest, plus whatever is live)
REFRESH_S = 2  # while a triggered rollback run is pending, the page reloads itself this often


@app.get("/models/{model:path}", response_class=HTMLResponse)
def model_page(request: Request, model: str, user: GetUserDep, session: SessionDep,
               triggered: str | None = None) -> HTMLResponse:
    sources = load_sources()
    view = _model_view(sources, model)
    job = sources.jobs_by_model.get(model)
    cells = _Cells(request, model)
    facts = [version_facts(v, job) for v in view["versions"]]
    by_version = {f.version: f for f in facts}
    live_on: dict[int, list[str]] = {}
    for alias, info in view["aliases"].items():
        live_on.setdefault(info["version"], []).append(alias)
    body = f"<p><a href='{_base(request)}/'>← all models</a></p><h1>{esc(model)}</h1>"
    refresh = None
    shown = _rollback_banner(cells, view["history"], triggered, session, user) if triggered else None
    if shown is not None:  # only for a run that exists (a made-up ?triggered= shows nothing)
        banner, pending = shown
        body += f"<p class='msg' id='triggered'>{banner}</p>"
        refresh = REFRESH_S if pending else None

    rolled_on = {a for v in view["versions"] for a in v["rolled_back_from"]}
    someone = user_person(user)
    alias_rows = [[esc(name), cells.version(info["version"]), cells.actor(info["updated_by"]),
                   render.when(info["updated_at"]),
                   _rollback_cell(cells.mref, name, view["rollback"][name], name in rolled_on, job, someone)]
                  for name, info in view["aliases"].items()]
    aliases = render.table(["alias", "live version", "moved by", "at", "rollback"], alias_rows)
    if job is None:
        aliases += "<p class='muted'>No job config publishes this model here: rollback is not offered.</p>"
    body += render.section("aliases", "Aliases", aliases)

    if facts:
        body += render.section("candidate", "Candidate vs live", _candidate_vs_live(cells, view, facts, by_version))
        live_curves = [render.curves_svg([render.Curve(f"v{n} (live: {', '.join(names)})",
                                                       by_version[n].train_losses, by_version[n].step)],
                                         f"training loss of the live version v{n}")
                       for n, names in sorted(live_on.items()) if n in by_version]
        body += render.section("live-curve", "Training loss of the live version",
                               "".join(live_curves) or "<p class='muted'>Nothing is live.</p>")
        body += render.section("versions", "Versions", _versions_table(cells, view, facts, live_on))
        shown = sorted({f.version for f in facts[-OVERLAID:]} | {n for n in live_on if n in by_version})
        overlay = [render.Curve(f"v{n}" + (f" (live: {', '.join(live_on[n])})" if n in live_on else ""),
                                by_version[n].train_losses, by_version[n].step) for n in shown]
        body += render.section("overlay", f"Training loss of the last {len(shown)} versions",
                               render.curves_svg(overlay, "training loss curves of several versions"))

    hist_rows = [[esc(h["alias"]), esc(h["seq"]), esc(h["action"]),
                  cells.version(h["from_version"]), cells.version(h["to_version"]),
                  cells.actor(h["actor"]), esc(h["reason"]), render.when(h["at"])]
                 for h in reversed(view["history"])]
    body += render.section("history", "Pointer history",
                           render.table(["alias", "#", "action", "from", "to", "by", "reason", "at"], hist_rows))
    # The reload goes to the page itself, never to a URL with a #fragment (that would only scroll).
    reload_url = f"{cells.mref}?triggered={quote(triggered, safe='')}" if refresh else None
    return HTMLResponse(render.page(f"{model} · model registry", body, refresh_s=refresh, refresh_url=reload_url))


def _versions_table(cells: _Cells, view: dict[str, Any], facts: list[VersionFacts],
                    live_on: dict[int, list[str]]) -> str:
    """One row per version, newest first: the held-out numbers, the gate's verdicts, where it came from."""
    others = any(_other_metrics(f) for f in facts)
    rolled = {v["version"]: v["rolled_back_from"] for v in view["versions"]}
    rows, classes = [], []
    for f in reversed(facts):
        badges = "".join(f"<br><span class='badge'>live: {esc(a)}</span>" for a in live_on.get(f.version, []))
        badges += "".join(f"<br><span class='fail'>rolled back from {esc(a)}</span>" for a in rolled[f.version])
        row = [cells.version(f.version) + badges, cells.parent(f), render.num(f.loss), render.num(f.perplexity),
               render.num(f.eval_tokens), render.num(f.step)]
        if others:
            row.append("<br>".join(f"{esc(k)} {render.num(v)}" for k, v in _other_metrics(f).items()) or "—")
        row += [cells.gate(f), cells.data(f), cells.actor(f.created_by), render.when(f.created_at)]
        rows.append(row)
        classes.append("live" if f.version in live_on else "")
    head = ["version", "parent", "held-out loss", "perplexity", "held-out tokens", "step"]
    head += ["other metrics"] if others else []
    head += ["gate at publish", "trained on", "made by", "created"]
    return render.table(head, rows, classes)


def _candidate_vs_live(cells: _Cells, view: dict[str, Any], facts: list[VersionFacts],
                       by_version: dict[int, VersionFacts]) -> str:
    """The newest version beside each alias's live one where they differ. The live numbers are the ones
    scored in the candidate's own evaluation (same held-out windows, what the gate compared) when that
    evaluation scored this live version; otherwise each version's own record."""
    newest = facts[-1]
    tables = []
    for alias, info in view["aliases"].items():
        live = by_version.get(info["version"])
        if live is None or live.version == newest.version:
            continue
        same = newest.evaluated_live if (newest.evaluated_live or {}).get("version") == live.version else None
        live_metrics = {k: v for k, v in same["metrics"].items() if render.number(v) is not None} if same else (
            live.suite_metrics)
        rows = []
        for key in sorted(set(newest.suite_metrics) | set(live_metrics)):
            if key.endswith(".tokens"):
                continue
            c, lv = newest.suite_metrics.get(key), render.number(live_metrics.get(key))
            rows.append([esc(key), render.num(c), render.num(lv), render.delta(c, lv)])
        if not rows:  # records from before suites: the flat held-out numbers
            rows = [[name, render.num(c), render.num(lv), render.delta(c, lv)] for name, c, lv in (
                ("held-out loss", newest.loss, live.loss), ("perplexity", newest.perplexity, live.perplexity))]
        rows += [["held-out tokens", render.num(newest.eval_tokens), render.num(live.eval_tokens), ""],
                 ["trained to step", render.num(newest.step), render.num(live.step), ""],
                 ["trained on", cells.data(newest), cells.data(live), ""],
                 ["parent", cells.parent(newest), cells.parent(live), ""],
                 ["gate at publish", cells.gate(newest), cells.gate(live), ""],
                 ["made by", cells.actor(newest.created_by), cells.actor(live.created_by), ""],
                 ["created", render.when(newest.created_at), render.when(live.created_at), ""]]
        where = ("live numbers from the candidate's evaluation (the same held-out windows)" if same else
                 "each version's numbers from its own evaluation")
        rolled = [v["rolled_back_from"].get(alias) for v in view["versions"] if v["version"] == newest.version]
        note = ""
        if rolled and rolled[0]:
            r = rolled[0]
            note = (f"<p class='fail'>v{newest.version} was rolled back from {esc(alias)} by {cells.actor(r['actor'])} "
                    f"at {render.when(r['at'])}: {esc(r['reason'])}</p>")
        tables.append(f"<div><h3>{esc(alias)}</h3>{note}" + render.table(
            ["", f"candidate v{newest.version}", f"live v{live.version}", "difference"], rows)
            + f"<p class='muted'>{where}</p></div>")
    if not tables:
        on = [a for a, info in view["aliases"].items() if info["version"] == newest.version]
        return (f"<p class='muted'>The newest version, v{newest.version}, is live on {esc(', '.join(on))}.</p>"
                if on else f"<p class='muted'>No alias points to a version yet; the newest is v{newest.version}.</p>")
    return f"<div class='side'>{''.join(tables)}</div>"


def _rollback_banner(cells: _Cells, history: list[dict[str, Any]], run_id: str, session: Session,
                     user: BaseUser) -> tuple[str, bool] | None:
    """What became of a rollback run this page triggered: done (the audited move it made), failed, or still
    pending (the page then reloads itself); None for a run that does not exist (or the caller may not see).
    The move is read from the registry's history (the DAG's actor names the run); the run's state from
    Airflow, for a caller allowed to see rollback_model's runs."""
    link = render.top_link(render.dag_run_href(cells.root, ROLLBACK_DAG, run_id), esc(run_id))
    text = f"Triggered {ROLLBACK_DAG} run {link}"
    moved = [h for h in history if dag_run_of(h["actor"]) == (ROLLBACK_DAG, run_id)]
    if moved:
        h = moved[-1]
        return (f"{text}: it moved {esc(h['alias'])} from {cells.version(h['from_version'])} to "
                f"{cells.version(h['to_version'])}.", False)
    run = _run(run_id, session, user)
    if run is None:
        return None
    state, note = run
    if state in ("queued", "running"):
        return f"{text}: {state}; this page reloads until it finishes.", True
    why = f": {esc(note)}" if note else " (see the run's logs)"
    return f"{text}: {esc(state)} without moving an alias{why}", False


def _run(run_id: str, session: Session, user: BaseUser) -> tuple[str, str | None] | None:
    """(state, note) of a rollback_model run, or None if it is unknown or the caller may not see it."""
    allowed = get_auth_manager().is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN,
                                                   details=DagDetails(id=ROLLBACK_DAG), user=user)
    if not allowed:
        return None
    run = session.scalar(sa.select(DagRun).where(DagRun.dag_id == ROLLBACK_DAG, DagRun.run_id == run_id))
    return None if run is None else (str(run.state), run.note)


def _rollback_cell(mref: str, alias: str, plan: dict[str, Any], forceable: bool, job: JobConfig | None,
                   someone: Person) -> str:
    """The Roll back button for a person the alias's movers admit; for anyone else, why not."""
    if job is None:
        return "<span class='muted'>n/a</span>"
    try:
        check_mover(job.publish.policy_for(alias), alias, someone, "roll back")
    except NotPermittedError as refused:
        return f"<span class='muted' id='no-rollback-{esc(alias)}'>{esc(refused)}</span>"
    return _rollback_form(mref, alias, plan, forceable)


def _rollback_form(mref: str, alias: str, plan: dict[str, Any], forceable: bool) -> str:
    """The Roll back button, naming the version it moves `alias` to (or why there is none: then only a chosen
    version); a force box only where a version was rolled back from this alias."""
    to = plan["to_version"]
    if to is not None:
        target = (f"<input name='to_version' size='4' placeholder='v{int(to)}' "
                  f"title='another target version (empty: v{int(to)})'> ")
        button, why = f"Roll back to v{int(to)}", ""
    else:
        target = "<input name='to_version' size='4' placeholder='version' required title='target version'> "
        button, why = "Roll back to the version given", f"<br><span class='muted'>{esc(plan['refused'])}</span>"
    force = ("<label title='put back a version that was rolled back from this alias (say why in the reason)'>"
             "<input type='checkbox' name='force' value='true'> force</label> " if forceable else "")
    return (f"<form method='post' action='{mref}/rollback' id='rollback-{esc(alias)}'>"
            f"<input type='hidden' name='alias' value='{esc(alias)}'>{target}"
            f"<input name='reason' size='16' value='rollback from the registry page'> {force}"
            f"<button type='submit'>{esc(button)}</button></form>{why}")


# -- rollback: trigger the DAG through Airflow's REST API as the caller -----------------------
def _caller_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    token = request.cookies.get(COOKIE_NAME_JWT_TOKEN)
    if not token:
        raise HTTPException(status_code=401, detail="Not authenticated")
    # A cookie rides along with cross-site form posts (Airflow's carries no SameSite): accept it only from our
    # own origin, scheme, host and port alike (http://host:8080 is another origin than https://host:8080).
    sent = urlsplit(request.headers.get("origin") or request.headers.get("referer") or "")
    if (sent.scheme, sent.netloc) != (request.url.scheme, request.url.netloc):
        raise HTTPException(status_code=403, detail="rollback: cross-origin request refused")
    return token


@app.post("/models/{model:path}/rollback")
async def rollback(
    request: Request,
    model: str,
    user: GetUserDep,
    alias: Annotated[str, Form(min_length=1, max_length=200)],
    reason: Annotated[str, Form(min_length=1, max_length=500)] = "rollback from the registry page",
    to_version: Annotated[str, Form()] = "",
    force: Annotated[bool, Form()] = False,
) -> Any:
    """Trigger `rollback_model` for this model's job; the DAG run does the audited switch (and checks the
    mover again: this refusal is the page saying it first, in words)."""
    token = _caller_token(request)
    job = load_sources().jobs_by_model.get(model)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job config publishes model {model!r}")
    try:
        check_mover(job.publish.policy_for(alias), alias, user_person(user), "roll back")
    except NotPermittedError as refused:
        if "text/html" in request.headers.get("accept", ""):
            back = f"<p><a href='{_base(request)}/{render.model_href(model)}'>← {esc(model)}</a></p>"
            return HTMLResponse(render.page("Not allowed", f"{back}<h1>Not allowed</h1><p class='msg'>"
                                                           f"{esc(refused)}</p>"), status_code=403)
        raise HTTPException(status_code=403, detail=str(refused)) from None
    target: int | None = None
    if to_version.strip():
        if not to_version.strip().isdigit() or int(to_version) < 1:
            raise HTTPException(status_code=400, detail=f"to_version: not a version number: {to_version!r}")
        target = int(to_version)
    conf = {"model": job.name, "alias": alias, "to_version": target, "reason": reason, "force": force}
    url = f"{request.url.scheme}://{request.url.netloc}{_airflow_root(request)}/api/v2/dags/{ROLLBACK_DAG}/dagRuns"
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(url, json={"logical_date": None, "conf": conf},
                                 headers={"Authorization": f"Bearer {token}"})
    if resp.status_code >= 300:
        detail = resp.json().get("detail", resp.text) if resp.headers.get("content-type", "").startswith(
            "application/json") else resp.text
        raise HTTPException(status_code=resp.status_code, detail=f"triggering {ROLLBACK_DAG} failed: {detail}")
    run = resp.json()
    log.info("registry page: rollback of %s/%s triggered as run %s", model, alias, run.get("dag_run_id"))
    if "text/html" in request.headers.get("accept", ""):  # the button: back to the page, which follows the run
        return RedirectResponse(f"{_base(request)}/{render.model_href(model)}?triggered="
                                f"{quote(str(run.get('dag_run_id')), safe='')}", status_code=303)
    return JSONResponse({"dag_id": ROLLBACK_DAG, "dag_run_id": run.get("dag_run_id"), "conf": conf})
