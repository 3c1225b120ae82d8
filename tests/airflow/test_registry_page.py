"""The registry page inside Airflow's own API app (in-process, real auth manager, real registry DBs).

Fast checks the standalone test does not make: two weeks of retraining and a rollback recorded by the
real gate, publish and rollback code, then what the page shows of them (the metrics table, the live
version's curve, the overlay, candidate vs live, links to the runs and parents); hostile names are
escaped, the loss curve comes from the version's metrics or from the run's summary.json, an unreadable
registry is reported (password hidden), and the rollback button refuses cross-site cookie posts.
"""

from __future__ import annotations

import html
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml

from tasks.stages.publish import PublishResult
from tests.airflow.browser import section
from tests.airflow.conftest import ROOT

HOSTILE = "<script>alert('x')</script>"


@pytest.fixture(scope="module")
def airflow_app(airflow_db: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from airflow.api_fastapi.app import create_app
        from fastapi.testclient import TestClient

        client = TestClient(create_app())
    return client, _token(client, airflow_db, "admin")


def _token(client, airflow_home: str, user: str) -> str:
    """A bearer token of one of the session's users (tests/services.py AIRFLOW_TEST_USERS), logged in as they would."""
    password = json.loads((Path(airflow_home) / "simple_auth_manager_passwords.json.generated").read_text())[user]
    resp = client.post("/auth/token", json={"username": user, "password": password})
    assert resp.status_code in (200, 201), resp.text
    return resp.json()["access_token"]


def _publish(registry_url: str, tmp_path: Path, model: str, n: int, metrics_for) -> None:
    from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

    upgrade(registry_url)
    store = ArtifactStore(str(tmp_path / "models"))
    with Registry(registry_url) as reg:
        for i in range(1, n + 1):
            blob = tmp_path / f"weights-{i}.pt"
            blob.write_bytes(f"weights {model} {i}".encode())
            replay = [{"url": f"s3://b/{HOSTILE}", "manifest_hash": "a" * 64, "weight": 0.05}] if i == 2 else []
            made = {"config": {"train": {"steps": 7, "lr": 0.01}, "data": {"source_url": f"s3://b/{HOSTILE}"}},
                    "started_from": f"pretrained s3://b/{HOSTILE}"} if i == 2 else {}  # v1: before revision 0006
            lineage = Lineage(config_hash=f"{i:064x}", data_manifest_hash="d" * 64, code_revision="rev",
                              checkpoint_tag=f"step-{i:06d}", data_replay=replay, **made)
            reg.publish_version(model, store.put(blob), lineage, metrics_for(i),
                                created_by=HOSTILE if i == 1 else f"airflow retrain_m/{HOSTILE}")
            reg.switch_alias(model, "production", i, actor=HOSTILE, reason=f"because {HOSTILE}", action="publish")


def _config(tmp_path: Path, model: str, registry_url: str, **sections: dict[str, Any]) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["publish"].update(model_name=model, registry_url=registry_url)
    cfg["train"]["output_dir"] = str(tmp_path / "runs")
    for name, values in sections.items():
        cfg[name].update(values)
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "job.yaml").write_text(yaml.safe_dump(cfg))
    return folder


