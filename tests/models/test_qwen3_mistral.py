"""Qwen3 and Mistral brought in as a team would: the family comes from config.json, the plan counts the model
transformers builds, the sliding window is honoured (and matters), and what we do not implement is refused.

Logits parity (tp=1) and the export round trip live with the other families in test_llama.py; tp=2 in
test_llama_tp.py; import -> 3D training -> export -> transformers in test_hf_import_export.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tasks import REPO_ROOT
from tasks.cli.plan import main as plan_main
from tasks.config.model import ModelConfig
from tasks.models import get_family
from tasks.models.common.blocks import sliding_mask

ROOT = REPO_ROOT
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=256, max_position_embeddings=64)
MODELS = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=32, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=8)),
    # Gemma 3 (262k-word vocabularies need uint32 tokens; the plan counts a tied 512-word one): layer 1 slides.
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SIZES, head_dim=32, sliding_window=8,
                                                         sliding_window_pattern=2, query_pre_attn_scalar=32)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SIZES, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                                                     attn_logit_softcapping=0.5, final_logit_softcapping=1.0)),
}
WINDOWS = {"mistral": [8, 8], "gemma3": [8, None], "gemma2": [8, None]}  # each layer's window (None: global)


def _save(dest: Path, family: str, **config_changes: Any) -> tuple[Path, torch.nn.Module]:
    """A random model saved as transformers writes it, its config.json then edited as a team's might be."""
    torch.manual_seed(0)
    hf = MODELS[family]()
    hf.save_pretrained(dest)
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dest, hf


def _plan(tmp_path: Path, pretrained: Path, capsys: pytest.CaptureFixture[str], **model: Any) -> tuple[int, str]:
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    doc["model"] = {"pretrained": str(pretrained), "seq_len": 32, **model}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = plan_main([str(path), "--json", "--device", "cpu"])
    out = capsys.readouterr()
    return code, out.out if code == 0 else out.err


@pytest.mark.parametrize("family", list(MODELS))
def test_a_team_plans_its_model_and_the_plan_counts_what_transformers_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str
) -> None:
    hf_dir, hf = _save(tmp_path / "hf", family)
    code, out = _plan(tmp_path, hf_dir, capsys)
    assert code == 0, out
    report = json.loads(out[out.index("{\n"):])  # past DeepSpeed's accelerator notice (transformers imported it)
    assert report["model_family"] == family  # from config.json's architectures, no model.family in the YAML
    assert report["params_total"] == hf.num_parameters()
    serving = report["serving"]
    context = serving["context"]
    held = sum(min(context, w or context) for w in WINDOWS.get(family, [None, None]))  # a sliding layer keeps W
    per_layer = serving["kv_cache_bytes_per_token"] // 2
    assert serving["kv_cache_bytes"] == per_layer * serving["concurrency"] * held
    m = ModelConfig(**get_family(family).model_fields_from_hf(json.loads((hf_dir / "config.json").read_text())))
    assert serving["kv_cache_bytes_per_token"] == 2 * m.n_layers * m.kv_heads * m.head_dim * 2  # bf16 K and V


def test_the_sliding_window_is_what_makes_mistral_match() -> None:
    torch.manual_seed(0)
    hf = MODELS["mistral"]().eval()
    mistral = get_family("mistral")
    m = ModelConfig(**mistral.model_fields_from_hf({**hf.config.to_dict(), "architectures": ["MistralForCausalLM"]}))
    assert m.sliding_window == 8
    state = {mistral.ref_name(n): t for n, t in hf.state_dict().items()}
    tokens = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > W
    with torch.no_grad():
        expected = hf(tokens).logits
        ours = {}
        for window in (8, None):
            ref = mistral.Reference(m.model_copy(update={"sliding_window": window}), seed=None).eval()
            ref.load_state_dict(state, strict=True)
            ours[window] = ref(tokens)
    torch.testing.assert_close(ours[8], expected, rtol=0, atol=1e-5)
    assert (ours[None] - expected).abs().max() > 1e-3  # full attention would not match: the window is exercised
    torch.testing.assert_close(ours[None][:, :8], expected[:, :8], rtol=0, atol=1e-5)  # within W they agree
    # The band: query 10 sees keys 3..10; the mask is built once per sequence length, not per step.
    mask = sliding_mask(24, 8, torch.device("cpu"))
    assert mask[10].nonzero().flatten().tolist() == list(range(3, 11))
    assert sliding_mask(24, 8, torch.device("cpu")) is mask


