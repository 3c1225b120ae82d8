#!/usr/bin/env bash
# Resolve every dependency of retrainer (all extras) into constraints.txt, the lock scripts/setup.sh installs
# exactly. A dependency update is one command (then commit constraints.txt):
#   bash scripts/lock.sh --upgrade                    # everything to the newest versions pyproject.toml allows
#   bash scripts/lock.sh --upgrade-package deepspeed  # only that package (and what it needs) moves
#   bash scripts/lock.sh                              # after editing pyproject.toml: every other pin stays
# Universal: one file for every platform and Python that pyproject.toml admits (markers say which lines apply).
# Airflow's published constraints (raw.githubusercontent.com) are not reachable from every build machine, so the
# resolution is our own, from the package index; apache-airflow itself is pinned in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # uv: on PATH, else the one setup installs into .venv
UV=$(command -v uv || echo .venv/bin/uv)
"$UV" pip compile pyproject.toml --all-extras --universal --python-version 3.11 "$@" \
  --custom-compile-command "bash scripts/lock.sh" -o constraints.txt
