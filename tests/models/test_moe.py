"""Mixtures of experts brought in as a team would: a Qwen3-MoE or Mixtral directory as transformers saves it
(the per-expert layout, its default) or as it holds it in memory (the stacked layout), read into the family's
model with transformers' logits and router choices, exported so that transformers loads it as the same class
with the same logits; what these blocks do not implement is refused by name.

Tiny random models built here with transformers: nothing is downloaded.
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
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tasks import REPO_ROOT
from tasks.cli.plan import main as plan_main
from tasks.config.model import ModelConfig
from tasks.models import get_family
from tasks.models.weights import load_reference, open_weights

SIZES = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=64)
QWEN = dict(SIZES, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16)
# Each case's tiny model: which layers route (None: all), as transformers decides it.
MODELS = {
    "qwen3_moe": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN, norm_topk_prob=True)), [0, 1, 2]),
    "qwen3_moe-unnormalised": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN, tie_word_embeddings=True)),
                               [0, 1, 2]),
    "qwen3_moe-sparse-step-2": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN, decoder_sparse_step=2)), [1]),
    "qwen3_moe-mlp-only-layers": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN, mlp_only_layers=[0, 2])),
                                  [1]),
    # A window shorter than the 24-token inputs: the band is exercised.
    "mixtral": (lambda: MixtralForCausalLM(MixtralConfig(**SIZES, intermediate_size=48, num_local_experts=4,
                                                         num_experts_per_tok=2, sliding_window=8)), [0, 1, 2]),
}


def _save(dest: Path, case: str, *, per_expert: bool = True, **config_changes: Any) -> tuple[Path, torch.nn.Module]:
    """The case's random model saved as transformers writes it (`per_expert`: its default, the Hub's layout;
    else transformers 5's stacked tensors), its config.json then edited as a team's might be."""
    torch.manual_seed(0)
    hf = MODELS[case][0]()
    with torch.no_grad():  # transformers starts the experts alike: make the router choose, and the choice matter
        for name, p in hf.named_parameters():
            if "mlp.gate.weight" in name or "experts" in name:
                p.normal_(0, 0.5 if "gate.weight" in name else 0.1)
    hf.save_pretrained(dest, save_original_format=per_expert, max_shard_size="60KB")
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dest, hf.eval()


def _model(hf_dir: Path) -> ModelConfig:
    config = json.loads((hf_dir / "config.json").read_text())
    return ModelConfig(**get_family({"MixtralForCausalLM": "mixtral"}.get(config["architectures"][0], "qwen3_moe"))
                       .model_fields_from_hf(config))


@pytest.mark.parametrize("per_expert", [True, False], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("case", list(MODELS))
def test_imported_logits_and_router_choices_are_transformers(tmp_path: Path, case: str, per_expert: bool) -> None:
    hf_dir, hf = _save(tmp_path / "hf", case, per_expert=per_expert)
    names = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.0." in n for n in names) == per_expert  # the layout under test is the one on disk
    m = _model(hf_dir)
    routed = MODELS[case][1]
    assert [i for i in range(m.n_layers) if m.routed(i)] == routed
    ours = load_reference(hf_dir, m).eval()
    chosen: list[torch.Tensor] = []
    for i in routed:
        ours.blocks[i].mlp.router.register_forward_hook(lambda _mod, _in, out: chosen.append(out[3]))
    tokens = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens, output_router_logits=True)
        torch.testing.assert_close(ours(tokens), theirs.logits, rtol=0, atol=1e-5)
    assert len(theirs.router_logits) == len(chosen) == len(routed)
    for got, logits in zip(chosen, theirs.router_logits, strict=True):
        want = torch.topk(torch.softmax(logits.float(), dim=-1), m.num_experts_per_tok, dim=-1).indices
        assert torch.equal(got, want)
        assert len(got.unique()) > 1  # tokens go to different experts


def test_the_routing_options_are_what_make_qwen3_moe_match(tmp_path: Path) -> None:
    """Renormalising the top-k weights, and which layers are dense, each change the logits: both are exercised."""
    hf_dir, hf = _save(tmp_path / "hf", "qwen3_moe-sparse-step-2")
    m = _model(hf_dir)
    state = {n: open_weights(hf_dir, m).read(n) for n in get_family(m.family).full_shapes(m)}
    tokens = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        ref = get_family(m.family).Reference(m.model_copy(update={"norm_topk_prob": True}), seed=None).eval()
        ref.load_state_dict(state)
        assert (ref(tokens) - expected).abs().max() > 1e-3
    with pytest.raises(RuntimeError, match=r"blocks\.0\.mlp\.router\.weight"):  # every layer routed: other tensors
        get_family(m.family).Reference(m.model_copy(update={"decoder_sparse_step": 1}), seed=None).load_state_dict(
            state)


@pytest.mark.parametrize("case", ["qwen3_moe-mlp-only-layers", "mixtral"])
def test_training_with_the_auxiliary_loss_has_transformers_loss_and_gradients(tmp_path: Path, case: str) -> None:
    """A config.json with `output_router_logits` trains with `router_aux_loss_coef` as transformers does: the
    loss is the cross entropy plus coef * load_balancing_loss_func over every MoE layer, and every gradient (the
    routers' included) is transformers'. Evaluation (eval mode) computes no auxiliary loss."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from tasks.models.parallel import TPGroup

    hf_dir, _ = _save(tmp_path / "hf", case, output_router_logits=True, router_aux_loss_coef=0.5)
    m = _model(hf_dir)
    assert m.router_aux_loss_coef == 0.5
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir).train()
    family = get_family(m.family)
    ours = load_reference(hf_dir, m).train()
    x, y = (torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    out = theirs(x)
    aux = load_balancing_loss_func(out.router_logits, m.num_experts, m.num_experts_per_tok)
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, m.vocab_size), y.reshape(-1)) + 0.5 * aux
    got = family.make_loss_fn(TPGroup())(ours(x), y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    want.backward()
    got.backward()
    grads = {family.ref_name(n): p.grad for n, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-6, msg=lambda msg, n=name: f"{n}: {msg}")
    plain = load_reference(hf_dir, m.model_copy(update={"router_aux_loss_coef": 0.0})).train()
    family.make_loss_fn(TPGroup())(plain(x), y).backward()  # the aux loss moves the routers: it is exercised
    router = next(n for n in grads if n.endswith("router.weight"))
    assert (dict(plain.named_parameters())[router].grad - grads[router]).abs().max() > 1e-4
    ours.eval()
    assert isinstance(ours(x), torch.Tensor)


@pytest.mark.parametrize("case", ["qwen3_moe-mlp-only-layers", "mixtral"])
def test_an_export_is_what_transformers_writes_and_loads_as_the_same_class_with_the_same_logits(
    tmp_path: Path, case: str
) -> None:
    from tasks.models.export import export_checkpoint
    from tests.checkpoints import write_layer_files

    hf_dir, hf = _save(tmp_path / "hf", case)
    m = _model(hf_dir)
    write_layer_files(tmp_path / "ckpt", m, load_reference(hf_dir, m).state_dict())
    export_checkpoint(m, tmp_path / "ckpt", tmp_path / "out", stages=1, dtype="fp32", base_dir=hf_dir)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text())  # the input's config.json, key for key
    names = [json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
             for d in (hf_dir, tmp_path / "out")]
    assert sorted(names[1]) == sorted(names[0])  # the tensors transformers writes: per expert (vLLM reads them too)
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(served) is type(hf)
    tokens = torch.randint(0, m.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(served(tokens).logits, hf(tokens).logits, rtol=0, atol=0)


def _plan(tmp_path: Path, pretrained: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    doc = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    doc["model"] = {"pretrained": str(pretrained), "seq_len": 32}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = plan_main([str(path), "--json", "--device", "cpu"])
    out = capsys.readouterr()
    return code, out.out if code == 0 else out.err


@pytest.mark.parametrize("case", ["qwen3_moe-mlp-only-layers", "mixtral"])
def test_the_plan_counts_what_transformers_builds_and_what_a_token_reaches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    hf_dir, hf = _save(tmp_path / "hf", case)
    code, out = _plan(tmp_path, hf_dir, capsys)
    assert code == 0, out
    report = json.loads(out[out.index("{\n"):])
    assert report["params_total"] == hf.num_parameters()
    m = _model(hf_dir)
    unrouted = len(MODELS[case][1]) * (m.num_experts - m.num_experts_per_tok) * 3 * m.expert_ffn * m.d_model
    assert report["params_active"] == hf.num_parameters() - unrouted
    family = get_family(m.family)  # FLOPs (and MFU) from what a token reaches; the untied embedding is a lookup
    matmul = report["params_active"] - m.vocab_size * m.d_model
    assert family.flops_per_token(m) == 6 * matmul + 12 * m.n_layers * m.attention_span * m.n_heads * m.head_dim


@pytest.mark.parametrize(("architecture", "lacks"), [
    ("DeepseekV3ForCausalLM", "multi-head latent attention"), ("GptOssForCausalLM", "attention sinks"),
    ("Llama4ForCausalLM", "shared expert"), ("Qwen2MoeForCausalLM", "shared expert"),
])
def test_other_mixtures_of_experts_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], architecture: str, lacks: str
) -> None:
    hf_dir, _ = _save(tmp_path / "hf", "qwen3_moe", architectures=[architecture])
    code, err = _plan(tmp_path, hf_dir, capsys)
    assert code == 2
    assert re.search(rf"config\.json architectures \['{architecture}'\] is not supported yet \(.*{lacks}", err), err


