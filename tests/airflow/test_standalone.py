"""The package's real `airflow standalone` (parallelism 4): retraining on data arrival, rollback, the registry page.

Through the REST API, under the real scheduler: bad Params are refused with HTTP 400 naming the
field; a manual run publishes v1; the `publish_dataset` producer writes a new snapshot and its Asset
event starts a retrain that warms and trains on exactly that snapshot, from v1 (v2's lineage names
the URL); `rollback_model` moves the alias back; the same snapshot announced again through
`POST /api/v2/assets/events` is v2 again, refused at plan by the gate's rule (nothing evaluated). Every
record names the person behind it: the manual run's version and the REST rollback name the user who
triggered them, the data-triggered version only its run.
Then the plugin's registry page: refused without a token, lists the versions with one; a second Roll back
(v2 was rolled back, v1 was the first) is refused by its run, which the page follows until it ends; in a
headless Chromium a person forces v2 back with a reason and the page reloads itself until the alias
moved, and a screenshot of it is not blank. The tests run in file order on this module's model.
"""

from __future__ import annotations

import json
import time
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from tests.airflow.browser import browser, chromium_binary, pixel_stats, screenshot, section
from tests.airflow.conftest import LINEAGE_EVENTS, Standalone, Tenant
from tests.services import free_port, require

MODEL, ALIAS = "plain-llama", "production"
RETRAIN = f"retrain_{MODEL}"
ROLLBACK = "rollback_model"
PRODUCER = "publish_dataset"

pytestmark = pytest.mark.multiproc

TENANT = Tenant(models={MODEL: None}, dag_ids=(RETRAIN, ROLLBACK, PRODUCER))


def ol_name(location: str) -> tuple[str, str]:
    """(namespace, name) of the OpenLineage dataset Airflow's file-asset converter makes of a local path or URL."""
    return "file", urlsplit(location).path if "://" in location else location


def lineage_event(sa: Standalone, job: str, output_url: str, timeout_s: float = 120) -> dict:
    """The COMPLETE event of OpenLineage job `job` whose outputs name `output_url` (a local store's artifact), from
    the standalone's event file: polled, since the listener writes it as the task ends."""
    path, want = sa.home / LINEAGE_EVENTS, ol_name(output_url)
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        for event in map(json.loads, lines):
            if event.get("eventType") == "COMPLETE" and event["job"]["name"] == job and want in {
                    (d["namespace"], d["name"]) for d in event.get("outputs", [])}:
                return event
        if time.monotonic() > deadline:
            raise AssertionError(f"no COMPLETE event of {job} with output {want} in {len(lines)} events:\n"
                                 + "\n".join(line[:300] for line in lines[-5:]))
        time.sleep(0.5)


def _registry(sa: Standalone):
    from tasks.models.resolve import load_config
    from tasks.registry import Registry

    return Registry(load_config(sa.config_path(MODEL)).publish.registry_url)


def test_page_and_api_refuse_anonymous_callers(standalone: Standalone) -> None:
    with standalone.client(authenticated=False) as anon:
        for path in ("/retrainer/", "/retrainer/api/models", f"/retrainer/models/{MODEL}"):
            assert anon.get(path).status_code in (401, 403), path
        assert anon.post(f"/retrainer/models/{MODEL}/rollback", data={"alias": ALIAS}).status_code in (401, 403)
        assert anon.post(f"/api/v2/dags/{RETRAIN}/dagRuns", json={"logical_date": None}).status_code in (401, 403)
    with standalone.client() as c, c.stream("GET", "/retrainer/", headers={"Authorization": "Bearer forged"}) as r:
        assert r.status_code in (401, 403)


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"steps": 0}, "steps"),                  # below minimum
        ({"steps": "many"}, "steps"),             # wrong type
        ({"dp": 100000}, "dp"),                   # above maximum
        ({"alias": "../prod"}, "alias"),          # pattern
        ({"dry_run": "yes"}, "dry_run"),          # wrong type
    ],
)
def test_rest_rejects_bad_params_naming_the_field(standalone: Standalone, conf: dict, field: str) -> None:
    resp = standalone.trigger(RETRAIN, conf)
    assert resp.status_code == 400, resp.text
    assert field in resp.text


