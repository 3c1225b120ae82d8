"""Keep a training rank's start lean: no compiler work for code the ranks run eagerly.

Two costs, each paid by every rank of every launch (issue 27, measured with py-spy and `python -X importtime`):

- torch's optimizers guard each method against `torch.compile` by importing `torch._dynamo` on the first call
  (and `Adam.step` on every call, for a graph break): ~1.7 s of CPU per rank, as much as `import torch`
  itself. The ranks never compile their optimizer, so `eager_adamw` is torch's AdamW with those guards
  resolved to the eager path: the same code and numbers, without the compiler.
- DeepSpeed's ZeRO optimizer imports its Muon optimizer module when it checks the optimizer and on
every gradient reduction (to isinstance-check it), and that module `torch.compile`s three kernels when
it is imported: ~0.8 s per rank on CPU before the first step (issue 27, measured with py-spy and
`python -X importtime`), for an optimizer the ranks never use (they hand DeepSpeed a torch AdamW).
Imported here with those kernels compiled on their first call instead, so Muon would still work,
compiled.
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


def _resolve_to_eager(method: Callable[..., Any]) -> None:
    """A `torch._disable_dynamo` method: its cached "dynamo-disabled" form set to the function itself, which
    is what it does outside `torch.compile` anyway; the wrapper then never imports the compiler."""
    raw = getattr(method, "__wrapped__", None)
    if raw is None or method.__code__.co_name != "inner":  # not the wrapper this was written against
        return
    if getattr(raw, "__dynamo_disable", None) is None:
        setattr(raw, "__dynamo_disable", raw)


class _EagerAdamW(torch.optim.AdamW):
    """torch's AdamW step without its graph breaks (which import `torch._dynamo` on every step); the body
    is torch's own, run under no_grad as torch runs it for a non-differentiable optimizer."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        return _ADAM_STEP(self, closure)


_ADAM_STEP = getattr(torch.optim.Adam.step, "__wrapped__", torch.optim.Adam.step)


def eager_adamw(params: Any, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch's AdamW for a rank that never compiles its optimizer: no `torch._dynamo` import on start or step."""
    for method in (torch.optim.Optimizer.add_param_group, torch.optim.Optimizer.zero_grad,
                   torch.optim.Optimizer.state_dict, torch.optim.Optimizer.load_state_dict):
        _resolve_to_eager(method)
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    if _EagerAdamW not in ZERO_SUPPORTED_OPTIMIZERS:  # ZeRO checks the exact type; this is torch's AdamW
        ZERO_SUPPORTED_OPTIMIZERS.append(_EagerAdamW)
    return _EagerAdamW(params, lr=lr, weight_decay=weight_decay)
