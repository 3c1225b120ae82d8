"""The training's DeepSpeed PipelineModule and, under expert parallelism, its engine.

A tied weight's gradient is reduced between its stages only when the weight trains: with LoRA the tied embedding
(Gemma 3, small Qwen3) is frozen base weight. DeepSpeed's pipeline engine all-reduces every tied weight's gradient
after the backward pass, reading `_hp_grad` under bf16, which a frozen weight never gets; a frozen tied weight has
nothing to reduce (its copies stay equal: DeepSpeed broadcasts them once at build and after a checkpoint load).

Expert parallelism (`parallel.ep` > 1): a rank holds its share of each MoE layer's experts. DeepSpeed reduces and
partitions such parameters over their expert-data-parallel group only when its engine `has_moe_layers`, which it
sets only for its own `deepspeed.moe.layer.MoE` modules, and its MoE checkpoint code assumes that module's naming.
So `ExpertParallelEngine` says it has them (its ZeRO optimizer then takes the experts' param groups), and saves and
loads as a dense engine does, the pipeline module writing each expert-parallel rank's experts to files of their own
(`TrainingPipeline`: `layer_LL-model_TT-experts_KK-model_states.pt`; tasks/models/weights.py joins them).

`TrainingEngine` is the pipeline engine every run builds: DeepSpeed's, with one hook at the end of a step's
backward pass, before the gradients are reduced and the optimizer steps (ZeRO's step buffers are allocated there),
the one point inside `train_batch` where a CPU rank waits for its checkpoint snapshot to be written
(tasks/train/checkpointer.py `attach`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from tasks.base.layout import ORIGIN, Coord
from tasks.models.common.moe_sharding import is_expert_tensor
from tasks.models.weights import expert_layer_file


class TrainingPipeline(PipelineModule):
    """PipelineModule whose tied-gradient reduction skips weights that do not require grad, and whose checkpoint
    files keep each expert-parallel rank's experts (`ep` > 1)."""

    def __init__(self, *args: Any, coord: Coord = ORIGIN, ep: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.coord, self.ep = coord, ep  # this rank's place in the layout (its TP and expert-parallel ranks)

    def get_tied_weights_and_groups(self) -> list[tuple[Any, Any]]:
        return [(weight, group) for weight, group in super().get_tied_weights_and_groups() if weight.requires_grad]

    def _expert_file(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """This rank's experts of a layer: its TP rank's slice of its expert-parallel rank's experts."""
        return os.path.join(ckpt_dir, expert_layer_file(local_layer_idx + self._local_start, self.coord.tp,
                                                        self.coord.ep))

    def save_state_dict(self, save_dir: str, checkpoint_engine: Any, exclude_frozen_params: bool = False) -> None:
        """DeepSpeed's layer files (data-parallel rank 0) less the experts; under ep > 1 the first ep
        data-parallel ranks, one per expert-parallel rank, each write their experts of every layer."""
        if self.ep == 1:
            return super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
        dp_rank = self._grid.data_parallel_id
        if dp_rank >= self.ep:
            return None
        checkpoint_engine.makedirs(save_dir, exist_ok=True)
        clone = checkpoint_engine.preserves_storage_sharing()  # as DeepSpeed's own save
        for idx, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            state = layer.state_dict()
            if exclude_frozen_params:
                for name in self._get_frozen_parameter_names(layer):
                    del state[name]
            if clone:
                state = clone_tensors_for_torch_save(state)
            experts = {n: state.pop(n) for n in list(state) if is_expert_tensor(n)}
            if experts:
                checkpoint_engine.save(state_dict=experts, path=self._expert_file(save_dir, idx))
            if dp_rank == 0:
                checkpoint_engine.save(state_dict=state, path=self.ckpt_layer_path(save_dir, idx))
        return None

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any, strict: bool = True) -> None:
        if self.ep == 1:
            return super().load_state_dir(load_dir, checkpoint_engine, strict)
        for idx, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "load_state_dict"):
                continue
            state = checkpoint_engine.load(self.ckpt_layer_path(load_dir, idx), map_location="cpu")
            if any(is_expert_tensor(n) for n in layer.state_dict()):
                state |= checkpoint_engine.load(self._expert_file(load_dir, idx), map_location="cpu")
            layer.load_state_dict(state, strict=strict)
        self._synchronize_tied_weights()
        return None


class TrainingEngine(PipelineEngine):
    """DeepSpeed's pipeline engine; `before_gradient_reduce`, when set, runs after a step's last backward pass,
    before its tied and its data-parallel gradients are reduced (and the optimizer steps): it must return at once
    when called again in the same step (a schedule reduces tied gradients first, when it does)."""

    before_gradient_reduce: Callable[[], object] | None = None

    def _hook(self) -> None:
        if self.before_gradient_reduce is not None:
            self.before_gradient_reduce()

    def _exec_reduce_tied_grads(self) -> None:
        self._hook()
        PipelineEngine._exec_reduce_tied_grads(self)

    def _exec_reduce_grads(self) -> None:
        self._hook()
        PipelineEngine._exec_reduce_grads(self)

    # DeepSpeed dispatches a schedule's instructions through this class attribute, not by method lookup.
    _INSTRUCTION_MAP: ClassVar[dict[type, Callable[..., None]]] = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.ReduceGrads: _exec_reduce_grads,
    }


class ExpertParallelEngine(TrainingEngine):
    """A PipelineEngine whose module holds expert-parallel parameters (see the module docstring)."""

    def _configure_distributed_model(self, model: torch.nn.Module) -> None:
        super()._configure_distributed_model(model)
        self.has_moe_layers = True  # before the optimizer is built: ZeRO takes the experts' groups

    @contextlib.contextmanager
    def _dense_checkpoint(self) -> Iterator[None]:
        self.has_moe_layers = False
        try:
            yield
        finally:
            self.has_moe_layers = True

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with self._dense_checkpoint():
            return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with self._dense_checkpoint():
            return super().load_checkpoint(*args, **kwargs)


@contextlib.contextmanager
def engine_for(ep: int) -> Iterator[None]:
    """`deepspeed.initialize` builds a `TrainingEngine` for a pipeline module, an `ExpertParallelEngine` when
    ep > 1 (it takes its pipeline engine class from the `deepspeed` namespace at call time)."""
    import deepspeed

    deepspeed.PipelineEngine = ExpertParallelEngine if ep > 1 else TrainingEngine  # type: ignore[attr-defined]
    try:
        yield
    finally:
        deepspeed.PipelineEngine = PipelineEngine  # type: ignore[attr-defined]