@pytest.mark.parametrize(("case", "changes", "message"), [
    ("qwen3_moe", {"shared_expert_intermediate_size": 64},
     r"config\.json shared_expert_intermediate_size = 64: a routing option model\.family 'qwen3_moe' does not"),
    ("qwen3_moe", {"router_bias": True}, r"config\.json router_bias = True: a routing option"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"config\.json router_jitter_noise = 0\.1: a routing option"),
    ("mixtral", {"moe_intermediate_size": 16}, r"config\.json moe_intermediate_size = 16: a routing option "
                                               r"model\.family 'mixtral' does not implement"),
    ("qwen3_moe", {"use_sliding_window": True}, r"config\.json use_sliding_window = True is not supported"),
    ("mixtral", {"num_experts_per_tok": 9}, r"config\.json num_experts_per_tok = 9: 1 to num_experts \(4\)"),
])
def test_a_routing_option_we_do_not_implement_is_refused_at_config_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, changes: dict, message: str
) -> None:
    hf_dir, _ = _save(tmp_path / "hf", case, **changes)
    code, err = _plan(tmp_path, hf_dir, capsys)
    assert code == 2
    assert re.search(message, err), err


def test_a_per_expert_checkpoint_missing_an_experts_part_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tasks.base.errors import InvalidInputError
    from tasks.models.weights import check_shapes

    hf_dir, _ = _save(tmp_path / "hf", "mixtral")
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    file = hf_dir / index["weight_map"][gone]
    save_file({n: t for n, t in load_file(file).items() if n != gone}, file, metadata={"format": "pt"})
    del index["weight_map"][gone]
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidInputError, match=r"blocks\.1\.mlp\.experts\.gate_up is held per expert but lacks "
                                                r"expert 2's part 1"):
        check_shapes(hf_dir, _model(hf_dir))


