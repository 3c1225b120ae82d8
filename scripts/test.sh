#!/usr/bin/env bash
# The second README command: set up (Python deps + the system packages the tests drive), then lint
# and run the whole test suite. Tests start their own services (PostgreSQL cluster, S3 server, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
# The system packages (apt: the network and the disk) install while setup installs the Python packages and builds
# DeepSpeed's op (the cores): on a fresh machine the two overlap instead of adding up.
bash scripts/system-deps.sh &
system_deps=$!
bash scripts/setup.sh || { wait "$system_deps" || true; exit 1; }  # a failed setup leaves no apt half-run behind
wait "$system_deps"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check .
.venv/bin/lint-imports  # the package layers in pyproject.toml [tool.importlinter]: a new upward import or cycle fails
# Three workers on two cores (RETRAINER_TEST_WORKERS): a test file, or all the modules of the shared Airflow
# standalone, to one worker at a time (tests/conftest.py); the standalone's tests mostly wait on its scheduler (with
# two workers the cores were 76% busy on average), the other two workers use the cores.
# In collection order: the standalone's unit, the longest, is handed out within the first minute (tests/airflow).
exec .venv/bin/pytest -n "${RETRAINER_TEST_WORKERS:-3}" --dist loadscope --no-loadscope-reorder --durations=15 "$@"
