"""LoRA exports against peft: the adapter loads with PeftModel.from_pretrained on the transformers base and
gives our logits; the merged export equals merge_and_unload(); the adapter directory passes vLLM's rules.

The models are built here (our Llama Reference, its base exported as transformers writes it): nothing is
downloaded. The checkpoint is DeepSpeed's layer files as a tp=1 run leaves them (tests/checkpoints.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tasks.config.schema import VLLM_LORA_RANKS
from tasks.models import get_family
from tasks.models.export import export_checkpoint
from tasks.models.lora import apply_lora, is_adapter_param
from tasks.models.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_adapter
from tasks.models.parallel import TPGroup
from tasks.models.weights import load_reference, open_weights
from tests.checkpoints import write_layer_files
from tests.train.conftest import tiny_config

LORA = {"rank": 8, "alpha": 24, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]}


def check_vllm_rules(adapter_dir: Path, max_lora_rank: int = 512) -> None:
    """What vLLM (vllm/lora/peft_helper.py, lora_model.py) checks before serving an adapter directory."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert config["r"] in VLLM_LORA_RANKS and config["r"] <= max_lora_rank, config["r"]
    assert isinstance(config["lora_alpha"], (int, float)) and config["lora_alpha"] > 0
    assert config.get("modules_to_save") is None, "vLLM refuses modules_to_save"
    assert not config.get("use_dora"), "vLLM refuses DoRA"
    assert config.get("bias", "none") == "none", "vLLM refuses LoRA biases"
    targets = config["target_modules"]
    assert isinstance(targets, list) and targets
    key = re.compile(r"base_model\.model\.(.+)\.(lora_A|lora_B)\.weight")
    with safe_open(adapter_dir / ADAPTER_WEIGHTS, "pt") as f:
        keys = list(f.keys())
        assert keys
        for name in keys:
            match = key.fullmatch(name)
            assert match, f"{name}: not a PEFT LoRA key"
            assert match.group(1).rsplit(".", 1)[-1] in targets, f"{name}: maps to no target module"
            shape = f.get_slice(name).get_shape()
            assert (shape[0] if match.group(2) == "lora_A" else shape[1]) == config["r"], (name, shape)


@pytest.fixture
def lora_run(tmp_path: Path):
    """(cfg, checkpoint, base HF dir): a trained-looking LoRA checkpoint (B moved off zero) and its base."""
    return lora_checkpoint(tmp_path, tiny_config(tmp_path, {"model.family": "llama", "model.vocab_size": 256,
                                                            "train.lora": LORA}))


def lora_checkpoint(tmp_path: Path, cfg):
    """(cfg, checkpoint, base HF dir) of `cfg`'s model and adapters, the adapters' B moved off zero."""
    m = cfg.model
    model = get_family(m.family).Reference(m, 3)
    base_state = {n: t.clone() for n, t in model.state_dict().items()}
    apply_lora(model, m, cfg.train.lora, TPGroup(), 3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    checkpoint = tmp_path / "ckpt"
    write_layer_files(checkpoint, m, model.state_dict())
    write_layer_files(tmp_path / "base-ckpt", m, base_state)
    base = export_checkpoint(m, tmp_path / "base-ckpt", tmp_path / "base", stages=1, dtype="fp32")
    return cfg, checkpoint, base


MOE = {"model.qk_norm": True, "model.num_experts": 4, "model.num_experts_per_tok": 2, "model.mlp_only_layers": [1]}


def test_peft_loads_our_adapter_and_gives_our_logits(lora_run, tmp_path: Path) -> None:
    assert_peft_parity(lora_run, tmp_path)


def test_a_mixture_of_experts_takes_attention_adapters_and_refuses_expert_ones_by_name(tmp_path: Path) -> None:
    """Qwen3-MoE (a routed layer and a dense one): adapters on the attention projections load in peft on the
    transformers model and give our logits; one on the experts is refused before anything runs, naming why."""
    attention = {**LORA, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    cfg = tiny_config(tmp_path, {"model.family": "qwen3_moe", "model.vocab_size": 256, **MOE, "train.lora": attention})
    assert_peft_parity(lora_checkpoint(tmp_path, cfg), tmp_path)
    with pytest.raises(ValueError, match=r"train.lora.target_modules: .*'gate_proj'.*routed experts"):
        cfg.with_overrides({"train.lora": LORA})


def assert_peft_parity(run, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, checkpoint, base = run
    m, lora = cfg.model, cfg.train.lora
    adapter = write_adapter(m, lora, open_weights(checkpoint, m), tmp_path / "adapter", base_model=str(base),
                            dtype="fp32")
    check_vllm_rules(adapter)
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(base)

    ours = load_reference(checkpoint, m, lora=lora).eval()
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(tokens), theirs(tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(tokens).logits
    assert (want - plain).abs().max() > 1e-3  # the adapter changes the logits: parity is not the base's
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    merged_dir = export_checkpoint(m, checkpoint, tmp_path / "merged", stages=2, dtype="fp32", lora=lora)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    reference = theirs.merge_and_unload().state_dict()
    state = merged.state_dict()
    assert sorted(state) == sorted(reference) and not any(is_adapter_param(n) for n in state)
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-5, msg=lambda msg, n=name: f"{n}: {msg}")
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, want, rtol=0, atol=1e-5)


def test_vllm_rules_refuse_what_vllm_refuses(lora_run, tmp_path: Path) -> None:
    """The rule check itself: each broken variant of a good adapter directory fails it."""
    cfg, checkpoint, base = lora_run
    good = write_adapter(cfg.model, cfg.train.lora, open_weights(checkpoint, cfg.model), tmp_path / "a",
                         base_model=str(base))
    check_vllm_rules(good)
    with pytest.raises(AssertionError):
        check_vllm_rules(good, max_lora_rank=4)  # --max-lora-rank below r
    for broken in ({"r": 12}, {"use_dora": True}, {"modules_to_save": ["lm_head"]}, {"target_modules": ["q_proj"]}):
        config = json.loads((good / ADAPTER_CONFIG).read_text())
        (good / ADAPTER_CONFIG).write_text(json.dumps({**config, **broken}))
        with pytest.raises(AssertionError):
            check_vllm_rules(good)
        (good / ADAPTER_CONFIG).write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["adapter", "merged", "both"])
def test_publish_lora_export_lays_out_what_it_names(lora_run, tmp_path: Path, kind: str) -> None:
    from tasks.models.lora_export import export_lora

    cfg, checkpoint, base = lora_run
    dest = export_lora(cfg.model, cfg.train.lora, kind, checkpoint, tmp_path / kind, stages=2, dtype="bf16",
                       base_dir=base, base_model="s3://store/base-v3")
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    adapter = {"adapter": [ADAPTER_CONFIG, ADAPTER_WEIGHTS], "merged": [],
               "both": [f"adapter/{ADAPTER_CONFIG}", f"adapter/{ADAPTER_WEIGHTS}"]}[kind]
    assert set(adapter) <= set(files)
    assert ("config.json" in files) == (kind != "adapter")
    if adapter:
        check_vllm_rules(dest / Path(adapter[0]).parent)
        assert json.loads((dest / adapter[0]).read_text())["base_model_name_or_path"] == "s3://store/base-v3"
    again = export_lora(cfg.model, cfg.train.lora, kind, checkpoint, dest, stages=2, dtype="bf16", base_dir=base,
                        base_model="s3://store/base-v3")  # a retried publish reuses the finished export
    assert sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file()) == files
