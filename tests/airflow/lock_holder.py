"""A stand-in for a training run, as its own OS process: take the experiment lock, "train", exit.

Used by test_lock.py to race real processes for tasks.base.lock.experiment_lock. Once the
go file exists it tries the lock; on success it writes `<name>.trained` and holds the
lock until the release file appears (or it is killed); on refusal it writes the
error to `<name>.refused` and exits 3.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tasks.base.errors import LockHeldError
from tasks.base.lock import experiment_lock


def main(registry_url: str, key: str, workdir: str, name: str) -> int:
    work = Path(workdir)
    while not (work / "go").exists():
        time.sleep(0.01)
    try:
        with experiment_lock(registry_url, key, holder=f"holder-{name}"):
            (work / f"{name}.trained").write_text("ok")
            while not (work / "release").exists():
                time.sleep(0.02)
    except LockHeldError as exc:
        (work / f"{name}.refused").write_text(str(exc))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
