"""What packed windows (a chat dataset's conversations) add to the memory of a stage: training's and the
evaluation ranks' alike."""

from __future__ import annotations


def packing_bytes(s: int, b: int, in_flight: int) -> int:
    """What packed windows (a chat dataset) add to a stage: each in-flight micro-batch's position and document
    ids (int64, travelling with the activations), and the [b, 1, s, s] boolean document masks the stage builds
    (tasks/models/common/packing.py: the last two kept, one more while the next is compared, and the causal
    [s, s] it is cut from)."""
    return in_flight * 2 * 8 * s * b + 3 * b * s * s + s * s
