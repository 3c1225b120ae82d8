"""Worker process for the concurrency test: publishes, switches and rolls back against one registry."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from tasks.registry import ANY, ArtifactRef, ConflictError, Lineage, NothingToRollBackError, Registry

MODEL = "racer"
ALIAS = "production"


def digest_for(worker: int, op: int) -> str:
    return hashlib.sha256(f"w{worker}-op{op}".encode()).hexdigest()


def run(url: str, worker: int, ops: int, barrier: Any, results: Any) -> None:
    """Role by worker index: 0 = rollbacks, 1 = CAS publishers (retry on conflict), else blind publishers."""
    role = ("rollback", "cas", "publish", "publish")[worker % 4]
    out: dict[str, Any] = {"worker": worker, "role": role, "published": [], "switches": [], "cas": [], "error": None}
    try:
        with Registry(url) as reg:
            barrier.wait(timeout=120)
            if role == "rollback":
                # Until the publishers have switched at least once there is nothing to roll back to; keep
                # trying (bounded) so the rollbacks really race the publishers however the OS schedules us.
                for attempt in range(2000):
                    if len(out["switches"]) == ops:
                        break
                    try:
                        rec = reg.rollback(MODEL, ALIAS, actor=f"w{worker}", reason=f"rollback {attempt}")
                    except NothingToRollBackError:
                        time.sleep(0.005)
                        continue
                    out["switches"].append(rec.to_dict())
            for op in range(ops if role != "rollback" else 0):
                d = digest_for(worker, op)
                v = reg.publish_version(MODEL, ArtifactRef(d, f"file:///s/{d}", op),
                                        Lineage("c", "m", "r", f"w{worker}-{op}"), {"op": op}, f"w{worker}")
                out["published"].append(v.version)
                if role == "publish":
                    out["switches"].append(
                        reg.switch_alias(MODEL, ALIAS, v.version, expect=ANY, actor=f"w{worker}",
                                         reason=f"publish {op}").to_dict())
                    continue
                for _attempt in range(200):
                    live = reg.live_version(MODEL, ALIAS)
                    expected = live.version if live else None
                    try:
                        rec = reg.switch_alias(MODEL, ALIAS, v.version, expect=expected, actor=f"w{worker}",
                                               reason=f"cas {op}")
                    except ConflictError:
                        continue
                    out["switches"].append(rec.to_dict())
                    out["cas"].append([expected, rec.to_dict()])
                    break
                else:
                    raise RuntimeError("CAS never won in 200 attempts")
    except BaseException as exc:  # reported to the test, which fails on it
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)
