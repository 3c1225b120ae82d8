#!/usr/bin/env bash
# System packages the tests drive for real (PostgreSQL server binaries, sshd + pdsh for multi-node
# launches over SSH between network namespaces, a single-node Slurm with munge, iproute2 for `ip netns`,
# procps for process-table checks). Installs only what is missing; needs root (or sudo) and apt.
set -euo pipefail
need=()
command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
# Multi-node launcher tests (tests/launch).
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || need+=(iproute2)
command -v ps >/dev/null 2>&1 || need+=(procps)
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
# The README's REST example, which tests/airflow/test_approval.py runs as written.
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v jq >/dev/null 2>&1 || need+=(jq)
# Headless browser for the registry page screenshot (tests/airflow).
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "system-deps: installing ${need[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
