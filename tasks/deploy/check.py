"""The deploy smoke test, the serving host's side: which windows the version was evaluated on, a child process
(tasks/deploy/smoke.py) that loads the export and scores them, and the comparison with the recorded loss."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.dataset_format import TOKEN_DTYPES, window_starts
from tasks.base.errors import RetrainerError
from tasks.base.model_files import HF_CONFIG
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig
from tasks.data.manifest import read_manifest
from tasks.deploy.process import died, run_logged
from tasks.deploy.target import DeployError, DeployTarget
from tasks.evaluate.spec import suite_hash, window_order
from tasks.launch.torchrun import rank_env

if TYPE_CHECKING:
    from tasks.registry import VersionRecord

log = logging.getLogger(__name__)


def evaluated_windows(cfg: JobConfig, rec: VersionRecord) -> tuple[Any, float, int] | str:
    """The token windows the version's evaluation scored on its first suite, the loss it recorded there and its
    batch size; or why they cannot be had (a string). Only those windows' bytes are read (ranged reads of the
    held-out shards, under a manifest checked against the hash the evaluation verified), never the whole split."""
    import fsspec
    import numpy as np

    metrics = rec.metrics
    suites = metrics.get("suites")
    if not suites or "batches" not in metrics or "suite_hash" not in metrics:
        return f"v{rec.version} records no evaluation windows (published outside the lifecycle)"
    if (key := suite_hash(cfg, suites)) != metrics["suite_hash"]:
        return (f"v{rec.version} was evaluated under another evaluation or model config (suite hash "
                f"{metrics['suite_hash'][:12]}, this config's {key[:12]})")
    suite = suites[0]
    recorded = metrics.get("metrics", {}).get(f"{suite['name']}.loss")
    if not isinstance(recorded, int | float):
        return f"v{rec.version} records no {suite['name']}.loss"
    url = f"{suite['source_url'].rstrip('/')}/{suite['manifest']}"
    try:
        manifest = read_manifest(url, cfg.data.storage_options)
    except (RetrainerError, OSError) as exc:
        return f"the held-out data v{rec.version} was evaluated on cannot be read ({exc})"
    if manifest.hash != suite["manifest_hash"]:
        return (f"the data at {suite['source_url']} changed since v{rec.version} was evaluated (manifest "
                f"{suite['manifest_hash'][:12]} then, {manifest.hash[:12]} now)")
    dtype = np.dtype(TOKEN_DTYPES[manifest.dtype])
    seq = cfg.model.seq_len
    index = [(f.key, start) for f in manifest.split(suite["split"])
             for start in window_starts(f.size // dtype.itemsize, seq)]
    if not index:
        return f"no {suite['split']}/ windows of {seq + 1} tokens at {suite['source_url']}"
    order = window_order(len(index), int(metrics["batches"]), int(metrics["batch_size"]))
    fs, root = fsspec.core.url_to_fs(suite["source_url"], **cfg.data.storage_options)
    picked = [index[int(i)] for i in order]
    try:
        chunks = fs.cat_ranges([f"{root.rstrip('/')}/{key}" for key, _ in picked],
                               [start * dtype.itemsize for _, start in picked],
                               [(start + seq + 1) * dtype.itemsize for _, start in picked], on_error="raise")
    except OSError as exc:  # the data, not the model: no reason to refuse the version
        return f"the held-out shards at {suite['source_url']} cannot be read ({exc})"
    windows = np.stack([np.frombuffer(c, dtype=dtype).astype(np.int64) for c in chunks])
    if windows.shape != (len(picked), seq + 1):
        return f"the held-out shards at {suite['source_url']} are shorter than their manifest says"
    return windows, float(recorded), int(metrics["batch_size"])


def smoke_test(cfg: JobConfig, target: DeployTarget) -> dict[str, Any]:
    """Load the pulled export with transformers in a child process, score the version's evaluation windows (the
    loss must match the recorded one within `smoke_test.loss_tolerance`) and generate tokens; DeployError says
    what failed."""
    import numpy as np

    s = cfg.deploy.smoke_test
    name = f"v{target.version}"
    if not (Path(target.model_dir) / HF_CONFIG).is_file():
        raise DeployError(f"smoke test failed: {name} is not a Hugging Face directory (no {HF_CONFIG} in "
                          f"{target.model_dir}); transformers cannot load it")
    rec = registry_for(cfg).get_version(target.model, target.version)
    evaluated: tuple[Any, float, int] | str = "deploy.smoke_test.loss_tolerance is null"
    if s.loss_tolerance is not None:
        evaluated = evaluated_windows(cfg, rec)
    if isinstance(evaluated, str):
        log.warning("deploy: smoke test of %s without the loss check: %s", name, evaluated)
    with tempfile.TemporaryDirectory(prefix="retrainer-smoke-") as tmp:
        spec: dict[str, Any] = {"model_dir": target.model_dir, "dtype": s.dtype, "prompt": s.prompt,
                                "generate_tokens": s.generate_tokens, "windows": None, "batch_size": 1}
        if not isinstance(evaluated, str):
            np.save(Path(tmp) / "windows.npy", evaluated[0])
            spec.update(windows=str(Path(tmp) / "windows.npy"), batch_size=evaluated[2])
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        out = Path(tmp) / "result.json"
        env = rank_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})  # no credentials: it reads local files
        rc, tail = run_logged([sys.executable, "-m", "tasks.deploy.smoke", str(Path(tmp) / "spec.json"), str(out)],
                              env=env, timeout_s=s.timeout_s, what="smoke test")
        result = json.loads(out.read_text()) if out.is_file() else None
    if result is None or "error" in result:
        why = result["error"] if result else died(rc, tail, s.timeout_s)
        raise DeployError(f"smoke test failed: {name}: {why}")
    report = {"version": target.version, **result, "loss_check": None}
    if not isinstance(evaluated, str) and s.loss_tolerance is not None:
        recorded = evaluated[1]
        diff = abs(result["loss"] - recorded) / recorded
        report["loss_check"] = {"evaluated": recorded, "served": result["loss"], "relative_difference": diff,
                                "tolerance": s.loss_tolerance}
        if diff > s.loss_tolerance:
            raise DeployError(
                f"smoke test failed: {name}: held-out loss {result['loss']:.4f} with the served weights, "
                f"{recorded:.4f} when evaluated ({diff:.1%} apart, tolerance {s.loss_tolerance:.1%}): the "
                "export does not compute what was evaluated")
    log.info("deploy: smoke test of %s passed: %s", name, describe(report))
    return report


def describe(report: dict[str, Any]) -> str:
    """One line on what a passed smoke test saw."""
    check = report["loss_check"]
    loss = ("held-out loss not compared" if check is None else
            f"held-out loss {check['served']:.4f} (evaluated {check['evaluated']:.4f}, "
            f"{check['relative_difference']:.2%} apart)")
    return (f"loaded on {', '.join(report['devices'])} in {report['load_s']:.1f} s; {loss}; generated "
            f"{len(report['generated'])} tokens {report['generated'][:16]}"
            + (f" ({report['text']!r})" if report.get("text") else ""))
