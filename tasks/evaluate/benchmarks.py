"""What the benchmark gates run, resolved on the launcher's side before any rank starts (no torch here: the
Airflow tasks and the CLI that plan and hash an evaluation never load it). The ranks' side, the harness's model
and the scoring, is tasks/evaluate/harness.py.

Everything that changes a score is pinned by the config (few-shot count, limit, chat template) or here
(seeds, bootstrap iterations), recorded with the version beside the harness's version, and part of the
suite hash (with the task folder's digest), so a live version's benchmark numbers are cached like its loss.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.config.schema import JobConfig

HARNESS = "lm-eval"
# The harness's own defaults, pinned so that its next release cannot move a gate's numbers unnoticed.
PINNED = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234,
          "bootstrap_iters": 1000}


def harness_version() -> str:
    try:
        return metadata.version(HARNESS)
    except metadata.PackageNotFoundError:
        raise InvalidInputError("evaluate.benchmarks needs lm-evaluation-harness where the evaluation runs: "
                                "pip install 'retrainer[benchmarks]'") from None


def resolve_benchmarks(cfg: JobConfig) -> list[dict[str, Any]]:
    """Each benchmark's settings as the ranks run them: the config's, the pinned ones, the harness version and
    the digest of its task folder; refused here, before any rank starts, when the harness is missing, a task
    folder is not a folder of plain files, or a task is unknown to the harness."""
    from tasks.registry.store import local_tree_manifest

    out = []
    for i, bench in enumerate(cfg.evaluate.benchmarks):
        field = f"evaluate.benchmarks[{i}]"
        digest = None
        if bench.include_path is not None:
            if not Path(bench.include_path).is_dir():
                raise InvalidInputError(f"{field}.include_path: {bench.include_path} is not a directory")
            try:
                digest = local_tree_manifest(bench.include_path).digest
            except InvalidInputError as exc:
                raise InvalidInputError(f"{field}.include_path: {exc}") from None
        unknown, defaults = find_tasks(bench.tasks, bench.include_path)
        if unknown:
            raise InvalidInputError(f"{field}.tasks: {', '.join(unknown)} not known to {HARNESS} "
                                    f"{harness_version()} (include_path: {bench.include_path})")
        out.append({**bench.model_dump(mode="json"), "include_digest": digest, "include_defaults": defaults,
                    "harness": HARNESS, "harness_version": harness_version(), "max_length": cfg.model.seq_len,
                    **PINNED})
    return out


def find_tasks(tasks: tuple[str, ...], include_path: str | None) -> tuple[list[str], bool]:
    """(the names neither the task folder nor the harness's own tasks define, whether any name needs the
    harness's own: indexing them takes seconds, so only then, here and on rank 0)."""
    missing = [t for t in tasks if t not in task_manager(include_path, defaults=False).all_tasks]
    if not missing or include_path is None:
        return missing, include_path is None
    return [t for t in missing if t not in task_manager(include_path, defaults=True).all_tasks], True


def task_manager(include_path: str | None, *, defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(verbosity="WARNING", include_path=include_path,
                       include_defaults=defaults or include_path is None)
