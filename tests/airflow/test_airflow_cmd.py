"""`retrainer airflow`: the README's Airflow instructions are the commands every standalone test runs, and the
wrapper gives airflow what those instructions promise (fast: no airflow process is started here)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tasks import REPO_ROOT
from tasks.cli.airflow_cmd import airflow_env
from tests.airflow.conftest import README_AIRFLOW_COMMANDS, RETRAINER, under_airflow_bash_blocks

README = (REPO_ROOT / "README.md").read_text()
PROGRAM = ".venv/bin/retrainer"


def test_the_readme_airflow_lines_are_what_the_standalone_fixture_runs() -> None:
    commands = [shlex.split(line, comments=True) for line in under_airflow_bash_blocks()[0].splitlines()]
    wrapped = [words[1:] for words in commands if words[:2] == [PROGRAM, "airflow"]]
    assert wrapped == README_AIRFLOW_COMMANDS
    # The fixture runs the venv's own console script, which is what `.venv/bin/retrainer` names.
    assert Path(RETRAINER).parent == Path(sys.executable).parent and Path(RETRAINER).name == "retrainer"


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A shell as the README's user has it: no Airflow or retrainer variable, venv not on PATH, cwd tmp_path."""
    for name in [k for k in os.environ if k.startswith(("AIRFLOW", "RETRAINER"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_wrapper_sets_what_the_readme_says(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = airflow_env()
    assert env["PATH"].split(":") == [sysconfig.get_path("scripts"), "/usr/bin", "/bin"]
    assert env["AIRFLOW_HOME"] == str(bare / "airflow-home")
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(REPO_ROOT / "dags")
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(REPO_ROOT / "plugins")
    assert (env["AIRFLOW__CORE__LOAD_EXAMPLES"], env["AIRFLOW__CORE__PARALLELISM"]) == ("False", "4")
    assert env["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] == "False"  # a trigger runs without an unpause
    assert "`AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False`" in README
    assert "PYTHONPATH" not in env  # run outside a checkout: the package's own
    # Where the README sends a reader for the password (what the standalone fixture reads, under AIRFLOW_HOME),
    # in the first block and in the REST lines that test_approval.py runs.
    password = Path(env["AIRFLOW_HOME"]).relative_to(bare) / "simple_auth_manager_passwords.json.generated"
    first, rest = under_airflow_bash_blocks()[:2]
    assert f"password in {password})" in first and f" {password} " in rest
    assert '"logical_date": null' in rest and "/auth/token" in rest
    assert env["RETRAINER_HOME"] == str(bare / ".retrainer")
    assert "AIRFLOW__API__BASE_URL" not in env  # Airflow's own default (port 8080) matches its default port

    # The README's other-port line: only the port is set, the base URL follows it.
    port = re.search(r"`AIRFLOW__API__PORT=(\d+) \.venv/bin/retrainer airflow standalone`", README)
    assert port is not None
    assert f"`AIRFLOW__API__BASE_URL=http://localhost:{port[1]}`" in README
    monkeypatch.setenv("AIRFLOW__API__PORT", port[1])
    assert airflow_env()["AIRFLOW__API__BASE_URL"] == f"http://localhost:{port[1]}"


def test_what_the_user_sets_wins(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = {"AIRFLOW__API__PORT": "9000", "AIRFLOW__API__BASE_URL": "https://airflow.example.internal",
            "AIRFLOW_HOME": str(bare / "elsewhere"), "AIRFLOW__CORE__DAGS_FOLDER": str(bare),
            "AIRFLOW__CORE__PARALLELISM": "32", "RETRAINER_HOME": str(bare / "state"),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True"}
    for name, value in mine.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", f"/usr/bin:{sysconfig.get_path('scripts')}")  # the venv late on PATH: moved first
    env = airflow_env()
    assert {k: env[k] for k in mine} == mine
    assert env["PATH"].split(":") == [sysconfig.get_path("scripts"), "/usr/bin"]


def test_every_argument_is_airflows() -> None:
    from tasks.cli import build_parser

    argv = ["airflow", "--help"], ["airflow", "dags", "list", "-o", "json"], ["airflow", "-v", "--", "x"]
    for args in argv:
        assert build_parser(args).parse_args(args).args == args[1:]


def test_airflow_reads_the_wrapper_settings(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the console script, as a user runs it: airflow itself sees the derived base URL and our dags."""
    monkeypatch.setenv("AIRFLOW__API__PORT", "8081")
    for (section, key), value in {("api", "base_url"): "http://localhost:8081",
                                  ("core", "dags_folder"): str(REPO_ROOT / "dags")}.items():
        done = subprocess.run([RETRAINER, "airflow", "config", "get-value", section, key], capture_output=True,
                              text=True, timeout=300)
        assert (done.returncode, done.stdout.strip()) == (0, value), done.stderr


def test_the_task_plugin_scan_warns_nothing_and_skips_the_registry_package(bare: Path) -> None:
    """What every task process does first, in an Airflow process with the wrapper's settings: scan
    plugins/ under its .airflowignore (the task SDK reads it as globs, through pathspec's deprecated
    GitWildMatchPattern). plugins/airflow_local_settings.py silences that one warning; the scan still skips
    the registry package and the settings module."""
    scan = ("import sys, airflow\n"
            "from airflow.sdk._shared.module_loading.file_discovery import find_path_from_directory\n"
            "print(sorted(find_path_from_directory(sys.argv[1], '.airflowignore')))\n")
    plugins = REPO_ROOT / "plugins"
    done = subprocess.run([sys.executable, "-c", scan, str(plugins)], env=airflow_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "GitWildMatchPattern" not in done.stdout + done.stderr, done.stderr
    assert str(plugins / "retrainer_registry_plugin.py") in done.stdout
    assert "/retrainer_registry/" not in done.stdout and "airflow_local_settings" not in done.stdout, done.stdout


def test_a_second_checkout_sharing_the_venv_serves_itself(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user with a second checkout (same venv) runs `retrainer airflow` in it: its DAGs, configs, plugins and
    code are served, not those of the checkout the venv was installed from."""
    import shutil

    other = bare / "second-checkout"
    for folder in ("dags", "plugins", "configs", "tasks"):
        shutil.copytree(REPO_ROOT / folder, other / folder, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(other)
    env = airflow_env()
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(other / "dags")
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(other / "plugins")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(other)  # its tasks/, which its DAGs import
    assert env["AIRFLOW_HOME"] == str(other / "airflow-home") and env["RETRAINER_HOME"] == str(other / ".retrainer")
    # The DAG files find their configs next to themselves: the second checkout's.
    done = subprocess.run([sys.executable, "-c", "import retrain; print(retrain.CONFIG_DIR)"], env={
        **env, "PYTHONPATH": os.pathsep.join([env["AIRFLOW__CORE__DAGS_FOLDER"], env["AIRFLOW__CORE__PLUGINS_FOLDER"],
                                              env["PYTHONPATH"]])},
        capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, str(other / "configs")), done.stderr