def test_page_escapes_hostile_names_and_draws_loss_curves(
    airflow_app, registry_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostile name can only come from the registry API (configs refuse it): the page, pointed at the
    registry by RETRAINER_DB_URL, shows it escaped, with each version's curve from its metrics."""
    client, token = airflow_app
    model = f"m {HOSTILE}"
    curves = {1: [6.0, 5.5, 5.2], 2: [5.0, 4.0, 3.5, 3.0]}
    gate = [{"rule": 0, "metric": "frozen.loss", "passed": True, "note": f"evaluate.gate.rules[0] {HOSTILE}"},
            {"rule": 1, "metric": "new.loss", "passed": False, "note": "evaluate.gate.rules[1] (new.loss min)"}]
    _publish(registry_url, tmp_path, model, 2, lambda i: {"loss": 3.0 / i, "train_losses": curves[i],
                                                          "metrics": {"frozen.loss": 2.125}, "gate": gate})
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(tmp_path))  # no configs
    monkeypatch.setenv("RETRAINER_DB_URL", registry_url)
    auth = {"Authorization": f"Bearer {token}"}

    index = client.get("/retrainer/", headers=auth)
    assert index.status_code == 200
    ref = quote(model, safe="")  # the page links the same way
    assert f"models/{ref}" in index.text
    page = client.get(f"/retrainer/models/{ref}", headers=auth)
    assert page.status_code == 200
    for resp in (index, page):
        assert HOSTILE not in resp.text and "&lt;script&gt;" in resp.text
    # No job config names this model, so no rollback form (rollback_model only takes configured models).
    assert "<polyline" in page.text and "Roll back" not in page.text

    api = client.get(f"/retrainer/api/models/{ref}", headers=auth).json()
    assert [v["train_losses"] for v in api["versions"]] == [curves[1], curves[2]]
    v1 = client.get(f"/retrainer/models/{ref}/versions/1", headers=auth)
    assert v1.status_code == 200 and "<polyline" in v1.text and HOSTILE not in v1.text
    assert "data_replay" not in v1.text  # trained on its own data alone
    v2 = client.get(f"/retrainer/models/{ref}/versions/2", headers=auth)
    assert v2.status_code == 200 and HOSTILE not in v2.text
    assert "data_replay" in v2.text and "manifest <code>aaaaaaaaaaaa</code>, weight 0.05" in v2.text
    # The config each version was trained with (v1 predates recording it), and where it started, escaped.
    assert "Not recorded" in section(v1.text, "config")
    assert "<summary>7 steps, lr 0.01</summary>" in section(v2.text, "config")
    assert f"s3://b/{html.escape(HOSTILE)}" in section(v2.text, "config")
    assert f"from pretrained s3://b/{html.escape(HOSTILE)}" in page.text
    # Each suite metric, and each gate rule's result as it was recorded with the version.
    assert "<td>frozen.loss</td><td class='num'>2.125</td>" in section(v2.text, "metrics")
    gate_rows = section(v2.text, "gate")
    assert "<span class='pass'>pass</span>" in gate_rows and "evaluate.gate.rules[0] &lt;script&gt;" in gate_rows
    assert "<span class='fail'>FAIL</span>" in gate_rows and "evaluate.gate.rules[1] (new.loss min)" in gate_rows
    # A run id in an actor, and one in the page's own query, are quoted in links and escaped in text.
    hostile_run = f"href='/dags/retrain_m/runs/{quote(HOSTILE, safe='')}' target='_top'"
    assert hostile_run in page.text and f"airflow retrain_m/{HOSTILE}" not in page.text
    after = client.get(f"/retrainer/models/{ref}", params={"triggered": HOSTILE}, headers=auth)
    assert after.status_code == 200 and HOSTILE not in after.text
    assert "id='triggered'" not in after.text  # no such run: the page reflects nothing of the query


def test_loss_curve_falls_back_to_the_runs_summary(
    airflow_app, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version published without a curve in its metrics: the page reads the run's summary.json."""
    client, token = airflow_app
    _publish(sqlite_url, tmp_path, "plain", 1, lambda i: {"loss": 3.0})
    run_dir = tmp_path / "runs" / f"{1:064x}"[:16]
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"experiment_key": f"{1:064x}", "losses": [6.0, 5.5, 5.2]}))
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(_config(tmp_path, "plain", sqlite_url)))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    api = client.get("/retrainer/api/models/plain", headers={"Authorization": f"Bearer {token}"}).json()
    assert [v["train_losses"] for v in api["versions"]] == [[6.0, 5.5, 5.2]]


