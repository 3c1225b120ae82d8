"""torchrun worker (2 gloo ranks): the Llama-style pipeline layers at tp=2 against the tp=1 Reference.

Launched by tests/models/test_llama_tp.py. Each rank builds the layers through
`pipeline_layers` inside a one-stage PipelineModule (how the trainer builds
them; no engine), runs one forward and backward, and writes `<out>/rank<R>.json`
with what it holds and how far it is from the Reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from tasks.base.comm_ops import load_shm_op
from tasks.base.layout import Layout
from tasks.config.model import ModelConfig
from tasks.models import get_family
from tasks.models.grid import Grid, build_grid
from tasks.models.parallel import vocab_parallel_argmax
from tasks.models.shapes import TRAINING_PARTITION
from tasks.models.weights import local_named_params

SEED = 5
# Untied with llama3 rope scaling and the qkv bias; tied with plain rope; Qwen3 (tied, QK-norm, its own
# head_dim, YaRN); Mistral with a window shorter than the sequence; Gemma 3 (a sliding then a global layer);
# Gemma 2 untied, its scores and logits soft-capped.
CONFIGS = {
    "untied": dict(family="llama", vocab_size=512, seq_len=16, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                   d_ff=128, rope_theta=500000.0, qkv_bias=True,
                   rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
    "tied": dict(family="llama", vocab_size=512, seq_len=16, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                 d_ff=128, tie_embeddings=True),
    "qwen3": dict(family="qwen3", vocab_size=512, seq_len=16, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                  d_ff=128, head_dim=24, qk_norm=True, tie_embeddings=True, rope_theta=1e6,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "mistral": dict(family="mistral", vocab_size=512, seq_len=16, n_layers=2, d_model=64, n_heads=4,
                    n_kv_heads=2, d_ff=128, sliding_window=4),
    "gemma3": dict(family="gemma3", vocab_size=512, seq_len=16, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                   d_ff=128, head_dim=24, qk_norm=True, tie_embeddings=True, rope_theta=1e6, sliding_window=4,
                   sliding_window_pattern=2, rope_local_base_freq=1e4, query_pre_attn_scalar=16),
    "gemma2": dict(family="gemma2", vocab_size=512, seq_len=16, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                   d_ff=128, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=16,
                   attn_logit_softcapping=0.5, final_logit_softcapping=1.0),
}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def check(m: ModelConfig, grid: Grid) -> dict[str, Any]:
    from deepspeed.pipe import PipelineModule

    family = get_family(m.family)
    tp = grid.tp
    module = PipelineModule(layers=family.pipeline_layers(m, SEED, tp), loss_fn=family.make_loss_fn(tp),
                            topology=grid.topology, partition_method=TRAINING_PARTITION)
    reference = family.Reference(m, SEED)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=g)
    labels = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=g)

    local = module(tokens)
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    tdist.all_gather(pieces, local.detach().contiguous(), group=tp.group)
    loss = family.make_loss_fn(tp)(local, labels)
    loss.backward()

    full = reference(tokens)
    top = vocab_parallel_argmax(local.detach(), tp, m.vocab_size)  # the benchmarks' greedy token, from slices
    ref_loss = F.cross_entropy(full.reshape(-1, m.vocab_size), labels.reshape(-1))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    params = dict(local_named_params(module))
    lm_matrix = "embed.tok.weight" if m.tie_embeddings else "head.out.weight"
    grads = {}
    # A replicated QK-norm weight sees only this rank's heads: its gradient must be summed over TP.
    for name in ("blocks.1.attn.q.weight", "blocks.0.mlp.down.weight", lm_matrix,
                 *(("blocks.0.attn.q_norm.weight", "blocks.1.attn.k_norm.weight") if m.qk_norm else ())):
        spec = family.shard_spec(m, name, tp.layout, tp.coord)
        want = ref_grads[name] if spec is None else ref_grads[name].index_select(*spec)
        grads[name] = {"diff": _max_diff(params[name].grad, want), "scale": want.abs().max().item()}
    return {
        "shapes": {n: list(p.shape) for n, p in params.items()},
        "logits": _max_diff(torch.cat(pieces, dim=-1), full.detach()),
        "local_logits_shape": list(local.shape),
        "argmax": torch.equal(top, full.detach().argmax(dim=-1)),
        "loss": abs(loss.item() - ref_loss.item()),
        "grads": grads,
    }


def main() -> None:
    import deepspeed

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    load_shm_op()  # as a rank does: the venv's prebuilt op, never a fresh build in the user's cache
    deepspeed.init_distributed(dist_backend="gloo")
    grid = build_grid(Layout(tp=tdist.get_world_size()))
    report = {name: check(ModelConfig(**fields), grid) for name, fields in CONFIGS.items()}
    (args.out / f"rank{tdist.get_rank()}.json").write_text(json.dumps(report))
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
