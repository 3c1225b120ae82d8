"""DeepSpeed's CPU shared-memory comm op, loaded so that a process killed while loading it never wedges a node.

`deepspeed.init_distributed` loads the op through torch's JIT extension loader, which takes a plain lock
file (`<extensions dir>/<op>/lock`) on every load, even of the already-built op. A process SIGKILLed in
that window leaves the file behind, and every later load on that environment (a rank, `scripts/setup.sh`'s
prebuild) waits for it forever. Here every load of ours holds an flock (released by the kernel when its
holder dies) on a file beside the op's folder; a torch lock file found while holding it has no live
owner, so it is removed. DeepSpeed caches the loaded op per process: its own later load returns it at once.

Torch builds (and on every load checks) the op with whichever `ninja` is first on PATH. Two ninja versions
hash a build's commands differently (pip's 1.13 and Debian's 1.11 here), so each takes the other's build for
a stale one and rebuilds it (a minute of CPU, under the lock above, on each alternation: an Airflow worker
without the venv on PATH beside a CLI run with it). Every load of ours uses this environment's own ninja
(DeepSpeed's dependency) when it has one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"
SHM_BUILDER = "ShareMemCommBuilder"


def default_extensions_dir() -> str:
    """The op cache of this Python environment: two venvs never rebuild each other's op."""
    return str(Path(sys.prefix) / "torch-extensions")


def load_shm_op() -> bool:
    """Load (building it once) DeepSpeed's shared-memory op into this process; False where the accelerator
    has none (GPUs)."""
    from deepspeed import ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_BUILDER)
    if builder is None or not ops.__compatible_ops__.get(builder.NAME, False):
        return False
    root = Path(os.environ.get(EXTENSIONS_VAR) or default_extensions_dir())
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{builder.name}.load-lock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one loader of ours at a time; the kernel frees it if we die
        stale = root / builder.name / "lock"
        if stale.exists():
            log.warning("removing %s: a process died while loading %s (no loader holds it)", stale, builder.name)
            stale.unlink(missing_ok=True)
        os.environ.setdefault(EXTENSIONS_VAR, str(root))
        with _own_ninja_first():
            builder.load(verbose=False)
    return True


@contextlib.contextmanager
def _own_ninja_first() -> Iterator[None]:
    """PATH with this environment's bin first while the op loads, where that bin holds a ninja."""
    own = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if not (own / "ninja").is_file() or path.split(os.pathsep)[:1] == [str(own)]:
        yield
        return
    os.environ["PATH"] = os.pathsep.join([str(own), path])
    try:
        yield
    finally:
        os.environ["PATH"] = path