def test_unreadable_registry_is_reported_without_its_password(
    airflow_app, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, token = airflow_app
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(tmp_path))  # no configs
    monkeypatch.setenv("RETRAINER_DB_URL", "postgresql+psycopg://u:s3cret-pw@127.0.0.1:1/none?connect_timeout=2")
    page = client.get("/retrainer/", headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200
    assert "cannot read registry" in page.text and "OperationalError" in page.text
    assert "s3cret-pw" not in page.text


def test_rollback_button_refuses_cross_site_cookie_posts_and_unknown_models(
    airflow_app, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, token = airflow_app
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(_config(tmp_path, "known", sqlite_url)))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    client.cookies.set("_token", token)
    try:
        forged = client.post("/retrainer/models/known/rollback", data={"alias": "production"},
                             headers={"Origin": "https://evil.example"})
        assert forged.status_code == 403 and "cross-origin" in forged.text
        unknown = client.post("/retrainer/models/unknown/rollback", data={"alias": "production"},
                              headers={"Authorization": f"Bearer {token}"})
        assert unknown.status_code == 404 and "unknown" in unknown.text
    finally:
        client.cookies.clear()


def test_only_an_alias_s_movers_get_the_rollback_button_and_a_post_by_anyone_else_is_refused_in_words(
    airflow_app, airflow_db: str, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each Airflow role opens the model page: production's movers (role:op: op1, and admin above it) see Roll
    back, a `user` and a `viewer` read why not; a cookie POST by the user (the page's own form, same origin) is
    refused naming the policy, as HTML for a browser and JSON otherwise; production stays where it was. The
    API docs need a login like every page; a form post from the same host on another scheme is cross-origin."""
    client, _ = airflow_app
    _publish(sqlite_url, tmp_path, "guarded", 2, lambda i: {"loss": 3.0 / i})
    folder = _config(tmp_path, "guarded", sqlite_url, publish={"policy": {"production": {"movers": ["role:op"]}}})
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(folder))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    tokens = {user: _token(client, airflow_db, user) for user in ("admin", "op1", "user1", "viewer1")}
    for user, token in tokens.items():
        page = client.get("/retrainer/models/guarded", headers={"Authorization": f"Bearer {token}"})
        assert page.status_code == 200, (user, page.text)
        aliases = section(page.text, "aliases")
        if user in ("admin", "op1"):
            assert "<button type='submit'>Roll back to v1</button>" in aliases, user
        else:
            assert "<button" not in aliases and "Roll back" not in aliases, user
            assert html.escape(f"{user} (role {'user, viewer' if user == 'user1' else 'viewer'}) may not roll back "
                               "'production': publish.policy.production.movers is [role:op]") in aliases
    client.cookies.set("_token", tokens["user1"])
    try:
        same_origin = {"Origin": "http://testserver"}
        browser = client.post("/retrainer/models/guarded/rollback", data={"alias": "production"},
                              headers={**same_origin, "Accept": "text/html"})
        assert browser.status_code == 403 and browser.headers["content-type"].startswith("text/html")
        assert "user1 (role user, viewer) may not roll back &#x27;production&#x27;" in browser.text
        api = client.post("/retrainer/models/guarded/rollback", data={"alias": "production"}, headers=same_origin)
        assert api.status_code == 403 and "publish.policy.production.movers is [role:op]" in api.json()["detail"]
        other_scheme = client.post("/retrainer/models/guarded/rollback", data={"alias": "production"},
                                   headers={"Origin": "https://testserver"})
        assert other_scheme.status_code == 403 and "cross-origin" in other_scheme.text
    finally:
        client.cookies.clear()
    from tasks.registry import Registry

    with Registry(sqlite_url) as reg:
        assert reg.live_version("guarded", "production").version == 2
        assert [h.action for h in reg.history("guarded", "production")] == ["publish", "publish"]
    for docs in ("/retrainer/docs", "/retrainer/redoc", "/retrainer/openapi.json"):
        assert client.get(docs).status_code in (401, 403, 404), docs  # nothing served without a login
        assert client.get(docs, headers={"Authorization": f"Bearer {tokens['admin']}"}).status_code == 404, docs


RETRAIN_RUNS = {1: "manual__2025-01-06T00:00:00+00:00", 2: "asset_triggered__2025-01-13T00:00:00.5+00:00"}
ROLLBACK_RUN = "manual__2025-01-14T09:30:00+00:00"
GATE_RULES = [{"metric": "heldout.loss", "tolerance": 0.05},
              {"metric": "heldout.perplexity", "against": "absolute", "threshold": 500.0}]


def _retrain(cfg, week: int, losses: list[float], heldout: float, live_heldout: float | None) -> PublishResult:
    """One retrain run as the DAG records it, minus the training and scoring: a committed checkpoint of the
    run (starting from the live version), the evaluate stage's output shape (the live model scored in the
    same evaluation), then the real gate and the real publish with the DAG's actor."""
    from tasks.evaluate import Evaluated
    from tasks.registry import Registry
    from tasks.runs.identity import StartingWeights, identity, scratch
    from tasks.stages import lifecycle
    from tests.checkpoints import commit_reference, reference_state

    with Registry(cfg.publish.registry_url) as reg:
        live = reg.live_version(cfg.publish.model_name, cfg.publish.alias)
    init = scratch(cfg) if live is None else StartingWeights(
        requested="live", version=live.version, digest=live.artifact_digest, url=live.artifact_url,
        note=f"v{live.version}", trained_on=live.data_manifest_hash, kind=live.artifact_kind)
    run = identity(cfg, f"{week:064x}", init)
    steps = len(losses)
    ckpt = commit_reference(cfg.with_overrides({"train.output_dir": str(run.run_dir(cfg))}), run,
                            reference_state(cfg.model, week), steps)
    scores = {"heldout.loss": heldout, "heldout.perplexity": math.exp(heldout), "heldout.tokens": 4096}
    metrics = {
        "metrics": scores, "suite_hash": f"{week:064x}", "loss": heldout, "perplexity": math.exp(heldout),
        "tokens": 4096, "batches": 8, "batch_size": 8, "checkpoint_dir": str(ckpt), "checkpoint_tag": ckpt.name,
        "step": steps, "experiment_key": run.experiment_key,
        "suites": [{"name": "heldout", "source_url": run.data_url, "manifest": "manifest.json", "split": "heldout",
                    "manifest_hash": run.data_manifest_hash}],
        "live": None if live is None else {"version": live.version, "cached": False, "metrics": {
            "heldout.loss": live_heldout, "heldout.perplexity": math.exp(live_heldout), "heldout.tokens": 4096}},
    }
    evaluated = Evaluated.from_xcom(metrics)
    decision = lifecycle.stage_gate(cfg, run, evaluated)
    assert decision.publish, decision
    trained = lifecycle.Trained.from_xcom({"outcome": "trained", "checkpoint_dir": str(ckpt),
                                           "checkpoint_tag": ckpt.name, "trained_steps": steps, "losses": losses})
    return lifecycle.stage_publish(cfg, run, trained, evaluated, gate=decision,
                                   actor=f"airflow retrain_{cfg.name}/{RETRAIN_RUNS[week]}", reason="retrain")


def _run_href(dag_id: str, run_id: str) -> str:
    return f"href='/dags/{dag_id}/runs/{quote(run_id, safe='')}' target='_top'"


def test_two_weeks_and_a_rollback_as_the_page_shows_them(
    airflow_app, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Week 1 publishes v1, week 2 v2 from v1 (both through the real gate and publish), an operator's
    rollback_model run moves production back to v1. The page shows each version's numbers and gate
    verdicts, v1's curve as the live one (not the newest's), both curves overlaid, v2 beside v1 with the
    live numbers of v2's own evaluation, and links to the runs that made them and to the parent."""
    from tasks.models.resolve import load_config
    from tasks.registry import upgrade
    from tasks.stages import lifecycle

    client, token = airflow_app
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    folder = _config(tmp_path, "tiny-llama", sqlite_url, evaluate={"gate": {"rules": GATE_RULES}},
                     data={"cache_dir": str(tmp_path / "cache")},
                     publish={"store_url": str(tmp_path / "store"), "export_dtype": "fp32"})
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(folder))
    cfg = load_config(folder / "job.yaml")
    upgrade(sqlite_url)
    curves = {1: [6.0, 5.0, 4.5, 4.25], 2: [4.4, 3.9, 3.7, 3.5]}
    assert _retrain(cfg, 1, curves[1], heldout=4.3, live_heldout=None).version == 1
    assert _retrain(cfg, 2, curves[2], heldout=3.6, live_heldout=4.0).parent_version == 1
    auth = {"Authorization": f"Bearer {token}"}
    # Before the click, the button says where it goes (the registry's rollback target); nothing to force.
    before = section(client.get("/retrainer/models/tiny-llama", headers=auth).text, "aliases")
    assert "<button type='submit'>Roll back to v1</button>" in before and "name='force'" not in before
    moved = lifecycle.stage_rollback(cfg, actor=f"alice via airflow rollback_model/{ROLLBACK_RUN}",
                                     reason="prod regression")
    assert (moved.from_version, moved.to_version) == (2, 1)

    page = client.get("/retrainer/models/tiny-llama", headers=auth)
    assert page.status_code == 200
    text = page.text
    # Rolling back again would put back the v2 alice just rolled back: no default, the reason, a force box.
    form = section(text, "aliases")
    assert "Roll back to v" not in form and "<button type='submit'>Roll back to the version given</button>" in form
    assert "name='force'" in form and "every version live on it before version 1 was rolled back" in form
    assert "v2 by alice via airflow rollback_model/" in form and "prod regression" in form

    # The metrics table: one row per version, newest first, the numbers as recorded.
    versions = section(text, "versions")
    rows = re.findall(r"<tr( class='live')?>(.*?)</tr>", versions, re.S)[1:]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for _, row in rows]
    assert [bool(live) for live, _ in rows] == [False, True]  # v1 is live again
    v2, v1 = cells
    assert v2[0].startswith("<a href='/retrainer/models/tiny-llama/versions/2'>v2</a>")
    assert "rolled back from production" in v2[0] and "live: production" in v1[0]
    assert v2[1] == "from <a href='/retrainer/models/tiny-llama/versions/1'>v1</a>" and v1[1] == "from scratch"
    assert v2[2:6] == ["3.6", f"{math.exp(3.6):.4g}", "4,096", "4"] and v1[2:6] == ["4.3", "73.7", "4,096", "4"]
    assert "<span class='pass'>pass</span>" in v2[6] and "heldout.loss 3.6 ≤ 4.2" in v2[6]  # 4.0 + 5%
    assert "heldout.perplexity 36.6 ≤ 500" in v2[6] and "heldout.loss 4.3 (no live model)" in v1[6]
    assert cfg.data.source_url in v2[7] and f"{2:064x}"[:12] in v2[7]
    assert _run_href("retrain_tiny-llama", RETRAIN_RUNS[2]) in v2[8]
    assert _run_href("retrain_tiny-llama", RETRAIN_RUNS[1]) in v1[8]

    # The live version's curve is v1's, though v2 is newer; the overlay has both.
    live_curve = section(text, "live-curve")
    assert live_curve.count("<polyline") == 1
    assert "v1 (live: production): loss 6 → 4.25 over 4 steps" in live_curve
    overlay = section(text, "overlay")
    assert overlay.count("<polyline") == 2 and overlay.count("<li>") == 2
    assert "v1 (live: production): loss 6 → 4.25" in overlay and "v2: loss 4.4 → 3.5 over 4 steps" in overlay

    # Candidate (the newest) beside live, the live numbers from the candidate's own evaluation.
    side = section(text, "candidate")
    assert "candidate v2" in side and "live v1" in side and "the same held-out windows" in side
    assert re.search(r"<td>heldout.loss</td><td class='num'>3.6</td><td class='num'>4</td>"
                     r"<td class='num'>−0.4 \(−10.0%\)</td>", side), side
    assert "v2 was rolled back from production" in side and "prod regression" in side

    # The pointer history names the runs that moved it, linked.
    history = section(text, "history")
    assert _run_href("rollback_model", ROLLBACK_RUN) in history  # the person, linked to the run they started
    assert f"alice via airflow rollback_model/{ROLLBACK_RUN}</a>" in history
    assert _run_href("retrain_tiny-llama", RETRAIN_RUNS[2]) in history

    # After the page's "Roll back" the redirect lands here with the run: linked, and what it did.
    after = client.get("/retrainer/models/tiny-llama", params={"triggered": ROLLBACK_RUN}, headers=auth)
    banner = re.search(r"<p class='msg' id='triggered'>(.*?)</p>", after.text, re.S)
    assert banner, after.text
    assert _run_href("rollback_model", ROLLBACK_RUN) in banner.group(1)
    assert "moved production from <a href='/retrainer/models/tiny-llama/versions/2'>v2</a> to" in banner.group(1)
    assert "http-equiv='refresh'" not in after.text  # done: no reloading
    # A run Airflow does not know (or the caller may not see): no banner, no reloading.
    unknown = client.get("/retrainer/models/tiny-llama", params={"triggered": "manual__x"}, headers=auth)
    assert "id='triggered'" not in unknown.text and "http-equiv='refresh'" not in unknown.text

    # The version page: the numbers, every gate rule in full, the live numbers of the same evaluation.
    vpage = client.get("/retrainer/models/tiny-llama/versions/2", headers=auth).text
    assert "rolled back from production" in vpage
    assert _run_href("retrain_tiny-llama", RETRAIN_RUNS[2]) in vpage
    gate = section(vpage, "gate")
    assert gate.count("<span class='pass'>pass</span>") == 2
    assert "evaluate.gate.rules[0] (heldout.loss min vs live, tolerance 0.05 relative)" in gate
    assert "evaluate.gate.rules[1] (heldout.perplexity min, threshold 500)" in gate
    metrics = section(vpage, "metrics")
    assert "live v1 in the same evaluation" in metrics
    assert re.search(r"<td>heldout.loss</td><td class='num'>3.6</td><td class='num'>4</td>", metrics)
    assert "v2: loss 4.4 → 3.5 over 4 steps" in section(vpage, "curve")
    # What made it: the run's resolved config, summarised, the whole of it folded below.
    made = section(vpage, "config")
    p = cfg.parallel
    assert (f"<details><summary>{cfg.train.steps} steps, lr {cfg.train.lr}, layout tp {p.tp} pp {p.pp} dp {p.dp}, "
            f"{cfg.model.n_layers} layers × d_model {cfg.model.d_model}, init_from live</summary>") in made
    assert f"&quot;source_url&quot;: &quot;{cfg.data.source_url}&quot;" in made
