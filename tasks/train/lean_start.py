"""Keep DeepSpeed's Muon kernels from being compiled on every training rank at start.

Why: DeepSpeed's ZeRO optimizer imports its Muon optimizer module when it checks the optimizer and on
every gradient reduction (to isinstance-check it), and that module `torch.compile`s three kernels when
it is imported: ~0.8 s per rank on CPU before the first step (issue 27, measured with py-spy and
`python -X importtime`), for an optimizer the ranks never use (they hand DeepSpeed a torch AdamW).
Imported here with those kernels compiled on their first call instead, so Muon would still work,
compiled. (torch._dynamo itself is still imported, by every torch optimizer's first `step`.)
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

_MUON = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_uncompiled() -> None:
    """Before `deepspeed.initialize`: DeepSpeed's Muon module imported, its kernels not yet compiled."""
    if _MUON in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile
    compiler.compile = lambda: _compile_on_first_call  # what the module's decorators call
    try:
        importlib.import_module(_MUON)
    finally:
        compiler.compile = eager


def _compile_on_first_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call
