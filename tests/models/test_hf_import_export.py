"""A team's own Hugging Face model (each supported architecture) in, retrained in 3D equal to its family's
single-process reference, and out again as a model transformers loads.

The models are built here (LlamaConfig + save_pretrained, a WordLevel tokenizer from `tokenizers`):
nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from tasks import REPO_ROOT
from tests.services import S3Endpoint, free_port
from tests.test_weekly_retrain import retrainer

if TYPE_CHECKING:
    from tasks.config.model import ModelConfig

ROOT = REPO_ROOT


# Each supported architecture's tiny random model: (config class, model class, what it adds to Llama's options).
# Qwen3: QK-norm, head_dim != hidden/heads, tied (as its small sizes are), YaRN long context; Mistral and Gemma 3:
# a window shorter than the 32-token training windows, so the band is exercised; Qwen3-MoE: a mixture of experts.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, "head_dim": None}),
    # Gemma 3: the other blocks (four norms, scaled embedding, GELU-tanh), tied; layers 2 and 4 global.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 32, "sliding_window": 8,
                                                          "sliding_window_pattern": 2, "query_pre_attn_scalar": 24}),
    # Gemma 2: soft-capped scores (eager attention) and logits, every other layer global.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                                     "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}),
    # Qwen3-MoE: routed experts (saved per expert, transformers' default layout) split over TP, layer 1 dense.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                                         "moe_intermediate_size": 32, "norm_topk_prob": True,
                                                         "mlp_only_layers": [1]}),
}


# Retrained with expert parallelism (tp=2 x dp=2, ep=2) rather than tp=2 x pp=2: a pipelined MoE is
# tests/train/test_3d_equality.py's.
EXPERT_PARALLEL = ("qwen3_moe",)

# Read through another family's blocks (Qwen2: Llama's with a QKV bias): imported and exported here, not retrained.
ALSO_READ = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {})}


def make_hf_llama(dest: Path, *, vocab: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4,
                  kv_heads: int = 2, ffn: int = 128, shard: str = "100KB", tokenizer: bool = True,
                  arch: str = "llama") -> Path:
    """A random Llama-style model (`arch`: a key of ARCHS or ALSO_READ) saved as a team would have it: sharded
    safetensors + index, config.json, tokenizer."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    config_cls, model_cls, options = {**ARCHS, **ALSO_READ}[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=128, rope_theta=500000.0, bos_token_id=1,
        eos_token_id=2, **copy.deepcopy(options))  # (a transformers config mutates a rope dict it is given)
    getattr(transformers, model_cls)(config).save_pretrained(dest, max_shard_size=shard)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(vocab - 3)}}
        tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(dest)
    return dest


def _config(tmp: Path, pretrained: Path, **model: object) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["model"] = {"pretrained": str(pretrained), "seq_len": 32, **model}
    cfg["parallel"] = {"tp": 2, "pp": 2, "dp": 1, "zero_stage": 1, "micro_batches": 2}
    cfg["train"].update(steps=3, checkpoint_every=3, micro_batch_size=2, warmup_steps=1, lr=1e-3,
                        output_dir=str(tmp / "runs"))
    cfg["data"].update(source_url=str(tmp / "store" / "corpus"), cache_dir=str(tmp / "cache"))
    cfg["cluster"]["master_port"] = free_port()
    cfg["evaluate"].update(batches=2, batch_size=2)
    cfg["publish"].update(registry_url=f"sqlite:///{tmp / 'registry.db'}", store_url=str(tmp / "store" / "models"),
                          export_dtype="fp32", model_name="team-llama")
    return cfg


