"""Turn the trainer's node command into a shell line whose node rank and rendezvous come from the engine.

Why: `tasks.launch.torchrun.node_command` builds one node's command with fixed values; under
Slurm or Kubernetes each node learns its rank and the master address only at run time (from
SLURM_NODEID, or RANK/MASTER_ADDR/MASTER_PORT set by the PyTorchJob operator). The builder's
output is reused as is, with just those flags filled from shell variables.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def per_node_line(cmd: Sequence[str], *, node_rank: str, master_addr: str, master_port: str | None = None) -> str:
    """`cmd` as one shell line; node_rank/master_addr/master_port are shell expressions (e.g. "$SLURM_NODEID")."""
    flags = {"--node-rank=": node_rank, "--master-addr=": master_addr}
    if master_port is not None:
        flags["--master-port="] = master_port
    seen = set()
    words = []
    for arg in cmd:
        flag = next((f for f in flags if arg.startswith(f)), None)
        if flag is None:
            words.append(shlex.quote(arg))
        else:
            seen.add(flag)
            words.append(f'{flag}"{flags[flag]}"')
    missing = set(flags) - seen
    if missing:
        raise ValueError(f"node command lacks {sorted(missing)}: {list(cmd)}")
    return " ".join(words)