def test_rest_rejects_unknown_rollback_model(standalone: Standalone) -> None:
    resp = standalone.trigger(ROLLBACK, {"model": "no-such-model"})
    assert resp.status_code == 400, resp.text
    assert "model" in resp.text


def test_data_arrival_retrains_on_the_snapshot_and_a_rollback_is_respected(standalone: Standalone) -> None:
    with standalone.client() as c:  # `retrainer airflow` created them unpaused: no step of the README's unpauses
        assert not any(c.get(f"/api/v2/dags/{d}").raise_for_status().json()["is_paused"]
                       for d in (RETRAIN, ROLLBACK, PRODUCER))
    registry = _registry(standalone)

    # Week 1, a manual run: nothing live yet, v1 from scratch.
    resp = standalone.trigger(RETRAIN, {})
    assert resp.status_code == 200, resp.text
    first = resp.json()["dag_run_id"]
    assert standalone.wait_run(RETRAIN, first)["state"] == "success", standalone.task_states(RETRAIN, first)
    v1 = registry.live_version(MODEL, ALIAS)
    assert v1.version == 1 and v1.created_by == f"admin via airflow {RETRAIN}/{first}"  # admin triggered it
    # The task logs a person reads: no deprecation or DeepSpeed start-up noise, ranks' lines relayed once.
    plan_log, train_log = (standalone.task_log(RETRAIN, first, t) for t in ("plan", "train"))
    assert "GitWildMatchPattern" not in plan_log + train_log and "Using topology" not in train_log, train_log[-3000:]
    assert "[rank 0] tasks.train.worker: engine ready" in train_log, train_log[-3000:]
    assert "INFO [rank" not in train_log, train_log[-3000:]  # the rank's level became the line's, not its text

    # Week 2: the producer writes a snapshot and announces it; the scheduler starts a retrain on it.
    known = standalone.run_ids(RETRAIN)
    resp = standalone.trigger(PRODUCER, {"job": MODEL, "seed": 2})
    assert resp.status_code == 200, resp.text
    assert standalone.wait_run(PRODUCER, resp.json()["dag_run_id"])["state"] == "success"
    arrived = standalone.next_run(RETRAIN, known)
    assert standalone.wait_run(RETRAIN, arrived)["state"] == "success", standalone.task_states(RETRAIN, arrived)
    v2 = registry.live_version(MODEL, ALIAS)
    snapshot = v2.data_url
    assert v2.version == 2 and v2.parent_version == 1
    assert v2.created_by == f"airflow {RETRAIN}/{arrived}"  # the data started it: no person to name
    assert snapshot.startswith(str(standalone.model_home(MODEL) / "store" / "data") + "-snapshots/")
    assert f"data arrived at {snapshot}" in standalone.task_log(RETRAIN, arrived, "plan")
    # What the lineage backend draws (README: Lineage): the publish's OpenLineage event takes the snapshot and the
    # version it started from in, and gives v2 out.
    event = lineage_event(standalone, f"{RETRAIN}.publish", v2.artifact_url)
    assert {ol_name(snapshot), ol_name(v1.artifact_url)} == {(d["namespace"], d["name"]) for d in event["inputs"]}
    assert event["run"]["facets"]["airflow"]["dagRun"]["run_id"] == arrived

    resp = standalone.trigger(ROLLBACK, {"model": MODEL, "reason": "standalone test"})
    assert resp.status_code == 200, resp.text
    rolled = resp.json()["dag_run_id"]
    assert standalone.wait_run(ROLLBACK, rolled)["state"] == "success"
    assert registry.live_version(MODEL, ALIAS).version == 1
    last = registry.history(MODEL, ALIAS)[-1]
    assert (last.action, last.from_version, last.to_version, last.reason) == ("rollback", 2, 1, "standalone test")
    assert last.actor == f"admin via airflow {ROLLBACK}/{rolled}"  # the person who triggered it over REST

    # The same snapshot announced again from outside Airflow: that run is v2 again, which was rolled back.
    known = standalone.run_ids(RETRAIN)
    with standalone.client() as c:
        # The README's lookup: by pattern, since Airflow stores the URI as retrainer-data://<model>/.
        assets = c.get("/api/v2/assets", params={"uri_pattern": f"retrainer-data://{MODEL}"}).raise_for_status()
        [asset] = assets.json()["assets"]
        assert asset["uri"] == f"retrainer-data://{MODEL}/"
        asset_id = asset["id"]
        c.post("/api/v2/assets/events", json={"asset_id": asset_id, "extra": {"source_url": snapshot}}
               ).raise_for_status()
    again = standalone.next_run(RETRAIN, known)
    assert standalone.wait_run(RETRAIN, again)["state"] == "success"
    states = standalone.task_states(RETRAIN, again)  # refused at plan: its result is v2, nothing evaluated
    assert {t: states[t] for t in ("train", "evaluate", "gate", "publish")} == dict.fromkeys(
        ("train", "evaluate", "gate", "publish"), "skipped"), states
    assert "rolled back from production" in standalone.task_log(RETRAIN, again, "new_data")
    assert registry.live_version(MODEL, ALIAS).version == 1
    assert [v.version for v in registry.list_versions(MODEL)] == [1, 2]