def test_the_soft_caps_are_what_make_gemma2_match() -> None:
    torch.manual_seed(0)
    hf = MODELS["gemma2"]().eval()
    with torch.no_grad():  # transformers' 0.02 init leaves scores far below the cap: make them reach it
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
    gemma2 = get_family("gemma2")
    m = ModelConfig(**gemma2.model_fields_from_hf({**hf.config.to_dict(), "architectures": ["Gemma2ForCausalLM"]}))
    state = {gemma2.ref_name(n): t for n, t in hf.state_dict().items() if n != "lm_head.weight"}  # tied
    tokens = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > W
    with torch.no_grad():
        expected = hf(tokens).logits
        ours = {}
        for caps in ((0.5, 1.0), (None, 1.0), (0.5, None)):
            ref = gemma2.Reference(m.model_copy(update={"attn_logit_softcapping": caps[0],
                                                        "final_logit_softcapping": caps[1]}), seed=None).eval()
            ref.load_state_dict(state, strict=True)
            ours[caps] = ref(tokens)
    torch.testing.assert_close(ours[(0.5, 1.0)], expected, rtol=0, atol=1e-5)
    assert expected.abs().max() < 1.0  # the final cap bounds the logits
    for uncapped in ((None, 1.0), (0.5, None)):  # each cap is exercised
        assert (ours[uncapped] - expected).abs().max() > 1e-3, uncapped


def test_linear_rope_scaling_reaches_only_gemma3s_global_layers_and_changes_the_logits() -> None:
    """Gemma 3 4B+ set `rope_scaling: {rope_type: linear, factor: 8}`: the global layers' frequencies / 8, the
    sliding layers' (rope_local_base_freq) untouched; parity with transformers is in test_llama.py."""
    from tasks.models.common.rotary import inv_freq

    gemma3 = get_family("gemma3")
    m = ModelConfig(family="gemma3", vocab_size=256, seq_len=32, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                    d_ff=96, head_dim=32, qk_norm=True, tie_embeddings=True, sliding_window=8,
                    sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                    rope_scaling={"rope_type": "linear", "factor": 8.0})
    plain = m.model_copy(update={"rope_scaling": None})
    scaled_model, plain_model = gemma3.Reference(m, seed=0), gemma3.Reference(plain, seed=0)
    sliding, global_ = (block.attn.inv_freq for block in scaled_model.blocks)
    assert torch.equal(sliding, inv_freq(plain, 1e4))
    assert torch.equal(global_, inv_freq(plain) / 8.0)
    tokens = torch.randint(0, m.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (scaled_model(tokens) - plain_model(tokens)).abs().max() > 1e-4  # the scaling is exercised
    assert gemma3.hf_config(m)["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}  # what transformers reads


@pytest.mark.parametrize(("family", "changes", "model", "message"), [
    ("qwen3", {"architectures": ["DeepseekV3ForCausalLM"]}, {},
     r"architectures \['DeepseekV3ForCausalLM'\] is not supported yet \(multi-head latent attention, .*\); "
     r"mixtures of experts supported: MixtralForCausalLM, Qwen3MoeForCausalLM"),
    ("qwen3", {"architectures": ["BertForMaskedLM"]}, {},
     r"architectures \['BertForMaskedLM'\] is not supported; known: .*LlamaForCausalLM, MistralForCausalLM, "
     r"MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ("qwen3", {"use_sliding_window": True}, {},
     r"config\.json use_sliding_window = True is not supported by model\.family 'qwen3'"),
    ("qwen3", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, {},
     r"config\.json rope_scaling\.rope_type 'longrope' is not supported by model\.family 'qwen3' "
     r"\(supported: default, llama3, yarn\)"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                "mscale_all_dim": 1.0}}, {},
     r"config\.json rope_scaling\.mscale_all_dim = 1\.0 is not supported \(yarn with factor, "
     r"original_max_position_embeddings, beta_fast, beta_slow, attention_factor only\)"),
    ("mistral", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {},
     r"rope_type 'yarn' is not supported by model\.family 'mistral' \(supported: default, llama3\)"),
    ("mistral", {"attention_bias": True}, {}, r"config\.json attention_bias = True is not supported"),
    ("qwen3", {}, {"family": "llama"},
     r"model\.family 'llama' contradicts config\.json architectures \['Qwen3ForCausalLM'\] \(model\.family 'qwen3'\)"),
    ("mistral", {}, {"sliding_window": 16}, r"model\.sliding_window is 16 here but 8 in"),
    ("gemma3", {"use_bidirectional_attention": True}, {},
     r"config\.json use_bidirectional_attention = True is not supported by model\.family 'gemma3'"),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_parameters": None}, {},
     r"config\.json rope_scaling\.rope_type 'linear' is not supported by model\.family 'gemma2' "
     r"\(supported: default\)"),
    ("gemma3", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}, "rope_parameters": None}, {},
     r"config\.json rope_scaling\.rope_type 'yarn' is not supported by model\.family 'gemma3' "
     r"\(supported: default, linear\)"),
    ("gemma3", {"layer_types": ["full_attention", "sliding_attention"]}, {},
     r"config\.json layer_types: only every Nth layer global is supported"),
    ("gemma3", {"hidden_activation": "gelu"}, {}, r"config\.json hidden_activation = 'gelu' is not supported"),
    ("gemma3", {}, {"query_pre_attn_scalar": 16}, r"model\.query_pre_attn_scalar is 16 here but"),
    ("qwen3", {}, {"sliding_window_pattern": 2},
     r"model\.sliding_window_pattern \(2\) is not supported by model\.family 'qwen3' \(its options: "),
])
def test_what_we_do_not_implement_is_refused_at_config_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str, changes: dict, model: dict, message: str
) -> None:
    hf_dir, _ = _save(tmp_path / "hf", family, **changes)
    code, err = _plan(tmp_path, hf_dir, capsys, **model)
    assert code == 2
    assert re.search(message, err), err
    assert str(tmp_path / "job.yaml") in err  # the file at fault is named