def test_the_plan_holds_the_activations_of_every_expert_a_token_reaches() -> None:
    """A routed layer keeps each of a token's k experts' hidden outputs: more experts per token, more memory; a
    dense layer of d_ff (Qwen3-MoE's mlp_only_layers) bounds it from below."""
    from tasks.config.schema import JobConfig
    from tasks.plan.budget import _activation_bytes_per_layer

    doc = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    base = dict(vocab_size=256, seq_len=32, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64)
    held = {}
    for k in (1, 2, 4):
        doc["model"] = {**base, "family": "mixtral", "num_experts": 4, "num_experts_per_tok": k,
                        "norm_topk_prob": True}
        held[k] = _activation_bytes_per_layer(JobConfig.model_validate(doc), 2, 1)
    assert held[1] < held[2] < held[4]
    doc["model"] = {**base, "family": "qwen3_moe", "qk_norm": True, "num_experts": 4, "num_experts_per_tok": 1,
                    "moe_intermediate_size": 8, "mlp_only_layers": [0], "d_ff": 1024}
    dense = dict(doc["model"], family="qwen3", num_experts=None, num_experts_per_tok=None,
                 moe_intermediate_size=None, mlp_only_layers=[])
    assert _activation_bytes_per_layer(JobConfig.model_validate(doc), 2, 1) == _activation_bytes_per_layer(
        JobConfig.model_validate({**doc, "model": {k: v for k, v in dense.items() if v not in (None, [])}}), 2, 1)


def test_a_tp_degree_that_does_not_divide_the_experts_is_refused_at_config_load(tmp_path: Path) -> None:
    from tasks.base.errors import ConfigError
    from tests.train.conftest import tiny_config

    with pytest.raises(ConfigError, match=r"parallel\.tp \(2\) must divide the experts' width "
                                          r"\(model\.moe_intermediate_size, null: model\.d_ff: 9\)"):
        tiny_config(tmp_path, {"model.family": "qwen3_moe", "model.qk_norm": True, "model.num_experts": 4,
                               "model.num_experts_per_tok": 2, "parallel.tp": 2, "model.moe_intermediate_size": 9})


def test_the_grouped_matmul_and_the_loop_of_matmuls_compute_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts run as two grouped matmuls where torch has them (every CPU dtype; bf16 on Hopper GPUs), else as a
    loop of one matmul per expert (other GPUs): the same outputs and gradients, an expert without tokens included."""
    from tasks.models.common import moe
    from tasks.models.parallel import TPGroup

    m = ModelConfig(family="qwen3_moe", qk_norm=True, vocab_size=64, seq_len=8, n_layers=1, d_model=32, n_heads=2,
                    d_ff=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    experts = moe.Experts(m, TPGroup())
    torch.nn.init.normal_(experts.gate_up, std=0.3)
    torch.nn.init.normal_(experts.down, std=0.3)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([[0, 1], [1, 3], [3, 0]] * 4)  # expert 2 gets no token
    weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(1))

    def run() -> list[torch.Tensor]:
        experts.zero_grad(set_to_none=True)
        out = experts(x, weights, chosen)
        out.backward(torch.ones_like(out))
        return [out.detach(), experts.gate_up.grad, experts.down.grad]

    assert moe.grouped_mm_supported(x, 16)
    grouped = run()
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda *_: False)
    for got, want in zip(run(), grouped, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert grouped[1][2].abs().sum() == 0  # the idle expert's gradient
