"""Deploy on model events: when an alias moves, put the version it now points to into service, or move it back.

Stages (the deploy DAG, dags/deploy.py, runs each as a task on the serving host's queue; `retrainer deploy
CONFIG` chains them in one process):
1. `resolve_target`: the version live *now* (an alias that moved again since the event is deployed as it is
   now; the later move's own event deploys again), and the history row of the move that made it live.
2. `pull`: the version's artifact into `<models_dir>/v<N>-<digest>/`, every byte verified while streaming
   (the registry's own pull); a directory pulled before is reused when every file is there with its size.
3. `smoke_test`: a process of its own loads the export with transformers and checks it (tasks/deploy/smoke.py).
4. `run_hook`: the user's hook (`deploy.command` or `deploy.entry_point`) deploys it, in a process of its own,
   with the version in `RETRAINER_DEPLOY_*` environment variables (never on a command line).
5. On a failure of any of them, `roll_back`: the alias goes back to the version live before (compare-and-swap on
   the version that failed, audited; the reason names the failure). That move's event deploys the version rolled
   back to, so serving gets the old one back. Should that deploy fail too, nothing is rolled back again (the
   alias history says the move was a rollback): it fails loudly and leaves the alias to a person.

Why the serving host: it can hold the model for serving by definition, so it can load it once more for the
smoke test; an Airflow worker elsewhere could not. Loading uses `device_map="auto"` (every GPU of the host, then
CPU memory; transformers builds the model on the meta device and streams each safetensors shard in), in a child
process, so an out-of-memory kill or a crash takes the child, never the task that then rolls back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks import REPO_ROOT
from tasks.base.dataset_format import TOKEN_DTYPES, window_starts
from tasks.base.errors import RetrainerError
from tasks.base.lock import default_holder
from tasks.base.model_files import HF_CONFIG, LEGACY_FILE
from tasks.base.spawn import die_with_parent
from tasks.config import JobConfig, load_entry_point
from tasks.config.endpoints import registry_for
from tasks.data.manifest import read_manifest
from tasks.evaluate.spec import suite_hash, window_order
from tasks.launch.torchrun import rank_env
from tasks.models.resolve import load_config
from tasks.registry import ArtifactStore, ConflictError, NothingToRollBackError
from tasks.stages.lifecycle import stage_rollback

if TYPE_CHECKING:
    from tasks.registry import SwitchRecord, VersionRecord

log = logging.getLogger(__name__)

ENV_PREFIX = "RETRAINER_DEPLOY_"
_MAX_REASON = 1500  # of a failure, as it goes into the alias history (tasks.registry.names.MAX_REASON is 2000)
_TAIL_LINES = 20  # lines of a child's output kept for the failure's reason
# The hook command travels in the environment, not on the command line (where `ps` would show whatever its
# ${VAR}s expanded to), and is unset before it runs.
_RUN_COMMAND = f'cmd=${ENV_PREFIX}COMMAND; unset {ENV_PREFIX}COMMAND; eval "$cmd"'


class DeployError(RetrainerError):
    """A deploy stage failed; the message names the stage and why (the rollback's audited reason)."""


@dataclass(frozen=True)
class DeployTarget:
    """The version a deploy puts into service, and how it became live: what the hook receives."""

    model: str
    alias: str
    version: int
    digest: str
    model_dir: str  # the verified local copy on the serving host
    moved_by: str  # the action of the alias move that made it live: publish, promote or rollback
    moved_from: int | None  # the version live before that move
    event_version: int | None  # what the triggering event said (None: no event, e.g. the CLI)

    @property
    def via_rollback(self) -> bool:
        return self.moved_by == "rollback"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> DeployTarget:
        return cls(**{f.name: obj[f.name] for f in fields(cls)})

    def env(self) -> dict[str, str]:
        """Each field as RETRAINER_DEPLOY_<FIELD> (RETRAINER_DEPLOY_MODEL_DIR, ..._VERSION, ...; None: empty)."""
        return {f"{ENV_PREFIX}{k.upper()}": "" if v is None else str(v) for k, v in self.to_dict().items()}

    @classmethod
    def from_env(cls, env: dict[str, str]) -> DeployTarget:
        values: dict[str, Any] = {f.name: env[f"{ENV_PREFIX}{f.name.upper()}"] for f in fields(cls)}
        for name in ("version", "moved_from", "event_version"):
            values[name] = int(values[name]) if values[name] else None
        return cls(**values)


def deploy_alias(cfg: JobConfig) -> str:
    return cfg.deploy.alias or cfg.publish.alias


def models_dir(cfg: JobConfig) -> Path:
    """Where pulled versions live on the serving host."""
    return Path(cfg.deploy.models_dir or Path(cfg.data.cache_dir) / "deploy" / cfg.publish.model_name)


def _registry(cfg: JobConfig):

    return registry_for(cfg)


def event_version(event_extras: list[dict[str, Any]]) -> int | None:
    """The version the newest alias-moved event names (`extra.version`), if any."""
    for extra in reversed(event_extras):
        version = (extra or {}).get("version")
        if isinstance(version, int) and not isinstance(version, bool):
            return version
    return None


def resolve_target(cfg: JobConfig, event_extras: list[dict[str, Any]] | None = None) -> DeployTarget:
    """The version the alias points to now, with the history row of the move that made it live."""
    model, alias = cfg.publish.model_name, deploy_alias(cfg)
    registry = _registry(cfg)
    history = registry.history(model, alias)  # a pointer and its history row are written in one transaction
    if not history:
        raise DeployError(f"pull failed: {model} alias {alias!r} points to no version; nothing to deploy")
    last = history[-1]
    rec = registry.get_version(model, last.to_version)
    said = event_version(event_extras or [])
    if said is not None and said != rec.version:
        log.warning("deploy: the event said %s/%s moved to v%d, it points to v%d now: deploying v%d (the later "
                    "move's own event deploys again)", model, alias, said, rec.version, rec.version)
    target = DeployTarget(model=model, alias=alias, version=rec.version, digest=rec.artifact_digest,
                          model_dir=str(models_dir(cfg) / f"v{rec.version}-{rec.artifact_digest[:12]}"),
                          moved_by=last.action, moved_from=last.from_version, event_version=said)
    log.info("deploy: %s/%s is v%d (%s by %s from %s: %s)", model, alias, rec.version, last.action, last.actor,
             "nothing" if last.from_version is None else f"v{last.from_version}", last.reason)
    return target


def pull(cfg: JobConfig, target: DeployTarget) -> Path:
    """The target's artifact in `target.model_dir`, verified; a complete earlier pull is reused."""

    rec = _registry(cfg).get_version(target.model, target.version)
    store = ArtifactStore.of_version(rec, cfg.publish.storage_options)
    dest = Path(target.model_dir)
    if dest.is_dir():
        missing = _incomplete(store, rec, dest)
        if not missing:
            log.info("deploy: v%d already pulled into %s (verified then; every file there with its size)",
                     rec.version, dest)
            return dest
        log.warning("deploy: %s is incomplete (%s): pulling v%d again", dest, missing, rec.version)
        shutil.rmtree(dest)
    started = time.monotonic()
    store.pull(rec, dest)
    log.info("deploy: pulled v%d (%d bytes, every file verified) into %s in %.1f s", rec.version, rec.size_bytes,
             dest, time.monotonic() - started)
    return dest


def _incomplete(store: ArtifactStore, rec: VersionRecord, dest: Path) -> str | None:
    """What a local copy lacks against the version's manifest (by size), or None when complete."""

    expected = ({f.path: f.size for f in store.tree_manifest(rec.artifact_digest).files}
                if rec.artifact_kind == "tree" else {LEGACY_FILE: rec.size_bytes})
    for path, size in expected.items():
        local = dest / path
        if not local.is_file() or local.stat().st_size != size:
            return f"{path} missing or not {size} bytes"
    return None


# -- smoke test --------------------------------------------------------------------------------------------


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
    if suite_hash(cfg, suites) != metrics["suite_hash"]:
        return (f"v{rec.version} was evaluated under another evaluation or model config (suite hash "
                f"{metrics['suite_hash'][:12]}, this config's {suite_hash(cfg, suites)[:12]})")
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
    rec = _registry(cfg).get_version(target.model, target.version)
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
        why = result["error"] if result else _died(rc, tail, s.timeout_s)
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


def _died(rc: int | None, tail: list[str], timeout_s: float) -> str:
    if rc is None:
        return f"timed out after {timeout_s:g} s"
    last = tail[-1] if tail else "no output"
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited {rc}"
    return f"the process {how}: {last}"


# -- the hook ------------------------------------------------------------------------------------------------


def run_hook(cfg: JobConfig, target: DeployTarget) -> dict[str, Any]:
    """Hand the verified, smoke-tested version to the user's hook, in a process of its own."""
    d = cfg.deploy
    env = {**os.environ, **target.env()}
    if d.command is not None:
        argv, what = ["/bin/bash", "-c", _RUN_COMMAND], "deploy.command"
        env[f"{ENV_PREFIX}COMMAND"] = d.command
    else:
        assert d.entry_point is not None
        argv, what = [sys.executable, "-m", "tasks.deploy", d.entry_point], f"deploy.entry_point {d.entry_point}"
    started = time.monotonic()
    rc, tail = run_logged(argv, env=env, timeout_s=d.hook_timeout_s, what="hook")
    if rc != 0:
        raise DeployError(f"hook failed: {what} for v{target.version}: {_died(rc, tail, d.hook_timeout_s)}")
    log.info("deploy: hook deployed %s v%d (%s) in %.1f s", target.model, target.version, what,
             time.monotonic() - started)
    return {"version": target.version, "hook": what, "seconds": round(time.monotonic() - started, 3)}


def call_entry_point(ref: str) -> None:
    """The hook process of `deploy.entry_point`: call it with the target from the environment."""

    load_entry_point(ref, "deploy")(DeployTarget.from_env(dict(os.environ)))


def run_logged(argv: list[str], *, env: dict[str, str], timeout_s: float, what: str) -> tuple[int | None, list[str]]:
    """Run a child in its own session (it dies with us), its output logged line by line; (exit code or None on
    timeout, the last lines of its output). On timeout its whole process group is killed."""
    import signal


    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
                            preexec_fn=die_with_parent)
    tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def follow() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            log.info("%s: %s", what, line)
            tail.append(line)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        log.error("%s: still running after %g s: killing it", what, timeout_s)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    return rc, list(tail)


