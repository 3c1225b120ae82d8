"""The experiment key's policy: which job-config fields define what training computes.

Two runs with the same fingerprint (and the same data and starting weights, which tasks/runs/identity.py adds by
digest) are the same experiment: they share checkpoints, resume each other, and a published version is reused
instead of trained again. The rules:

1. In: the model's `name`, the `model` section, the `parallel` layout as its one-rank equivalent (rule 4), and the
   `train` section, less what rules 2 and 3 leave out. No other section is in the key (cluster, data location,
   serving, evaluate, publish, retention, deploy, schedule): they say where and how a run goes, not what it computes.
2. Where weights come from is not what they are: `model.pretrained`, `model.pretrained_storage_options` and
   `model.base` are out; the weights they resolve to enter the key by digest.
3. Where, when and from what request a run writes is not what it computes: `train.output_dir`,
   `train.checkpoint_url`, `train.checkpoint_storage_options`, `train.deadline` and `train.init_from` (a request:
   the weights it resolves to enter by digest) are out.
4. The layout is how a run trains, not what: it enters as tp = pp = dp = 1 with the same global batch in
   micro-batches, and without `ep` (dropless routing computes the same at any ep). The same global batch gives the
   same steps at any tp x pp x dp (tests/train/test_3d_equality.py), so a run that lost nodes resumes its own
   checkpoints at a smaller dp (tasks/train/reshard.py), and a tp/pp/ep change finds them and is refused by name
   (tasks/train/checkpoint.py: check_layout). A one-rank config keeps the key it always had.
5. An option enters the key only when it is on: a model option at the value `off_values` gives it, a
   `model.rope_scaling` field that is null (not a field of its rope type) and `train.lora` when unset are left out.
   So adding an option to the schema never changes the key of a config that does not use it: a run resumed across
   the upgrade keeps its key, its checkpoints and its reuse. Every option added to `model` or `train` after keys
   were first recorded goes in `off_values` (or is off when null, as `rope_scaling`'s fields and `train.lora` are).
"""

from __future__ import annotations

from typing import Any

from tasks.base.layout import ONE_RANK, OPTIONAL
from tasks.config.util import sha256_json

MODEL_SOURCES = ("pretrained", "pretrained_storage_options", "base")  # rule 2
TRAIN_RUN_TIME = ("output_dir", "init_from", "checkpoint_url", "checkpoint_storage_options", "deadline")  # rule 3
# Gemma's ModelConfig options (null = off).
GEMMA_OPTIONS = ("sliding_window_pattern", "rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping")
# The mixture-of-experts options at their off values (a dense model).
MOE_OFF: dict[str, Any] = {"num_experts": None, "num_experts_per_tok": None, "moe_intermediate_size": None,
                           "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "router_aux_loss_coef": 0.0}


def off_values(model: dict[str, Any]) -> dict[str, Any]:
    """Rule 5: each model option that is left out of the key at this value (head_dim: d_model / n_heads)."""
    return {"head_dim": model["d_model"] // model["n_heads"], "qk_norm": False, "sliding_window": None,
            **dict.fromkeys(GEMMA_OPTIONS), **MOE_OFF}


def keyed_model(model: dict[str, Any]) -> dict[str, Any]:
    """The `model` section (its JSON dump) as the key sees it: rules 2 and 5."""
    keyed = {k: v for k, v in model.items() if k not in MODEL_SOURCES}
    if keyed.get("rope_scaling"):
        keyed["rope_scaling"] = {k: v for k, v in keyed["rope_scaling"].items() if v is not None}
    for option, off in off_values(model).items():
        if option in keyed and keyed[option] == off:
            del keyed[option]
    return keyed


def keyed_layout(parallel: dict[str, Any]) -> dict[str, Any]:
    """The `parallel` section (its JSON dump) as the key sees it: its one-rank equivalent (rule 4)."""
    return {**{k: v for k, v in parallel.items() if k not in OPTIONAL}, **ONE_RANK.record(),
            "micro_batches": parallel["micro_batches"] * parallel["dp"]}


def keyed_train(train: dict[str, Any]) -> dict[str, Any]:
    """The `train` section (its JSON dump) as the key sees it: rules 3 and 5."""
    return {k: v for k, v in train.items() if k not in TRAIN_RUN_TIME and not (k == "lora" and v is None)}


def fingerprint_of(name: str, model: dict[str, Any], parallel: dict[str, Any], train: dict[str, Any]) -> str:
    """sha256 of what defines training, from the sections' JSON dumps (JobConfig.fingerprint passes them)."""
    return sha256_json({"name": name, "model": keyed_model(model), "parallel": keyed_layout(parallel),
                        "train": keyed_train(train)})
