"""`retrainer airflow ARGS...`: this venv's `airflow ARGS...` with the settings this project's DAGs need.

Two things make a bare `.venv/bin/airflow standalone` fail: standalone starts its components as
`airflow ...` looked up on PATH (not next to itself), and every task reaches the execution API at
`AIRFLOW__API__BASE_URL` (default http://localhost:8080), so a changed `AIRFLOW__API__PORT` alone leaves
every task unable to report. The wrapper puts this venv's bin first on PATH, derives the base URL from
the port, points Airflow at the checkout's dags/ and plugins/ (the one it is run in, so a second checkout
sharing a venv serves its own DAGs, configs and code, else the one the package was installed from),
creates DAGs unpaused (a trigger of a paused DAG queues forever) and fills the README's defaults; each
setting applies only where the environment does not already set it. It execs the airflow binary:
tasks/ never imports airflow.
"""

from __future__ import annotations

import argparse
import logging
import os
import sysconfig
from pathlib import Path

from tasks import REPO_ROOT
from tasks.base.errors import RetrainerError

log = logging.getLogger(__name__)


def served_checkout(cwd: Path) -> Path:
    """The checkout whose DAGs, plugins and configs `retrainer airflow` serves: `cwd` when it is a retrainer
    checkout (its own dags/retrain.py and plugins/retrainer_airflow/), else the package's own."""
    here = cwd.resolve()
    if (here / "dags" / "retrain.py").is_file() and (here / "plugins" / "retrainer_airflow").is_dir():
        return here
    return REPO_ROOT


def airflow_env() -> dict[str, str]:
    """The environment `retrainer airflow` runs airflow in: this one plus the project's defaults."""
    from tasks.base.home import retrainer_home

    env = dict(os.environ)
    bin_dir = sysconfig.get_path("scripts")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    env["PATH"] = os.pathsep.join([bin_dir, *path])  # first: standalone's components are this venv's airflow
    checkout = served_checkout(Path.cwd())
    if checkout != REPO_ROOT:  # its tasks/ too, not the package's (the DAGs and plugins import it)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    defaults = {
        "AIRFLOW_HOME": str(Path.cwd() / "airflow-home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(checkout / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(checkout / "plugins"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "RETRAINER_HOME": str(retrainer_home()),
    }
    if env.get("AIRFLOW__API__PORT"):  # tasks reach the execution API through the base URL, not the port
        defaults["AIRFLOW__API__BASE_URL"] = f"http://localhost:{env['AIRFLOW__API__PORT']}"
    for key, value in defaults.items():
        if env.get(key):
            continue
        if key.endswith("_FOLDER") and not Path(value).is_dir():  # an install without the checkout's folders
            raise RetrainerError(f"{key}: no {value} (run from a checkout set up with scripts/setup.sh, or set it)")
        env[key] = value
    return env


def _cmd_airflow(args: argparse.Namespace) -> int:
    binary = Path(sysconfig.get_path("scripts")) / "airflow"
    if not binary.is_file():
        raise RetrainerError(f"no airflow in {binary.parent} (run bash scripts/setup.sh)")
    env = airflow_env()
    log.debug("exec %s %s (AIRFLOW_HOME=%s)", binary, " ".join(args.args), env["AIRFLOW_HOME"])
    os.execve(binary, [str(binary), *args.args], env)  # replaces this process: airflow's exit code is ours


def register(sub: argparse._SubParsersAction) -> None:
    # No option of our own (prefix_chars that never match): every argument, `--help` included, is airflow's.
    p = sub.add_parser("airflow", add_help=False, prefix_chars="\0",
                       help="run this venv's airflow with the project's dags/plugins and the README's settings")
    p.add_argument("args", nargs=argparse.REMAINDER, help="airflow's own arguments, e.g. standalone")
    p.set_defaults(handler=_cmd_airflow)
