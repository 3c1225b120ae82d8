"""Fault injection for the tests, kept out of the product (tasks/ has no hooks).

Each hook is switched on by a `HOOK_*` environment variable that only this package reads:
- `HOOK_STEP_DELAY_S=S`: every rank sleeps S seconds after each step (time to kill or hang a run);
- `HOOK_STEP_DELAY_DIR=D`: instead, every rank sleeps the seconds written in `D/<model name>` (none: 0), read
  again while it sleeps: per model and changeable mid-run (one standalone training several models; a long
  delay holds a job until the test lowers it);
- `HOOK_NAN_AT_STEP=N`: the loss of step N is NaN;
- `HOOK_CKPT_DELAY=STEP:S`: rank 0 pauses S seconds inside the commit of step STEP's checkpoint (its files
  written, not committed);
- `HOOK_CKPT_WRITE_DELAY=STEP:S`: every rank's background save writes each file of step STEP's checkpoint
  S seconds late (training goes on meanwhile);
- `HOOK_CKPT_WRITE_ERROR=STEP:RANK`: that rank's background write of step STEP's checkpoint fails (ENOSPC);
- `HOOK_SAMPLE_LOG=PATH`: each rank appends, per step, the window indices of each of its micro-batches to
  PATH.rank<RANK> (JSON lines: step, dp_rank, dp, micro_batches);
- `HOOK_REWORD_LOGS=1`: every worker log line is reworded (supervision must not depend on log text);
- `HOOK_OPTIMIZER_PARAMS=DIR`: every rank records which parameters its engine's optimizer holds (tests/hooks/
  optimizer.py);
- `HOOK_BAD_TOKEN_AT=STEP:RANK`: that training rank's input of step STEP holds a token id past the vocabulary
  (its embedding raises IndexError: a rank dying of an exception nobody anticipated);
- `HOOK_EVAL_DELAY_S=S`: every evaluation rank sleeps before each of its batches;
- `HOOK_EVAL_BAD_TOKEN_RANK=RANK`: that evaluation rank's first batch holds a token id past the vocabulary;
- `HOOK_PUBLISH_BLOCK=after_version_insert`: publish blocks after inserting the version, until the file
  `HOOK_PUBLISH_RELEASE` exists (or forever);
- `HOOK_AUDIT_OPENS=FILE`: the launcher-side process appends the path of every `.safetensors` file it opens
  to read through Python's `open` (uploads, copies) to FILE (an audit hook; an `os.open` for fsync is not a
  read, and safetensors' own reader is native code: see what the test asserts besides).

`install()` (launcher side: the fault driver, `python -m tests.hooks.cli`, or a test through `hooked`)
makes torchrun start `tests.hooks.worker` (`tests.hooks.eval_worker`) instead of the product's training
(evaluation) worker and forwards the `HOOK_*` variables to the ranks; those patch the rank-side hooks in and
run the product's worker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("tests.hooks")

PREFIX = "HOOK_"
WORKER = "tests.hooks.worker"
EVAL_WORKER = "tests.hooks.eval_worker"


def set_step_delay(delays: Path, model: str, seconds: float) -> None:
    """`HOOK_STEP_DELAY_DIR`'s pause for `model`, from the ranks' next read on: replaced whole, so a rank reading it
    mid-write never meets an empty file."""
    staged = delays / f".{model}"
    staged.write_text(str(seconds))
    staged.replace(delays / model)


def hook_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}


def install(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Launcher-side hooks; `patch` is `setattr` in a process of its own, `monkeypatch.setattr` in pytest."""
    from tasks.launch import torchrun

    product_rank_env = torchrun.rank_env
    patch(torchrun, "WORKER_MODULE", WORKER)
    patch(torchrun, "EVAL_WORKER_MODULE", EVAL_WORKER)
    patch(torchrun, "rank_env", lambda extra=None, *, evaluation=False: product_rank_env(
        {**hook_env(), **(extra or {})}, evaluation=evaluation))
    patch(torchrun, "PORTABLE_ENV_PREFIXES", (*torchrun.PORTABLE_ENV_PREFIXES, PREFIX))
    if os.environ.get("HOOK_PUBLISH_BLOCK") == "after_version_insert":
        _block_after_version_insert(patch, os.environ.get("HOOK_PUBLISH_RELEASE"))
    if audit := os.environ.get("HOOK_AUDIT_OPENS"):
        _audit_opens(audit)


def _audit_opens(record: str) -> None:
    import sys

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not isinstance(args[0], str) or not args[0].endswith(".safetensors"):
            return
        if isinstance(args[1], str) and "r" in args[1]:  # builtins.open's mode; os.open passes None
            with open(record, "a") as fh:  # a .txt: this hook does not record itself
                fh.write(os.path.abspath(args[0]) + "\n")

    sys.addaudithook(hook)


def _block_after_version_insert(patch: Callable[[Any, str, Any], None], release: str | None) -> None:
    from tasks.registry.core import Registry

    product_publish = Registry.publish_version

    def publish_version(self, *args, **kwargs):
        record = product_publish(self, *args, **kwargs)
        log.warning("hook: blocking after the version insert")
        while not (release and os.path.exists(release)):
            time.sleep(0.05)
        return record

    patch(Registry, "publish_version", publish_version)