# -- rollback ------------------------------------------------------------------------------------------------


def failure_reason(exc: BaseException, step: str) -> str:
    """The audited reason of a failed step: a DeployError says it already, anything else is named by step."""
    text = str(exc) if isinstance(exc, DeployError) else f"{step} failed: {type(exc).__name__}: {exc}"
    return text[:_MAX_REASON]


def unrecorded_failure(steps: list[str]) -> str:
    """The reason when a failed step's process died before it could say why (killed, out of memory, worker lost)."""
    named = " and ".join(steps) or "a deploy step"
    return f"{named} failed without a recorded reason (its process was killed or its worker lost; see its log)"


def roll_back(cfg: JobConfig, target: DeployTarget | None, failure: str, *, actor: str) -> SwitchRecord:
    """Move the alias back from the version whose deploy failed (compare-and-swap on it), audited with `failure`.

    Refused, loudly (DeployError), when the version got there by a rollback itself (no cascade), when the alias
    moved since (that move deploys on its own), or when there is nothing to go back to."""

    if target is None:
        raise DeployError(f"deploy failed before the live version was known ({failure}); nothing rolled back")
    where = f"{target.model} v{target.version} ({target.alias})"
    if target.via_rollback:
        raise DeployError(
            f"deploy of {where} failed: {failure}. v{target.version} is live because of a rollback (from "
            f"v{target.moved_from}), so it is not rolled back again: serving needs a person")
    try:
        out = stage_rollback(cfg, alias=target.alias, expect=target.version, actor=actor,
                             reason=f"deploy: {failure}"[:_MAX_REASON])
    except ConflictError as exc:
        raise DeployError(f"deploy of {where} failed: {failure}; not rolled back, the alias moved since "
                          f"({exc}): that move's event deploys it") from None
    except NothingToRollBackError as exc:
        raise DeployError(f"deploy of {where} failed: {failure}; and there is nothing to roll back to "
                          f"({exc})") from None
    log.error("deploy: %s failed (%s): rolled %s back to v%d", where, failure, target.alias, out.to_version)
    return out


