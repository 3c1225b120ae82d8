"""train.lora and publish.lora_export at config load: vLLM's ranks only, the family's modules only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.base.errors import ConfigError
from tasks.config.schema import VLLM_LORA_RANKS
from tasks.families import FAMILIES
from tests.train.conftest import tiny_config

LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def test_a_rank_vllm_cannot_serve_is_refused_naming_the_field(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"model.family": "llama"})
    with pytest.raises(ConfigError, match=r"train\.lora\.rank: .*12 is not a rank vLLM serves.*320, 512"):
        cfg.with_overrides({"train.lora": {**LORA, "rank": 12}})
    for rank in VLLM_LORA_RANKS:
        assert cfg.with_overrides({"train.lora": {**LORA, "rank": rank}}).train.lora.rank == rank


@pytest.mark.parametrize(("family", "modules"), [
    ("llama", "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    ("gpt", "fc1, fc2, out, qkv"),
])
def test_unknown_target_modules_are_refused_listing_the_familys(tmp_path: Path, family: str, modules: str) -> None:
    cfg = tiny_config(tmp_path, {"model.family": family})
    with pytest.raises(ConfigError, match=rf"train\.lora\.target_modules: .*'c_attn'; its modules: {modules}$"):
        cfg.with_overrides({"train.lora": {**LORA, "target_modules": ["c_attn"]}})


def test_lora_settings_enter_the_fingerprint(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"model.family": "llama"})
    assert cfg.train.lora is None and cfg.publish.lora_export == "adapter"  # absent: full fine-tuning
    lora = cfg.with_overrides({"train.lora": LORA})
    assert lora.fingerprint() != cfg.fingerprint()
    assert lora.with_overrides({"train.lora.alpha": 32}).fingerprint() != lora.fingerprint()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_config_knows_every_familys_lora_targets(tmp_path: Path, family: str) -> None:
    """The torch-free spec the config checks target modules against (tasks/families) is the family's."""
    from tasks.models.lora import targets

    spec = FAMILIES[family]
    options = {"model.family": family, **{f"model.{option}": True for option in spec.always},
               **({"model.num_experts": 4, "model.num_experts_per_tok": 2} if spec.routed else {})}
    found = sorted(targets(tiny_config(tmp_path, options).model))
    if spec.routed:  # the router (`mlp.gate`) and the experts take no adapter until LoRA on experts is built
        assert sorted(set(found) - {"gate"}) == sorted(spec.lora_targets)
    else:
        assert found == sorted(spec.lora_targets)
