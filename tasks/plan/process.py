"""A training rank's process memory beyond the tensors the budget counts: what its RSS holds at its peak.

Measured on CPU (issue 27: a 300M Llama planned at 3.5 GB per rank peaked at 6.3 GB), now checked by
tests/plan/test_process_memory.py and bench/scale.py. Its terms, printed by `retrainer plan`:
- runtime: an idle rank after its imports and process group (Python, torch, DeepSpeed, gloo, our code;
  measured 327 MiB with `/proc/self/status` VmRSS, 340-380 MiB in running ranks).
- ZeRO step buffers (ZeRO-1/2): at the optimizer step DeepSpeed copies the gradients of this rank's
  partition into a per-parameter averaged copy and then into one flat partition, while the gradients
  are still alive (deepspeed/runtime/zero/stage_1_and_2.py `step`): two gradient-sized copies of the shard.
  A CPU step has three moments, one after the other, beside the weights, gradients and optimizer states: the
  forward and backward passes (activations, pipeline and tensor-parallel buffers), the data-parallel reduction
  (its bucket, gone before the step) and the optimizer step (these buffers); its peak is the largest (a MoE at
  dp=2 x ep=2 measured 1189 MiB a rank, planned 1243; with the bucket counted beside the step, 1413).
- checkpoint snapshot: a save copies the weights it keeps (`saved_weights`: all of them, or a LoRA run on
  base weights only its adapters, whose base is those weights) and the optimizer states to host memory and
  trains on while a thread writes them (tasks/train/async_save.py); until then the rank holds both. A run that
  saves before its last step trains the next step while the snapshot is written. Each file's host copy goes
  once it is written (tasks/train/async_save.py `write_files`). A CPU rank waits for the write before a step's
  gradients are reduced (tasks/train/checkpointer.py `wait_for_snapshot`), so the snapshot never meets ZeRO's
  step buffers and nothing changes the optimizer's tensors while they are written: its snapshot copies only the
  weights (views of ZeRO's flat buffer) and writes the fp32 master and Adam's moments from where they live, 4 of
  16 bytes a parameter in fp32. That phase is planned as the step's forward and backward passes with the
  weights' copy on top. Measured (issue 38, `bench/soak.py`, 300M, a save every 5): while the
  snapshot copied the optimizer states too, the ranks peaked at 5.18 / 5.00 GiB as they saved, planned 5.90 / 5.78
  (the plan's bound, a write outlasting a backward pass, was never reached); now they peak at the optimizer step,
  4.37 / 4.51 GiB, planned 4.28 / 4.40. A run whose only save is its last step holds the snapshot beside the
  step's leftovers only.
- pipe outputs: the last stage's logits that DeepSpeed's pipe buffers keep between steps (tasks/plan/budget.py
  `_kept_outputs`), beside the optimizer step's buffers and the next step: on a CPU rank only (a GPU's are in
  device memory).
- weights file pages: a rank that starts from weights (a pretrained directory, a LoRA base, a version) reads its
  stage through a memory map, and the pages it read count in its RSS beside the weights they filled until the
  load ends: the peak of a LoRA run on a base (measured 565 MiB where runtime + weights + states said 464).
- data index: what the rank keeps to index its training windows (the data's and each replay source's train split:
  tasks/base/dataset_format.py `SplitShape.index_bytes`), for its whole life: 24 bytes a window of plain text, so
  ~0.55 GiB a rank at 24M windows (a 100B-token split at seq 4096), where the demo's are a few KiB.
On a GPU the tensors live in device memory: the host holds the runtime, the data index and the larger of the
snapshot and the weights file pages.
"""

from __future__ import annotations

from typing import Any

RUNTIME_BYTES = 360 * 1024**2


def process_memory(stage: dict[str, Any], zero_stage: int, grad_bytes: int, dp: int, on_cpu: bool,
                   loads_weights: bool = False, saves_mid_run: bool = False, index_bytes: int = 0) -> dict[str, Any]:
    """The process terms of one pipeline stage's rank (`stage`: the budget's per-stage tensor terms, with
    `saved_weights`, the weight bytes a save keeps, `reduce_bucket`, the data-parallel reduction's share of
    `comm_buffers`, and `pipe_outputs`, the logits the last stage keeps), the peak host memory they add up to
    and the phase that peaks (training, saving, training + snapshot, loading); `loads_weights`: the rank reads
    its starting weights from a file at start; `saves_mid_run`: it saves before its last step, so a step trains
    while the snapshot is written; `index_bytes`: the data index it holds throughout."""
    shard = -(-stage["params"] // dp)
    step_buffers = 2 * grad_bytes * shard if zero_stage in (1, 2) else 0
    # A CPU rank's snapshot leaves the optimizer states where they live (see the module docstring).
    snapshot = stage["saved_weights"] + (0 if on_cpu else stage["optimizer_states"])
    # The file's pages, read through a memory map, count in the RSS until the load ends (taken as the stage's
    # weights in the training dtype).
    file_pages = stage["weights"] if loads_weights else 0
    pipe_outputs = stage["pipe_outputs"] if on_cpu else 0
    terms = {"runtime": RUNTIME_BYTES, "zero_step_buffers": step_buffers, "checkpoint_snapshot": snapshot,
             "pipe_outputs": pipe_outputs, "weights_file_pages": file_pages, "data_index": index_bytes}
    if not on_cpu:
        phases = {"saving": snapshot, "loading": file_pages}
    else:
        held = stage["weights"] + stage["gradients"] + stage["optimizer_states"] + pipe_outputs
        # A step's three moments, one after the other: the forward and backward passes (activations and the
        # pipeline's and tensor-parallel buffers), the data-parallel reduction (its bucket), the optimizer step.
        passes = stage["activations"] + stage["comm_buffers"] - stage["reduce_bucket"]
        phases = {"training": held + max(passes, stage["reduce_bucket"], step_buffers),
                  "loading": stage["weights"] + file_pages}
        if saves_mid_run:  # the write ends before the gradients are reduced (see the module docstring)
            phases["training + snapshot"] = held + passes + snapshot
        else:  # the save follows the optimizer step, after which DeepSpeed has dropped the gradients (zero_grad)
            phases["saving"] = stage["weights"] + stage["optimizer_states"] + pipe_outputs + snapshot
    phase = max(phases, key=phases.__getitem__)
    return {"terms": terms, "peak": RUNTIME_BYTES + index_bytes + phases[phase], "phase": phase}
