#!/usr/bin/env bash
# `bash scripts/setup.sh` from a clean clone of this checkout (HEAD, or the revision given: `bash
# bench/setup_time.sh <rev>` times an older setup the same way) into a fresh venv, timed (BENCHMARKS.md,
# Install). Cold by default: an empty uv cache and no pip cache, as on a fresh machine; UV_CACHE_DIR=<a cache
# an earlier setup filled> times a warm one. `--demo` first: the README's first command instead (`bash
# scripts/demo.sh`: setup, then the whole demo lifecycle), as a new user runs it. The load average is printed before
# and after: on a shared box the wall time follows it, the CPU seconds much less.
set -euo pipefail
command=scripts/setup.sh
if [ "${1:-}" = "--demo" ]; then
  command=scripts/demo.sh
  shift
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q "$repo" "$tmp/retrainer"
cd "$tmp/retrainer"
git checkout -q "${1:-HEAD}"
uptime
/usr/bin/time -f "$command: %e s wall, %U s user + %S s sys CPU" \
  env UV_CACHE_DIR="${UV_CACHE_DIR:-$tmp/uv-cache}" PIP_NO_CACHE_DIR=1 RETRAINER_HOME="$tmp/home" bash "$command" \
  | tail -3
uptime
