#!/usr/bin/env bash
# Create .venv and install retrainer with its pinned dependencies (idempotent: skips when
# pyproject.toml has not changed since the last successful install).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
echo "setup: creating .venv and installing dependencies (first time: a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
if ! { .venv/bin/pip install --upgrade pip && .venv/bin/pip install -e ".[test]"; } >"$log" 2>&1; then
  grep -v "^WARNING: Location" "$log" | tail -40 >&2
  echo "setup: pip install failed (full log: $log)" >&2
  exit 1
fi
# DeepSpeed's CPU shared-memory op, built once into this venv's extension cache (the ranks' default
# TORCH_EXTENSIONS_DIR, tasks/launch/torchrun.py) instead of on the first training (about a minute).
if ! .venv/bin/python -m tasks.launch.torchrun --prebuild >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "setup: building DeepSpeed's CPU op failed (full log: $log)" >&2
  exit 1
fi
rm -f "$log" .venv/.installed-*
touch "$stamp"
echo "setup: done" >&2
