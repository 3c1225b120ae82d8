"""The model-family protocol: each registered family answers it consistently, unknown names are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tasks.base.errors import ConfigError, InvalidInputError
from tasks.cli.plan import main as plan_main
from tasks.config.model import ModelConfig
from tasks.families import FAMILIES
from tasks.models import family_for_architecture, get_family
from tasks.models.family import ModelFamily
from tasks.models.resolve import load_config

ROOT = REPO_ROOT
SIZES = dict(vocab_size=96, seq_len=16, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48)
CASES = {
    "gpt": ModelConfig(family="gpt", **SIZES),
    "llama": ModelConfig(family="llama", **SIZES),
    "llama-tied-qkv-bias": ModelConfig(family="llama", tie_embeddings=True, qkv_bias=True, **SIZES),
    "qwen3-tied-head-dim": ModelConfig(family="qwen3", tie_embeddings=True, qk_norm=True, head_dim=12, **SIZES),
    "mistral-sliding-window": ModelConfig(family="mistral", sliding_window=4, **SIZES),
    "mistral-full-attention": ModelConfig(family="mistral", **SIZES),
    "gemma3-sliding-global": ModelConfig(family="gemma3", tie_embeddings=True, qk_norm=True, head_dim=12,
                                         sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=16,
                                         rope_theta=1e6, rope_local_base_freq=1e4, **SIZES),
    "gemma2-softcap-untied": ModelConfig(family="gemma2", sliding_window=4, sliding_window_pattern=2,
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **SIZES),
    # Layer 0 dense (mlp_only_layers), layer 1 routed, layer 2 dense (decoder_sparse_step): blocks differ.
    "qwen3_moe-dense-layers": ModelConfig(family="qwen3_moe", qk_norm=True, head_dim=12, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                                          decoder_sparse_step=2, mlp_only_layers=(0,), **SIZES),
    "mixtral-sliding-window-aux": ModelConfig(family="mixtral", sliding_window=4, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.01,
                                              **SIZES),
}


def test_every_registered_family_is_tested() -> None:
    assert {m.family for m in CASES.values()} == set(FAMILIES)  # each states its options (its spec)


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_states_what_its_model_holds(case: str) -> None:
    m = CASES[case]
    family = get_family(m.family)
    assert isinstance(family, ModelFamily) and family.name == m.family
    state = family.Reference(m, seed=0).state_dict()
    # exact counts: the stated shapes are the built parameters, tensor by tensor
    assert {n: tuple(t.shape) for n, t in state.items()} == family.full_shapes(m)
    assert family.total_params(m) == sum(t.numel() for t in state.values())
    c = family.param_counts(m)
    tied = m.vocab_size * m.d_model if m.family != "gpt" and m.tie_embeddings else 0  # counted on both ends
    assert c.embedding + c.blocks(0, m.n_layers) + c.head - tied == family.total_params(m)
    # HF names round trip, and config.json in/out gives back the same model and family
    assert [family.ref_name(family.hf_name(n)) for n in state] == list(state)
    exported = json.loads(json.dumps(family.hf_config(m, dtype="float32")))
    assert family_for_architecture(exported["architectures"]) is family
    assert ModelConfig(**family.model_fields_from_hf(exported)) == m


def test_unknown_family_or_architecture_is_refused_naming_the_field_and_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.family 'bert' is unknown; known: gemma2, gemma3, gpt, llama, "
                                         r"mistral, mixtral, qwen3, qwen3_moe"):
        get_family("bert")
    with pytest.raises(InvalidInputError, match=r"config\.json architectures \['BertForMaskedLM'\] is not "
                                                r"supported; known: .*LlamaForCausalLM.*RetrainerGPT"):
        family_for_architecture(["BertForMaskedLM"])
    with pytest.raises(InvalidInputError, match=r"config\.json architectures None"):
        family_for_architecture(None)
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    doc["model"]["family"] = "bert"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"model\.family 'bert' is unknown; known: gemma2, gemma3, gpt, llama, "
                                          r"mistral, mixtral, qwen3, qwen3_moe"):
        load_config(path)


def test_a_config_without_family_plans_as_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user leaves `family` out of the demo config: it is the Llama model, and the plan counts it as one."""
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    del doc["model"]["family"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert plan_main([str(path), "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = load_config(path).model
    assert report["model_family"] == m.family == "llama"
    assert report["params_total"] == get_family("llama").total_params(m) == 229952


# (family, an option it cannot express, the refusal): named `model.<field>` with the family and what it supports.
REFUSED = [
    ("gpt", {"tie_embeddings": True}, r"model\.tie_embeddings \(True\) is not supported by model\.family 'gpt' "
                                      r"\(its options: dropout\)"),
    ("gpt", {"rms_norm_eps": 1e-6}, r"model\.rms_norm_eps \(1e-06\) is not supported by model\.family 'gpt'"),
    ("llama", {"dropout": 0.1}, r"model\.dropout \(0\.1\) is not supported by model\.family 'llama' \(its options: "
                                r"rope_theta, rms_norm_eps, tie_embeddings, head_dim, qkv_bias, rope_scaling\)"),
    ("llama", {"qk_norm": True}, r"model\.qk_norm \(True\) is not supported by model\.family 'llama'"),
    ("llama", {"sliding_window": 8}, r"model\.sliding_window \(8\) is not supported by model\.family 'llama'"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     r"model\.rope_scaling\.rope_type 'linear' is not supported by model\.family 'llama' \(supported: default, "
     r"llama3, yarn\)"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"model\.rope_scaling\.rope_type"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"model\.rope_scaling\.original_max_position_embeddings is required for rope_type 'yarn'"),
    ("mistral", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     r"model\.rope_scaling\.rope_type 'yarn' is not supported by model\.family 'mistral' \(supported: default, "
     r"llama3\)"),
    ("qwen3", {}, r"model\.qk_norm must be true for model\.family 'qwen3'"),
    ("qwen3", {"qk_norm": True, "qkv_bias": True}, r"model\.qkv_bias \(True\) is not supported by model\.family "
                                                   r"'qwen3'"),
    ("qwen3", {"qk_norm": True, "sliding_window": 8}, r"model\.sliding_window \(8\) is not supported by "
                                                      r"model\.family 'qwen3'"),
    ("mistral", {"qk_norm": True}, r"model\.qk_norm \(True\) is not supported by model\.family 'mistral'"),
    ("mistral", {"query_pre_attn_scalar": 16}, r"model\.query_pre_attn_scalar \(16\) is not supported by "
                                               r"model\.family 'mistral'"),
    ("gemma3", {"qk_norm": True, "qkv_bias": True}, r"model\.qkv_bias \(True\) is not supported by model\.family "
                                                    r"'gemma3'"),
    ("gemma3", {"qk_norm": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     r"model\.rope_scaling\.rope_type 'llama3' is not supported by model\.family 'gemma3' \(supported: default, "
     r"linear\)"),
    ("gemma2", {"qk_norm": True}, r"model\.qk_norm \(True\) is not supported by model\.family 'gemma2'"),
    ("gemma2", {"rope_local_base_freq": 1e4}, r"model\.rope_local_base_freq \(10000\.0\) is not supported by "
                                              r"model\.family 'gemma2'"),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     r"model\.rope_scaling\.rope_type 'linear' is not supported by model\.family 'gemma2' \(supported: default\)"),
    ("gpt", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     r"model\.rope_scaling\.rope_type 'linear' is not supported by model\.family 'gpt' \(supported: default\)"),
    ("llama", {"num_experts": 8}, r"model\.num_experts \(8\) is not supported by model\.family 'llama'"),
    ("qwen3_moe", {"qk_norm": True}, r"model\.num_experts and model\.num_experts_per_tok are required for "
                                     r"model\.family 'qwen3_moe'"),
    ("qwen3_moe", {"qk_norm": True, "num_experts": 4, "num_experts_per_tok": 8},
     r"model\.num_experts_per_tok \(8\) exceeds model\.num_experts \(4\)"),
    ("qwen3_moe", {"qk_norm": True, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [3]},
     r"model\.mlp_only_layers \[3\] lie outside the model's 3 layers"),
    ("mixtral", {"num_experts": 4, "num_experts_per_tok": 2},
     r"model\.norm_topk_prob must be true for model\.family 'mixtral'"),
    ("mixtral", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 16},
     r"model\.moe_intermediate_size \(16\) is not supported by model\.family 'mixtral'"),
]


def test_every_family_has_a_refused_option() -> None:
    assert {family for family, _, _ in REFUSED} == set(FAMILIES)


@pytest.mark.parametrize(("family", "options", "message"), REFUSED,
                         ids=[f"{f}-{'-'.join(o) or 'none'}" for f, o, _ in REFUSED])
def test_an_option_the_family_cannot_express_is_refused_at_config_load(
    tmp_path: Path, family: str, options: dict, message: str
) -> None:
    """Never trained with silently different maths: the YAML fails to load, naming the field and the family."""
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    doc["model"] = {**SIZES, "family": family, **options}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


# A field each family expresses in config.json, changed: what a retrain from a parent of other options writes back.
CHANGED = {"gpt": {"dropout": 0.2}, "llama": {"rope_theta": 5e5}, "qwen3": {"rope_theta": 5e5},
           "mistral": {"sliding_window": 8}, "gemma3": {"rope_local_base_freq": 2e4}, "gemma2": {"sliding_window": 8},
           "qwen3_moe": {"num_experts_per_tok": 1}, "mixtral": {"num_experts_per_tok": 1}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_export_keeps_its_parents_config_json_and_writes_only_what_the_model_changed(case: str) -> None:
    """The parent's keys (its own, its spelling, its `torch_dtype`) pass through; the one field the model
    changed and the weights' dtype are written; from scratch, the family's own config.json."""
    m = CASES[case]
    family = get_family(m.family)
    assert family.export_config(m, {}, dtype="bfloat16") == family.hf_config(m, dtype="bfloat16")
    parent = family.hf_config(m.model_copy(update=CHANGED[m.family]), dtype="float32")
    parent |= {"torch_dtype": parent.pop("dtype"), "pad_token_id": 0, "use_cache": True, "_pattern_note": 2}
    exported = family.export_config(m, parent, dtype="bfloat16")
    [(field, value)] = CHANGED[m.family].items()
    assert getattr(m, field) != value
    assert exported == {**parent, field: getattr(m, field), "torch_dtype": "bfloat16"}
    assert ModelConfig(**family.model_fields_from_hf(exported)) == m
