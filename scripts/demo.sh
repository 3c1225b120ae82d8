#!/usr/bin/env bash
# The first README command: set up, then run the whole lifecycle end to end on the embedded default
# (SQLite registry, a local folder as object store, CPU training with gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RETRAINER_HOME=${RETRAINER_HOME:-$PWD/.retrainer}
exec .venv/bin/retrainer demo "$@"