def test_registry_page_lists_versions_and_its_button_triggers_rollback(standalone: Standalone) -> None:
    with standalone.client() as c:
        models = c.get("/retrainer/api/models").raise_for_status().json()  # the other modules' models besides
        assert [m for m in models if m["model"] == MODEL] == [{"model": MODEL, "versions": 2, "aliases": {ALIAS: 1}}]
        detail = c.get(f"/retrainer/api/models/{MODEL}").raise_for_status().json()
        assert [v["version"] for v in detail["versions"]] == [1, 2]
        assert [len(v["train_losses"]) for v in detail["versions"]] == [4, 4]
        assert [v["parent_version"] for v in detail["versions"]] == [None, 1]
        assert [h["to_version"] for h in detail["history"]] == [1, 2, 1]

        index = c.get("/retrainer/")
        assert index.status_code == 200 and MODEL in index.text
        page = c.get(f"/retrainer/models/{MODEL}")
        assert page.status_code == 200
        for text in ("v1", "v2", "Pointer history", "rollback", "<polyline", "Roll back", "standalone test",
                     "from <a", "rolled back from production", "candidate v2", "live v1"):
            assert text in page.text, text
        assert "v1 (live: production)" in section(page.text, "live-curve")  # the live one, not the newest
        assert section(page.text, "overlay").count("<polyline") == 2
        # Each version links to the Airflow run that made it: a run Airflow knows.
        for v in detail["versions"]:
            run_id = v["created_by"].partition(f"airflow {RETRAIN}/")[2]
            assert c.get(f"/api/v2/dags/{RETRAIN}/dagRuns/{run_id}").status_code == 200, v["created_by"]
            assert f"href='/dags/{RETRAIN}/runs/{quote(run_id, safe='')}' target='_top'" in page.text
        version_page = c.get(f"/retrainer/models/{MODEL}/versions/2")
        assert version_page.status_code == 200 and "<polyline" in version_page.text
        assert c.get(f"/retrainer/models/{MODEL}/versions/99").status_code == 404
        assert c.get("/retrainer/models/no-such-model").status_code == 404

        # v2 was rolled back and v1 was the first: the button has no target of its own, says why, offers force.
        form = section(page.text, "aliases")
        assert "Roll back to the version given" in form and "name='force'" in form
        assert f"v2 by admin via airflow {ROLLBACK}/" in form

        # A second Roll back, as a browser posts the form with no version: its run refuses, nothing moves.
        resp = c.post(f"/retrainer/models/{MODEL}/rollback", headers={"Accept": "text/html"},
                      data={"alias": ALIAS, "to_version": "", "reason": "again"})
        assert resp.status_code == 303, resp.text
        assert "#" not in resp.headers["location"]
        run_id = parse_qs(urlsplit(resp.headers["location"]).query)["triggered"][0]
        assert c.get(f"/api/v2/dags/{ROLLBACK}/dagRuns/{run_id}").json()["conf"] == {
            "model": MODEL, "alias": ALIAS, "to_version": None, "reason": "again", "force": False}
        bad = c.post(f"/retrainer/models/{MODEL}/rollback", data={"alias": ALIAS, "to_version": "x"})
        assert bad.status_code == 400 and "to_version" in bad.text
        # The page it lands on links the run and reloads itself (the page, no #fragment) until the run ends.
        reload = (f"<meta http-equiv='refresh' content='2;url=/retrainer/models/{MODEL}?triggered="
                  f"{quote(run_id, safe='')}'>")
        deadline = time.monotonic() + 300
        while True:
            after = c.get(resp.headers["location"])
            assert f"href='/dags/{ROLLBACK}/runs/{quote(run_id, safe='')}' target='_top'" in after.text
            if "without moving an alias" in after.text or time.monotonic() > deadline:
                break
            assert reload in after.text, after.text  # pending: the page comes back by itself
            time.sleep(1)
    assert "failed without moving an alias: rollback: " in after.text, after.text
    assert "every version live on it before version 1 was rolled back from it" in after.text
    assert "http-equiv='refresh'" not in after.text
    assert standalone.wait_run(ROLLBACK, run_id)["state"] == "failed"
    assert _registry(standalone).live_version(MODEL, ALIAS).version == 1


