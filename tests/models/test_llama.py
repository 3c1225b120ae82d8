"""The Llama family against transformers: same logits, same names, same counts; bad configs named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tasks.base.errors import ConfigError, InvalidInputError
from tasks.base.layout import Coord, Layout
from tasks.config.model import ModelConfig, RopeScaling
from tasks.models import family_for_architecture, get_family
from tasks.models.common.rotary import inv_freq, rope_attention_scale
from tasks.models.parallel import TPGroup

llama = get_family("llama")

SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=128, rms_norm_eps=1e-5)
# original_max_position_embeddings=64 puts head_dim 16's frequencies in all three llama3 bands.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# YaRN (Qwen long context): factor 4 over a 32-position pretraining context; the Qwen2 one with every yarn key.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
YARN_ALL = {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2}
VARIANTS = {  # (LlamaConfig mutates the rope_scaling dict it is given: pass a copy)
    "llama3-untied": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, rope_theta=500000.0, rope_scaling=dict(LLAMA3))),
    "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen2-qkv-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES, rope_theta=1e6)),
    "qwen2-yarn": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES, rope_theta=1e4, rope_scaling=dict(YARN_ALL))),
    "qwen3-yarn-tied": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=32, rope_theta=1e4,
                                                            tie_word_embeddings=True, rope_scaling=dict(YARN))),
    # The families on Llama's blocks: QK-norm with a head_dim that is not hidden/heads (tied, as small Qwen3s
    # are), and a sliding window shorter than the test sequence (24 tokens), so the band matters.
    "qwen3-qk-norm-tied": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=32, rope_theta=1e6,
                                                               tie_word_embeddings=True)),
    "mistral-sliding-window": lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=8, head_dim=None)),
    # Gemma 3: sliding (window 8 < 24 tokens, local rotary base) and global layers alternating, its own scale.
    "gemma3-sliding-global-tied": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SIZES, head_dim=32, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24,
        rope_theta=1e6, rope_local_base_freq=1e4)),
    # Gemma 3 4B+: linear rope scaling (factor 8) on the global layers only, the sliding ones unscaled.
    "gemma3-linear-rope-tied": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SIZES, head_dim=32, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    # Gemma 2: no QK-norm, one base, attention scores and logits soft-capped (caps small enough to bite).
    "gemma2-softcap-tied": lambda: Gemma2ForCausalLM(Gemma2Config(
        **SIZES, head_dim=32, sliding_window=8, query_pre_attn_scalar=24, rope_theta=1e6,
        attn_logit_softcapping=0.5, final_logit_softcapping=1.0)),
}
# variant prefix -> family; else llama
FAMILY_OF = {"qwen3": "qwen3", "mistral": "mistral", "gemma3": "gemma3", "gemma2": "gemma2"}


def _hf_model(variant: str) -> torch.nn.Module:
    """A transformers model with every tensor random (norms and biases too, so each one is exercised)."""
    torch.manual_seed(0)
    hf = VARIANTS[variant]().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return hf


def _config_json(hf: torch.nn.Module) -> dict:
    """What `save_pretrained` writes as config.json."""
    return {**json.loads(hf.config.to_json_string()), "architectures": [type(hf).__name__]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_matches_transformers_both_ways(variant: str, tmp_path: Path) -> None:
    hf = _hf_model(variant)
    family = family_for_architecture([type(hf).__name__])  # each family on the same yardstick
    m = ModelConfig(**family.model_fields_from_hf(_config_json(hf)))
    assert m.family == family.name == FAMILY_OF.get(variant.split("-")[0], "llama")
    assert m.tie_embeddings == variant.endswith("-tied") and m.qkv_bias == variant.startswith("qwen2")
    assert m.qk_norm == (family.name in ("qwen3", "gemma3"))
    assert m.sliding_window == (8 if family.name in ("mistral", "gemma3", "gemma2") else None)
    if family.name.startswith("gemma"):  # layers 2 and 4 global, the others sliding (Gemma 3: the local base)
        assert (m.sliding_window_pattern, m.query_pre_attn_scalar) == (2, 24)
        assert m.rope_local_base_freq == (1e4 if family.name == "gemma3" else None)
        assert (m.attn_logit_softcapping, m.final_logit_softcapping) == ((0.5, 1.0) if family.name == "gemma2"
                                                                         else (None, None))
    rope = {"llama3-untied": LLAMA3, "gemma3-linear-rope-tied": {"rope_type": "linear", "factor": 8.0},
            "qwen2-yarn": YARN_ALL, "qwen3-yarn-tied": YARN}
    assert (m.rope_scaling and m.rope_scaling.model_dump(exclude_none=True)) == rope.get(variant)
    hf_state = hf.state_dict()
    if m.tie_embeddings:  # one tensor under two names; transformers' safetensors keep only the embedding
        assert hf_state["lm_head.weight"].data_ptr() == hf_state["model.embed_tokens.weight"].data_ptr()
        del hf_state["lm_head.weight"]
    assert {n: tuple(t.shape) for n, t in hf_state.items()} == {family.hf_name(n): s for n, s in
                                                                  family.full_shapes(m).items()}

    reference = family.Reference(m, seed=1).eval()
    reference.load_state_dict({family.ref_name(n): t for n, t in hf_state.items()}, strict=True)
    tokens = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(reference(tokens), expected, rtol=0, atol=1e-5)

    # Out again: our config.json loads in transformers as the right class and our weights give the same logits.
    exported = family.hf_config(m, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(exported))
    back = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32).eval()
    assert type(back) is type(hf)
    back.load_state_dict({family.hf_name(n): t for n, t in reference.state_dict().items()}, strict=not m.tie_embeddings)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=0, atol=1e-5)
    assert ModelConfig(**family.model_fields_from_hf(exported)) == m
    assert ModelConfig(**family.model_fields_from_hf(json.loads(back.config.to_json_string())
                                                    | {"architectures": exported["architectures"]})) == m


def test_rope_scaling_parameters_reach_the_frequencies() -> None:
    m = ModelConfig(family="llama", d_model=64, n_heads=4, rope_theta=500000.0, rope_scaling=LLAMA3)
    plain = inv_freq(m.model_copy(update={"rope_scaling": None}))
    scaled = inv_freq(m)
    assert torch.equal(scaled[:1], plain[:1])  # high frequencies untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8.0)  # low frequencies divided by factor
    assert ((scaled < plain) & (scaled > plain / 8.0)).any()  # a smoothed middle band
    # YaRN: the fastest rotations extrapolated (as they were), the slowest interpolated (/ factor), cos and sin
    # scaled by 0.1 ln(factor) + 1 unless attention_factor says otherwise.
    yarn = m.model_copy(update={"rope_scaling": RopeScaling(**YARN), "rope_theta": 1e4})
    plain = inv_freq(yarn.model_copy(update={"rope_scaling": None}))
    scaled = inv_freq(yarn)
    assert torch.equal(scaled[0], plain[0]) and torch.allclose(scaled[-1], plain[-1] / 4.0)
    assert rope_attention_scale(yarn) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope_attention_scale(yarn.model_copy(update={"rope_scaling": RopeScaling(**YARN_ALL)})) == 1.2
    assert rope_attention_scale(m) == 1.0


@pytest.mark.parametrize("tied", [False, True])
def test_counts_equal_the_real_modules(tied: bool) -> None:
    m = ModelConfig(family="llama", vocab_size=512, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96,
                    tie_embeddings=tied, qkv_bias=not tied)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    reference = llama.Reference(m, seed=0)
    hf_cls = Qwen2ForCausalLM if m.qkv_bias else LlamaForCausalLM
    hf_config_cls = Qwen2Config if m.qkv_bias else LlamaConfig
    hf = hf_cls(hf_config_cls(**llama.hf_config(m, dtype="float32")))
    assert llama.total_params(m) == numel(reference) == numel(hf)
    c = llama.param_counts(m)  # pp=1: a tied head's matrix is the embedding itself, one tensor
    assert numel(reference) == c.embedding + m.n_layers * c.block + c.head - (c.embedding if tied else 0)
    for tp in (1, 2):
        for rank in range(tp):
            group = TPGroup(None, Layout(tp=tp), Coord(tp=rank))
            embed, head = llama.Embedding(m, 0, group), llama.Head(m, 0, group)
            counts = llama.param_counts(m, Layout(tp=tp))
            assert counts.embedding == numel(embed)
            assert counts.block == numel(llama.TransformerBlock(m, 2, 0, group))
            # Tied: the last stage holds its own copy of the embedding (DeepSpeed's tied module).
            assert counts.head == numel(head) + (numel(embed) if tied else 0)
    # N: no embedding lookup, but the LM-head matmul (for a tied model: the one shared matrix) counts.
    matmul_params = llama.total_params(m) - (0 if tied else m.vocab_size * m.d_model)
    assert llama.flops_per_token(m) == 6 * matmul_params + 12 * m.n_layers * m.seq_len * m.d_model


@pytest.mark.parametrize("tied", [False, True])
def test_tp_slices_reassemble_to_the_reference(tied: bool) -> None:
    m = ModelConfig(family="llama", vocab_size=256, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                    tie_embeddings=tied, qkv_bias=True)
    full = llama.Reference(m, seed=3).state_dict()
    shards = [llama.Reference(m, seed=3, tp=TPGroup(None, Layout(tp=2), Coord(tp=r))).state_dict() for r in range(2)]
    assert set(full) == set(llama.full_shapes(m)) == set(shards[0])
    for name, tensor in full.items():
        pieces = [s[name] for s in shards]
        assert torch.equal(llama.unshard(m, name, pieces), tensor), name
        spec = llama.shard_spec(m, name, Layout(tp=2), Coord(tp=1))
        if spec is None:
            assert name.endswith("norm.weight") and torch.equal(pieces[0], tensor)
        else:
            assert torch.equal(pieces[1], tensor.index_select(*spec))
    assert llama.shard_spec(m, "embed.tok.weight", Layout(tp=2), Coord(tp=1))[1].tolist() == list(range(128, 256))


def test_names_map_both_ways() -> None:
    assert llama.hf_name("blocks.3.attn.q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert llama.ref_name("model.layers.3.self_attn.q_proj.weight") == "blocks.3.attn.q.weight"
    assert llama.hf_name("head.out.weight") == "lm_head.weight"
    assert llama.ref_name("model.norm.weight") == "head.norm.weight"
    with pytest.raises(ValueError, match="rotary_emb"):
        llama.ref_name("model.layers.0.self_attn.rotary_emb.inv_freq")
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.qkv\.weight"):
        llama.hf_name("blocks.0.attn.qkv.weight")


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValidationError, match=r"model\.dropout"):
        ModelConfig(family="llama", dropout=0.1)
    ModelConfig(family="gpt", dropout=0.1)
    with pytest.raises(ValidationError, match=r"model\.rope_theta \(5\.0\) is not supported by model\.family 'gpt'"):
        ModelConfig(family="gpt", rope_theta=5.0)  # refused, never silently ignored
    with pytest.raises(ValidationError, match=r"model\.rope_scaling\.high_freq_factor"):
        ModelConfig(family="llama", rope_scaling={**LLAMA3, "high_freq_factor": 0.5})
    m = ModelConfig(family="llama", vocab_size=250)
    with pytest.raises(ConfigError, match=r"model\.vocab_size \(250\) must be divisible by parallel\.tp \(4\)"):
        llama.Embedding(m, 0, TPGroup(None, Layout(tp=4)))
    with pytest.raises(ConfigError, match=r"model\.vocab_size"):
        llama.param_counts(m, Layout(tp=4))

    good = _config_json(_hf_model("llama3-untied"))
    cases = {
        "architectures": {"architectures": ["GPT2LMHeadModel"]},
        "attention_bias": {"attention_bias": True},
        "hidden_act": {"hidden_act": "gelu"},
        "mlp_bias": {"mlp_bias": True},
        "rope_scaling.rope_type": {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
        "rope_scaling: yarn needs original_max_position_embeddings": {
            "rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "rope_scaling.mscale": {"rope_parameters": None, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7}},
        "hidden_size": {"hidden_size": None},
    }
    for key, change in cases.items():
        bad = {k: v for k, v in {**good, **change}.items() if v is not None}
        with pytest.raises(InvalidInputError, match=rf"config\.json.*{key}"):
            llama.model_fields_from_hf(bad)
