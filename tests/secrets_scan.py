"""Where a secret could be read by someone on a node: files, every process's command line, rank environments."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path


def files_containing(roots: Iterable[Path], values: Iterable[str]) -> list[str]:
    """Every file under `roots` whose bytes contain one of `values` (as `path: value`)."""
    needles = [v.encode() for v in values]
    hits = []
    for root in roots:
        for path in (root.rglob("*") if root.is_dir() else []):
            try:
                data = path.read_bytes() if path.is_file() else b""
            except OSError:  # a file the run replaced while we read: it was read next round
                continue
            hits += [f"{path}: {n.decode()}" for n in needles if n in data]
    return hits


def argv_containing(values: Iterable[str], namespaces: Iterable[str] = ()) -> list[str]:
    """`ps -eo args` lines (here, and inside each network namespace: every "node") holding one of `values`."""
    tables = [subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout]
    tables += [subprocess.run(["ip", "netns", "exec", ns, "ps", "-eo", "args"], capture_output=True, text=True,
                              check=True).stdout for ns in namespaces]
    values = list(values)
    return [line for table in tables for line in table.splitlines() if any(v in line for v in values)]


def environments_containing(pids: Iterable[int], values: Iterable[str]) -> list[int]:
    """Processes whose environment holds one of `values`."""
    needles = [v.encode() for v in values]
    hits = []
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(n in env for n in needles):
            hits.append(pid)
    return hits
