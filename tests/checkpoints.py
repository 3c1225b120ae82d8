"""Checkpoint files as the trainer leaves them, written without training (for publish/evaluate tests)."""

from __future__ import annotations

from pathlib import Path

from tasks.config.model import ModelConfig


def reference_state(m: ModelConfig, seed: int = 0) -> dict:
    """The seeded initial weights of the config's family, by reference name."""
    from tasks.models import get_family

    return get_family(m.family).Reference(m, seed).state_dict()


def write_base_weights(m: ModelConfig, directory: Path, seed: int = 3) -> Path:
    """Base weights for a LoRA run to start from (seeded, as a legacy single file); returns the file."""
    import torch

    from tasks.base.model_files import LEGACY_FILE

    directory.mkdir(parents=True, exist_ok=True)
    torch.save(reference_state(m, seed), directory / LEGACY_FILE)
    return directory / LEGACY_FILE


def write_layer_files(ckpt: Path, m: ModelConfig, state: dict) -> dict:
    """DeepSpeed's per-layer files (`layer_LL-model_00-model_states.pt`, as tp=1 writes them) holding `state`
    (reference names); returns `state`."""
    import torch

    from tasks.models.weights import layer_prefix

    ckpt.mkdir(parents=True, exist_ok=True)
    for index in range(m.n_layers + 2):
        prefix = layer_prefix(index, m.n_layers) + "."
        layer = {n[len(prefix):]: t.clone() for n, t in state.items() if n.startswith(prefix)}
        torch.save(layer, ckpt / f"layer_{index:02d}-model_00-model_states.pt")
    return state


def commit_reference(cfg, run, state: dict, step: int) -> Path:
    """Commit `state` (reference names) as the trainer commits a tp=1 checkpoint of `run` at `step`."""
    from tasks.train import checkpoint as ck

    root = ck.ckpt_root(cfg.train.output_dir)
    tag = ck.tag_for(step)
    write_layer_files(root / f"tmp-{tag}", cfg.model, state)
    return ck.finalize(root, tag, ck.make_marker(cfg, run, tag, step, 1), keep_last=5)


def reference_checkpoint(cfg, init=None) -> tuple:
    """(run, checkpoint): a synthetic dataset at `data.source_url` and the single-process reference loop's
    weights after `train.steps` steps, committed as that run's checkpoint (no ranks started); `init`: the
    StartingWeights the run names (default: scratch)."""
    from tasks.data.synthetic import make_data
    from tasks.runs.identity import for_dataset, identity
    from tasks.train.reference import train_reference

    manifest = make_data(cfg.data.source_url, name="eval-test", n_train_shards=2, tokens_per_shard=8192, seed=3)
    run = for_dataset(cfg, cfg.data.source_url) if init is None else identity(cfg, manifest.hash, init)
    state = train_reference(cfg, cfg.data.source_url).model.state_dict()
    return run, commit_reference(cfg, run, state, cfg.train.steps)
