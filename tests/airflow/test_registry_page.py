"""The registry page inside Airflow's own API app (in-process, real auth manager, real registry DBs).

Fast checks the standalone test does not make: hostile names are escaped, the loss curve
comes from the version's metrics or from the run's summary.json, an unreadable registry is
reported (password hidden), and the rollback button refuses cross-site cookie posts.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from tests.airflow.conftest import ROOT

HOSTILE = "<script>alert('x')</script>"


@pytest.fixture(scope="module")
def airflow_app(airflow_db: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from airflow.api_fastapi.app import create_app
        from fastapi.testclient import TestClient

        client = TestClient(create_app())
    password = json.loads((Path(airflow_db) / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    resp = client.post("/auth/token", json={"username": "admin", "password": password})
    assert resp.status_code in (200, 201), resp.text
    return client, resp.json()["access_token"]


def _publish(registry_url: str, tmp_path: Path, model: str, n: int, metrics_for) -> None:
    from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

    upgrade(registry_url)
    store = ArtifactStore(str(tmp_path / "models"))
    with Registry(registry_url) as reg:
        for i in range(1, n + 1):
            blob = tmp_path / f"weights-{i}.pt"
            blob.write_bytes(f"weights {model} {i}".encode())
            replay = [{"url": f"s3://b/{HOSTILE}", "manifest_hash": "a" * 64, "weight": 0.05}] if i == 2 else []
            lineage = Lineage(config_hash=f"{i:064x}", data_manifest_hash="d" * 64, code_revision="rev",
                              checkpoint_tag=f"step-{i:06d}", data_replay=replay)
            reg.publish_version(model, store.put(blob), lineage, metrics_for(i), created_by=HOSTILE)
            reg.switch_alias(model, "production", i, actor=HOSTILE, reason=f"because {HOSTILE}", action="publish")


def _config(tmp_path: Path, model: str, registry_url: str) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["publish"].update(model_name=model, registry_url=registry_url)
    cfg["train"]["output_dir"] = str(tmp_path / "runs")
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
    # Each suite metric, and each gate rule's result as it was recorded with the version.
    assert "frozen.loss: 2.125" in v2.text and "gate pass: evaluate.gate.rules[0] &lt;script&gt;" in v2.text
    assert "gate FAIL: evaluate.gate.rules[1] (new.loss min)" in v2.text


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