def _write(tmp: Path, cfg: dict) -> Path:
    path = tmp / "team-llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_sizes_come_from_config_json_and_imported_logits_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tasks.models.resolve import load_config
    from tasks.models.weights import load_reference

    hf = make_hf_llama(tmp_path / "hf")
    assert (hf / "model.safetensors.index.json").is_file()  # sharded, as a real checkpoint is
    cfg = load_config(_write(tmp_path, _config(tmp_path, hf)))
    m = cfg.model
    assert (m.family, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.ffn, m.rope_theta) == (
        "llama", 512, 64, 4, 4, 2, 128, 500000.0)
    assert m.seq_len == 32  # the training context, within config.json's max_position_embeddings (128)

    ours = load_reference(hf, m).eval()
    theirs = AutoModelForCausalLM.from_pretrained(hf).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("model", "message"), [
    ({"d_model": 128}, "model.d_model is 128 here but 64 in"),
    ({"n_kv_heads": 4}, "model.n_kv_heads is 4 here but 2 in"),
    ({"seq_len": 4096}, "model.seq_len (4096) exceeds"),
])
def test_a_yaml_size_that_contradicts_config_json_is_refused_naming_the_field(
    tmp_path: Path, model: dict, message: str
) -> None:
    hf = make_hf_llama(tmp_path / "hf", tokenizer=False)
    config = _write(tmp_path, _config(tmp_path, hf, **model))
    done = retrainer("plan", str(config), tmp=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and str(hf / "config.json") in done.stderr and str(config) in done.stderr


def _export(m: ModelConfig, hf: Path, dest: Path, dtype: str, base_dir: Path) -> dict:
    """The imported weights of `hf` exported to `dest` as publish exports a checkpoint; its config.json."""
    from tasks.models.export import export_checkpoint
    from tasks.models.weights import load_reference
    from tests.checkpoints import write_layer_files

    ckpt = dest.with_name(f"{dest.name}-ckpt")
    write_layer_files(ckpt, m, load_reference(hf, m).state_dict())
    export_checkpoint(m, ckpt, dest, stages=1, dtype=dtype, base_dir=base_dir)
    return json.loads((dest / "config.json").read_text())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", [*ARCHS, *ALSO_READ])
def test_an_export_and_an_export_of_it_keep_the_inputs_config_json_but_its_dtype(
    tmp_path: Path, arch: str, dtype: str
) -> None:
    """A team's model saved by transformers 5 (`rope_parameters`, `pad_token_id`, Gemma 3's
    `_sliding_window_pattern`, ...), imported and exported (v1), then v1 exported again (v2): each config.json is
    the input's, key for key, but `dtype` where the export's differs; transformers loads v2 as the input's class
    with the input's logits."""
    from transformers import AutoModelForCausalLM

    from tasks.models.resolve import load_config

    hf = make_hf_llama(tmp_path / "hf", arch=arch, tokenizer=False)
    given = json.loads((hf / "config.json").read_text())
    assert "rope_parameters" in given and "rope_theta" not in given and given["dtype"] == "float32"
    m = load_config(_write(tmp_path, _config(tmp_path, hf))).model
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    want = {**given, "dtype": str(torch_dtype).removeprefix("torch.")}  # the one field that changed (fp32: none)
    v1 = _export(m, hf, tmp_path / "v1", dtype, base_dir=hf)
    assert v1 == want and list(v1) == list(given)  # the input's keys, in its order
    v2 = _export(m, tmp_path / "v1", tmp_path / "v2", dtype, base_dir=tmp_path / "v1")
    assert v2 == want and list(v2) == list(given)

    served = AutoModelForCausalLM.from_pretrained(tmp_path / "v2").eval()
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch_dtype).eval()
    assert type(served) is type(theirs) and served.dtype == torch_dtype
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(served(tokens).logits, theirs(tokens).logits, rtol=0, atol=0)


# The rotary of each architecture's transformers 5 `rope_parameters` that a retrain from it changes below.
ROPE_CHANGED = {"gemma3": ("full_attention", "rope_theta")}


@pytest.mark.parametrize("arch", [*ARCHS, *ALSO_READ])
def test_a_rotary_the_model_changed_is_written_in_the_inputs_rope_parameters(tmp_path: Path, arch: str) -> None:
    """A model whose rope_theta differs from its parent's: the export writes it inside the parent's
    `rope_parameters` (Gemma 3: its global layers'), never as a flat `rope_theta`; nothing else changes, and
    transformers reads the new base."""
    from transformers import AutoConfig

    from tasks.models import get_family
    from tasks.models.resolve import load_config

    hf = make_hf_llama(tmp_path / "hf", arch=arch, tokenizer=False)
    given = json.loads((hf / "config.json").read_text())
    m = load_config(_write(tmp_path, _config(tmp_path, hf))).model.model_copy(update={"rope_theta": 250000.0})
    family = get_family(m.family)
    exported = family.export_config(m, given, dtype="float32")
    rope = copy.deepcopy(given["rope_parameters"])
    (rope[ROPE_CHANGED[arch][0]] if arch in ROPE_CHANGED else rope)["rope_theta"] = 250000.0
    assert exported == {**given, "rope_parameters": rope}
    assert family.model_fields_from_hf(exported) == {**family.model_fields_from_hf(given), "rope_theta": 250000.0}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(exported))
    assert AutoConfig.from_pretrained(tmp_path / "out").to_dict()["rope_parameters"] == rope