# -- the whole deploy in one process -----------------------------------------------------------------------


def run_deploy(cfg: JobConfig, *, actor: str, event_extras: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """resolve -> pull -> smoke test -> hook, rolling the alias back on a failure (then DeployError)."""
    target, step = None, "pull"
    out: dict[str, Any] = {}
    try:
        target = resolve_target(cfg, event_extras)
        out["target"] = target.to_dict()
        pull(cfg, target)
        step = "smoke test"
        out["smoke_test"] = smoke_test(cfg, target)
        step = "hook"
        out["hook"] = run_hook(cfg, target)
    except Exception as exc:
        failure = failure_reason(exc, step)
        rolled = roll_back(cfg, target, failure, actor=actor)
        raise DeployError(f"{failure}; rolled {rolled.alias} back v{rolled.from_version} -> "
                          f"v{rolled.to_version}") from exc
    return out


def _cmd_deploy(args: argparse.Namespace) -> int:

    out = run_deploy(load_config(args.config), actor=default_holder("cli"))
    t = out["target"]
    print(json.dumps(out, indent=2) if args.json else
          f"deployed {t['model']} v{t['version']} ({t['alias']}) from {t['model_dir']}: {describe(out['smoke_test'])}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="pull the version an alias points to, smoke-test it, run the deploy hook "
                                      "(rolling the alias back on a failure)")
    p.add_argument("config", help="job config YAML (its deploy section)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_deploy)
