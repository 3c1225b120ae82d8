"""Every rank program's first step: `python -m tasks.train.start MODULE ARGS...` runs MODULE as `__main__` after
the ranks' quiet start-up (tasks/train/rank.py `quiet_start_up`).

Why a step of its own: the workers import DeepSpeed at module level (their pipeline, checkpoint and reshard
modules subclass or call it), so anything that must hold while DeepSpeed is imported (the accelerator named,
MLflow hidden from its autotuner) has to run before the worker module is imported, not in its `main`.

On a node without GPUs `tasks.base.spawn` calls `preload` once and forks every rank from itself, each of which
then runs `main` with all of it already imported.
"""

from __future__ import annotations

import importlib
import runpy
import sys

from tasks.train.rank import quiet_start_up


def preload(args: list[str]) -> None:
    """What every rank running `MODULE ARGS` (`args`) imports, done before they are forked: the quiet start-up and
    MODULE (as a module: its `__main__` part runs in each rank). MODULE's top-level code thus also runs once in the
    spawner: a rank program keeps its side effects (patches, files, threads) under `if __name__ == "__main__"`."""
    quiet_start_up()
    importlib.import_module(args[0])


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tasks.train.start MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    quiet_start_up()
    sys.modules.pop(module, None)  # preloaded in a forked rank: `__main__` beside no copy of itself, as otherwise
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