@pytest.mark.multiproc
@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_retrain_in_3d_publish_pull_and_load_with_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.models import get_family
    from tasks.models.parallel import TPGroup
    from tasks.models.resolve import load_config
    from tasks.models.weights import load_reference
    from tasks.train.data import Sampler, TokenWindows, split_inputs
    from tasks.train.reference import train_reference

    hf = make_hf_llama(tmp_path / "hf", arch=arch)
    doc = _config(tmp_path, hf)
    if arch in EXPERT_PARALLEL:  # the same 4 ranks and global batch, the experts split over the 2 replicas
        doc["parallel"] = {"tp": 2, "pp": 1, "dp": 2, "ep": 2, "zero_stage": 1, "micro_batches": 1}
    if arch != "llama":  # the evaluation ranks' 3D path is Llama's run here (and tests/evaluate): one rank for the rest
        doc["evaluate"]["parallel"] = {"tp": 1, "pp": 1, "dp": 1}
    config = _write(tmp_path, doc)
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    assert retrainer("db", "upgrade", "--db", db, tmp=tmp_path).returncode == 0
    made = retrainer("make-data", str(config), "--seed", "3", "--tokens-per-shard", "16384", tmp=tmp_path)
    assert made.returncode == 0, made.stderr[-2000:]

    # The schedule's first run: nothing is live, so `init_from: live` starts from the team's model. (Through
    # the test hooks' CLI: it records every .safetensors file this, the Airflow-side, process opens.)
    opened = tmp_path / "opened.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RETRAINER_HOME": str(tmp_path / "home"),
           "HOOK_AUDIT_OPENS": str(opened)}
    done = subprocess.run([sys.executable, "-m", "tests.hooks.cli", "run", str(config), "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert out["run"]["init"]["kind"] == "pretrained" and out["run"]["init"]["url"] == str(hf)
    assert out["train"]["outcome"] == "trained" and out["train"]["trained_steps"] == 3
    layout = {k: v for k, v in doc["parallel"].items() if k not in ("zero_stage", "micro_batches")}
    assert out["train"]["layout"] == layout
    assert out["publish"]["version"] == 1 and out["publish"]["parent_version"] is None
    # The ranks of each stage wrote its shard into the store; publish exported nothing itself.
    run_dir = Path(out["train"]["checkpoint_dir"]).parents[1]
    files = 4 * layout["pp"]
    assert sorted(p.name for p in (run_dir / "export" / "step-000003").iterdir()) == [
        f"shard-0000{i}.json" for i in range(files)]  # 4 files per stage, written by both TP ranks of each
    assert not (run_dir / "export" / "step-000003-fp32").exists()
    store = tmp_path / "store" / "models"
    touched = opened.read_text().split()
    assert any(p.startswith(str(hf)) for p in touched)  # the hook does see reads: the import, warmed
    assert not [p for p in touched if p.startswith((str(store), str(run_dir)))], touched

    # Import parity in 3D: the first step's loss (before any update) is transformers' loss on that batch.
    cfg = load_config(config)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    assert m.family == arch  # picked from config.json's architectures
    dataset = Path(out["warm"]["dataset_dir"])
    windows = TokenWindows(dataset, "train", m.seq_len, m.vocab_size)
    x, y = split_inputs(windows.get(Sampler(len(windows), t.micro_batch_size, p.micro_batches, p.dp,
                                            t.seed).global_indices(0)))
    theirs = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(theirs(x).logits.reshape(-1, m.vocab_size), y.reshape(-1)).item()
    assert abs(out["train"]["first_loss"] - want) <= 1e-5 * want, (out["train"]["first_loss"], want)

    # 3D equality (as tests/train/test_3d_equality.py for scratch Llama): from the same imported weights, every
    # step's loss (tp=2 x pp=2; a mixture of experts tp=2 x dp=2 x ep=2) is the family's single-process reference
    # loop's; the published weights are its
    # final weights (below). Mistral's and Gemma's 32-token windows are longer than their 8-token window.
    ref = train_reference(cfg, dataset, start=load_reference(hf, m))
    assert len(out["train"]["losses"]) == len(ref.losses) == 3
    for step, (got, expected) in enumerate(zip(out["train"]["losses"], ref.losses, strict=True), start=1):
        assert abs(got - expected) <= 1e-5 * abs(expected), f"step {step}: 3D loss {got} vs reference {expected}"

    # What serving does: pull what `production` points to and load it with transformers.
    pulled = tmp_path / "serving" / "v1"
    done = retrainer("registry", "pull", "--model", "team-llama", "--alias", "production", str(pulled), "--db", db,
                     tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    hf_config = json.loads((pulled / "config.json").read_text())
    assert hf_config["architectures"] == [ARCHS[arch][1]] and hf_config["max_position_embeddings"] == 128
    # The team's config.json as it was (an fp32 export of an fp32 model: nothing changed), rope_parameters and all.
    assert hf_config == json.loads((hf / "config.json").read_text())
    index = json.loads((pulled / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-0000{files}.safetensors" for i in range(1, files + 1)]  # four per stage
    served = AutoModelForCausalLM.from_pretrained(pulled).eval()
    ours = load_reference(pulled, m).eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(served(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
        changed = max((a - b).abs().max().item() for a, b in zip(served.parameters(), theirs.parameters(),
                                                                    strict=True))
    assert changed > 0  # it trained: the published weights are not the imported ones
    # The published weights are the reference loop's final weights, within the Llama 3D test's tolerance, save
    # the few whose first gradient is near Adam's eps (1e-8): Adam divides a gradient by its own size, so their
    # update follows the fp32 rounding of a near-zero sum (summed in another order across ranks); those only
    # within the two runs' Adam steps (lr each).
    imported = load_reference(hf, m)
    family = get_family(m.family)
    family.make_loss_fn(TPGroup())(imported(x), y).backward()
    final, want = ours.state_dict(), ref.model.state_dict()
    for name, weight in imported.named_parameters():
        assert weight.grad is not None
        sure = weight.grad.abs() > 1e-6
        torch.testing.assert_close(final[name][sure], want[name][sure], rtol=1e-4, atol=1e-5,
                                   msg=lambda msg, n=name: f"{n}: {msg}")
        assert (final[name] - want[name]).abs().max() <= 2 * t.steps * t.lr, name
    assert AutoTokenizer.from_pretrained(pulled)("w1 w7").input_ids == [4, 10]  # the team's tokenizer came along


def test_each_rank_reads_only_its_stage_slice_when_importing(tmp_path: Path) -> None:
    """4 ranks (tp=2 x pp=2), each alone in a process: the load adds at most its own slice plus one tensor's
    slice (its transient copy) and a small constant, never the whole model."""
    hf = make_hf_llama(tmp_path / "hf", vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1536,
                       shard="40MB", tokenizer=False)
    whole = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for stage in range(2):
        for tp_rank in range(2):
            done = subprocess.run(
                [sys.executable, str(Path(__file__).with_name("import_rss_worker.py")), "--model-dir", str(hf),
                 "--stage", str(stage), "--stages", "2", "--tp-rank", str(tp_rank), "--tp", "2"],
                capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
            assert done.returncode == 0, done.stderr[-3000:]
            r = json.loads(done.stdout.splitlines()[-1])
            assert r["loaded"] > 0
            assert r["held_bytes"] < whole / 3  # a quarter of the model, give or take the norms
            budget = r["held_bytes"] + r["largest_bytes"] + (16 << 20)
            assert r["peak_added_bytes"] <= budget, (stage, tp_rank, r, whole)


@pytest.mark.multiproc
def test_each_version_records_what_made_it_and_exports_as_transformers_writes(
    tmp_path: Path, pg_url: str, s3: S3Endpoint, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A team's model with its own sampling defaults -> v1, new data -> v2 from v1, published to PostgreSQL and S3
    with credentials from the environment: each version says where it started and what config made it (without
    those credentials), `registry show` shows its numbers, and the export is what transformers writes and loads."""
    import logging
    import warnings

    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    from tests.secrets_scan import files_containing

    hf = make_hf_llama(tmp_path / "hf", layers=2)
    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 20}
    GenerationConfig(bos_token_id=1, eos_token_id=2, **sampling).save_pretrained(hf)
    secret_values = [f"dbpw-{secrets.token_hex(8)}", f"AKIA{secrets.token_hex(8).upper()}",
                     f"s3sk-{secrets.token_hex(16)}"]
    for name, value in zip(("REC_DB_PASSWORD", "REC_S3_KEY", "REC_S3_SECRET"), secret_values, strict=True):
        monkeypatch.setenv(name, value)
    cfg = _config(tmp_path, hf)
    cfg["parallel"] = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1, "micro_batches": 1}
    cfg["evaluate"]["gate"] = {"tolerance": 1.0}  # this test is about the record, not the gate's verdict
    cfg["publish"].update(  # trust auth takes the password and ignores it; moto takes any key
        registry_url=pg_url.replace("postgres@", "postgres:${REC_DB_PASSWORD}@", 1),
        store_url=f"s3://{s3_bucket}/models",
        storage_options={"key": "${REC_S3_KEY}", "secret": "${REC_S3_SECRET}",
                         "client_kwargs": {"endpoint_url": s3.endpoint_url}})
    config = _write(tmp_path, cfg)
    db = ["--db", pg_url]
    assert retrainer("db", "upgrade", *db, tmp=tmp_path).returncode == 0
    said = []
    for seed in (3, 4):  # week 1, then week 2 with new data at the same URL
        made = retrainer("make-data", str(config), "--seed", str(seed), "--tokens-per-shard", "16384", "--overwrite",
                         tmp=tmp_path)
        assert made.returncode == 0, made.stderr[-2000:]
        done = retrainer("run", str(config), tmp=tmp_path)
        assert done.returncode == 0, done.stderr[-4000:]
        said.append(done.stdout + done.stderr)
    assert f"published team-llama v1 (from pretrained {hf}) -> alias 'production'" in said[0]
    assert "published team-llama v2 (from version 1) -> alias 'production'" in said[1]

    shown = retrainer("registry", "show", "--model", "team-llama", *db, tmp=tmp_path)
    record = retrainer("registry", "show", "--model", "team-llama", *db, "--json", tmp=tmp_path)
    assert shown.returncode == 0 and record.returncode == 0, shown.stderr + record.stderr
    versions = json.loads(record.stdout)["versions"]
    lines = shown.stdout.splitlines()
    head = lines.index("versions:") + 1
    assert lines[head].split()[:5] == ["VERSION", "FROM", "LOSS", "PERPLEXITY", "GATE"]
    for v, line in zip(versions, lines[head + 1:head + 3], strict=True):
        assert f"{v['metrics']['loss']:.4f}" in line and f"{v['metrics']['perplexity']:.4f}" in line
        assert line.split()[:2] == [str(v["version"]), "pretrained" if v["version"] == 1 else "version"]
        assert " pass " in line
    assert [v["started_from"] for v in versions] == [f"pretrained {hf}", "version 1"]
    for v in versions:  # what made it: the run's resolved config, as a person would compare two versions
        made_by = v["config"]
        assert (made_by["train"]["steps"], made_by["train"]["lr"], made_by["train"]["init_from"]) == (3, 1e-3, "live")
        assert {k: made_by["parallel"][k] for k in ("tp", "pp", "dp")} == {"tp": 1, "pp": 1, "dp": 1}
        assert (made_by["model"]["pretrained"], made_by["model"]["n_layers"], made_by["model"]["d_model"]) == (
            str(hf), 2, 64)  # the sizes as resolved from the team's config.json
        assert made_by["data"]["source_url"] == cfg["data"]["source_url"]
        assert made_by["publish"]["storage_options"]["secret"] == "<redacted>"
        assert made_by["publish"]["registry_url"].startswith("postgresql+psycopg://postgres:<redacted>@127.0.0.1")
    leaks = [(where, value) for where, text in [("run output", "".join(said)), ("registry show", shown.stdout),
                                                ("registry show --json", record.stdout)]
             for value in secret_values if value in text]
    assert not leaks and not files_containing([tmp_path], secret_values)

    # Serving pulls v2 (two exports from the team's model) and loads it as it is, with its sampling defaults.
    pulled = tmp_path / "serving" / "v2"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", secret_values[1])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_values[2])
    done = retrainer("registry", "pull", "--model", "team-llama", "--version", "2", str(pulled), *db,
                     "--storage-options", json.dumps({"client_kwargs": {"endpoint_url": s3.endpoint_url}}),
                     tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    exported = json.loads((pulled / "config.json").read_text())
    assert exported["dtype"] == "float32" and "torch_dtype" not in exported
    assert exported == json.loads((hf / "config.json").read_text())  # v2's parent is v1: still the team's format
    generation = json.loads((pulled / "generation_config.json").read_text())
    assert {k: generation.get(k) for k in (*sampling, "bos_token_id", "eos_token_id")} == {
        **sampling, "bos_token_id": 1, "eos_token_id": 2}
    logger = hf_logging.get_logger()  # the library's root logger: every transformers warning reaches it
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            served = AutoModelForCausalLM.from_pretrained(pulled)
    finally:
        logger.removeHandler(handler)
    assert not [str(w.message) for w in caught] and not [r.getMessage() for r in records]
    assert (served.generation_config.temperature, served.generation_config.top_p) == (0.7, 0.9)