def test_plugin_is_registered_as_a_ui_view(standalone: Standalone) -> None:
    with standalone.client() as c:
        plugins = c.get("/api/v2/plugins").raise_for_status().json()["plugins"]
    ours = [p for p in plugins if p["name"] == "retrainer_registry"]
    assert ours, plugins
    assert ours[0]["fastapi_apps"][0]["url_prefix"] == "/retrainer"
    assert ours[0]["external_views"][0]["href"] == "retrainer/"


def test_a_person_forces_v2_back_in_a_browser_and_the_page_follows_until_the_alias_moved(
        standalone: Standalone) -> None:
    binary = chromium_binary()
    require(binary is not None, "chromium (apt chromium) for the registry page in a browser")
    url = f"{standalone.base_url}/retrainer/models/{MODEL}"
    with browser(url, standalone.token, free_port(), binary) as page:
        page.open(url)
        before = page.loads
        form = f"document.getElementById('rollback-{ALIAS}')"
        page.eval(f"{form}.to_version.value = '2'; {form}.force.checked = true; "
                  f"{form}.reason.value = 'v2 retested fine'; {form}.querySelector('button').click()")
        page.wait_for("location.search.includes('triggered=') && document.readyState === 'complete'", 60)
        page.cdp.wait_event("Page.loadEventFired", after=before)  # the page the form's answer redirected to
        landed = page.loads
        banner = page.eval("document.getElementById('triggered').innerText")
        assert "this page reloads until it finishes" in banner, banner  # the run is pending
        # The test never reloads: the page does, until the run has moved the alias.
        page.wait_for("document.body.innerText.includes('it moved production')", 300)
        # That text is in a document the page loaded by itself: its load event comes (the text may be read first).
        page.cdp.wait_event("Page.loadEventFired", after=landed)
        assert "#" not in page.eval("location.href")
        assert "from v1 to v2" in page.eval("document.getElementById('triggered').innerText")
    registry = _registry(standalone)
    assert registry.live_version(MODEL, ALIAS).version == 2
    last = registry.history(MODEL, ALIAS)[-1]
    assert (last.action, last.from_version, last.to_version) == ("rollback", 1, 2)
    assert last.actor.startswith(f"admin via airflow {ROLLBACK}/")
    assert last.reason.startswith(f"v2 retested fine [forced: v2 had been rolled back from production by admin via "
                                  f"airflow {ROLLBACK}/")


def test_headless_chromium_screenshot_of_the_registry_page_is_not_blank(standalone: Standalone) -> None:
    binary = chromium_binary()
    require(binary is not None, "chromium (apt chromium) for the registry page screenshot")
    png, title = screenshot(f"{standalone.base_url}/retrainer/models/{MODEL}", standalone.token, free_port(), binary)
    (standalone.home / "registry-page.png").write_bytes(png)
    assert MODEL in title, title  # the registry page itself, not a login or error page
    colours, variance = pixel_stats(png)
    assert colours > 10 and variance > 50, (colours, variance)
