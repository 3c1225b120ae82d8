"""The training's DeepSpeed PipelineModule: a tied weight's gradient is reduced between its stages only when
the weight trains.

Why: with LoRA the tied embedding (Gemma 3, small Qwen3) is frozen base weight. DeepSpeed's pipeline engine
all-reduces every tied weight's gradient after the backward pass, reading `_hp_grad` under bf16, which a
frozen weight never gets; a frozen tied weight has nothing to reduce (its copies stay equal: DeepSpeed
broadcasts them once at build and after a checkpoint load).
"""

from __future__ import annotations

from typing import Any

from deepspeed.pipe import PipelineModule


class TrainingPipeline(PipelineModule):
    """PipelineModule whose tied-gradient reduction skips weights that do not require grad."""

    def get_tied_weights_and_groups(self) -> list[tuple[Any, Any]]:
        return [(weight, group) for weight, group in super().get_tied_weights_and_groups() if weight.requires_grad]
