#!/usr/bin/env bash
# Create .venv and install retrainer with exactly the versions in constraints.txt, the lock of every dependency
# (`bash scripts/lock.sh` updates it). Idempotent: skips when pyproject.toml, constraints.txt and this script have
# not changed since the last successful install.
#
# uv installs (seconds where pip takes minutes); pip only where uv cannot run. uv is told where pip finds local
# wheels (pip's find-links): where the machine keeps a CPU build of the locked torch there, both take it (a local
# build, 2.13.0+cpu, satisfies torch==2.13.0) instead of the index's multi-GB CUDA build; elsewhere both take
# the locked version from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
UV_VERSION=0.13.9  # the uv that setup installs where none is on PATH
stamp=.venv/.installed-$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
# Our own modules' bytecode, on every setup (up-to-date files are skipped): uv compiles what it installs, not an
# editable project, and where PYTHONDONTWRITEBYTECODE is set (this one's CI) every rank, task and CLI process would
# compile them from source again (~0.3 s of CPU each). A stale .pyc is never used: Python checks the source's mtime.
compile_ours() { .venv/bin/python -m compileall -q -j 0 tasks plugins dags tests >/dev/null; }
if [ -f "$stamp" ]; then compile_ours; exit 0; fi
echo "setup: creating .venv and installing the locked dependencies (first time: a minute or two)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=$(mktemp)
fail() {
  grep -v "^WARNING: Location" "$log" | tail -40 >&2
  echo "setup: $1 (full log: $log)" >&2
  exit 1
}
# uv: on PATH, else installed into .venv with pip; none where neither works (then pip installs everything).
uv=$(command -v uv || true)
if [ -z "$uv" ] && { [ -x .venv/bin/uv ] || .venv/bin/pip install "uv==$UV_VERSION" >"$log" 2>&1; }; then
  uv=.venv/bin/uv
fi
if [ -n "$uv" ] && ! "$uv" --version >/dev/null 2>&1; then
  uv=""
fi
started=$SECONDS
if [ -n "$uv" ]; then
  links=$(.venv/bin/pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | head -1)
  links=$(echo "$links" | xargs | tr ' ' ',')  # pip separates them by spaces, uv by commas
  # --compile-bytecode: pip writes every module's .pyc at install, uv only when asked. Without them a machine with
  # PYTHONDONTWRITEBYTECODE set (this one's CI does) compiles torch and DeepSpeed from source in every process: a
  # rank's start and first step took seconds longer, and the test suite about half again as long.
  UV_FIND_LINKS=${UV_FIND_LINKS:-$links} "$uv" pip install --python .venv/bin/python -c constraints.txt \
    --compile-bytecode -e ".[test]" >"$log" 2>&1 || fail "uv pip install failed"
else
  echo "setup: uv cannot run here; installing with pip (slower)" >&2
  .venv/bin/pip install -c constraints.txt -e ".[test]" >"$log" 2>&1 || fail "pip install failed"
fi
echo "setup: dependencies installed with $([ -n "$uv" ] && echo uv || echo pip) ($((SECONDS - started)) s)" >&2
started=$SECONDS
# DeepSpeed's CPU shared-memory op, built once into this venv's extension cache (the ranks' default
# TORCH_EXTENSIONS_DIR, tasks/launch/torchrun.py) instead of on the first training (about a minute).
if ! .venv/bin/python -m tasks.launch.torchrun --prebuild >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "setup: building DeepSpeed's CPU op failed (full log: $log)" >&2
  exit 1
fi
echo "setup: DeepSpeed's CPU op built ($((SECONDS - started)) s)" >&2
compile_ours
rm -f "$log" .venv/.installed-*
touch "$stamp"
echo "setup: done" >&2