def test_flops_and_attention_memory_count_the_window_and_head_dim() -> None:
    from tasks.config.schema import JobConfig
    from tasks.plan.budget import _activation_bytes_per_layer

    base = dict(vocab_size=256, seq_len=32, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96)
    for m in (ModelConfig(family="mistral", sliding_window=8, **base),
              ModelConfig(family="qwen3", qk_norm=True, head_dim=32, tie_embeddings=True, **base)):
        family = get_family(m.family)
        matmul = family.total_params(m) - (0 if m.tie_embeddings else m.vocab_size * m.d_model)  # no lookup
        span = 8 if m.sliding_window else 32  # a query's scores: the window, not the sequence
        assert family.flops_per_token(m) == 6 * matmul + 12 * m.n_layers * span * m.n_heads * m.head_dim
    # Materialized attention scores are s x W per head under a window, s x s without one.
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    scores = {}
    for window in (8, None):
        doc["model"] = {**base, "family": "mistral", "sliding_window": window}
        cfg = JobConfig.model_validate(doc)
        scores[window] = (_activation_bytes_per_layer(cfg, 2, 1, "materialized")
                          - _activation_bytes_per_layer(cfg, 2, 1, "sdpa"))
    b = doc["train"]["micro_batch_size"]
    assert scores[None] - scores[8] == 2 * 4 * 32 * (32 - 8) * b


def test_gemma_flops_count_each_layer_span_and_soft_capped_scores_are_materialized() -> None:
    from tasks.config.schema import JobConfig
    from tasks.plan.budget import _activation_bytes_per_layer

    base = dict(vocab_size=256, seq_len=32, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96,
                sliding_window=8, sliding_window_pattern=2, tie_embeddings=True)
    for m in (ModelConfig(family="gemma3", qk_norm=True, head_dim=32, **base),
              ModelConfig(family="gemma2", attn_logit_softcapping=50.0, **base)):
        family = get_family(m.family)
        matmul = family.total_params(m)  # tied: the logits matmul counts the embedding once
        spans = 2 * 8 + 2 * 32  # layers 1 and 3 slide (W), 2 and 4 see the whole sequence
        assert family.flops_per_token(m) == 6 * matmul + 12 * spans * m.n_heads * m.head_dim
    # Soft-capped scores cannot take SDPA's fused path: the plan holds them whatever attention it is told.
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    for cap, same in ((50.0, True), (None, False)):
        doc["model"] = {**base, "family": "gemma2", "attn_logit_softcapping": cap}
        cfg = JobConfig.model_validate(doc)
        assert (_activation_bytes_per_layer(cfg, 2, 1, "sdpa")
                == _activation_bytes_per_layer(cfg, 2, 1, "materialized")) == same
