"""Training on a chat dataset: packed windows leak nothing across conversations (same logits as each conversation
alone), labels cover exactly the assistant tokens, and the trainer's loss is transformers' loss over the global
batch's assistant tokens, conversation by conversation (token-weighted across micro-batches)."""

from __future__ import annotations

import hashlib
import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.base.errors import InvalidInputError
from tasks.config.model import ModelConfig
from tasks.data.packing import pack_windows
from tasks.data.prepare.core import PrepareOptions, prepare
from tasks.launch import train
from tasks.models import get_family
from tasks.train.data import TokenWindows
from tasks.train.packing import IGNORE, packed_inputs
from tests.chat import LLAMA3, QWEN, chat_tokenizer, conversations, write_chat_jsonl

SEQ = 128
MODEL = dict(vocab_size=512, seq_len=SEQ, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)


def chat_dataset(tmp_path: Path, template: str, n: int, seed: int = 5, heldout_fraction: float = 0.0) -> Path:
    """A prepared chat dataset at tmp_path/ds: `n` seeded conversations rendered with `template`."""
    tok = chat_tokenizer(tmp_path / "tok", template)
    data = write_chat_jsonl(tmp_path / "chats.jsonl", conversations(n, seed=seed, most=4))
    prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(tok), dest=str(tmp_path / "ds"), workers=1,
                           heldout_fraction=heldout_fraction, chat=True, seq_len=SEQ, overlong="drop"))
    return tmp_path / "ds"


def documents(windows: TokenWindows, i: int) -> list[tuple[int, int]]:
    """[start, stop) of each conversation inside window i's row."""
    _, ranges = windows.documents(i)
    bounds = np.concatenate([[0], np.cumsum(ranges[:, 1] - ranges[:, 0])]).tolist()
    return list(pairwise(bounds))


def conversations_in(windows: TokenWindows, indices: list[int]) -> list[tuple[list[int], list[bool]]]:
    """(tokens, assistant mask) of every conversation the windows `indices` hold, whole, in order."""
    convs = []
    for w in indices:
        shard, ranges = windows.documents(w)
        for a, b in ranges.tolist():
            convs.append((windows.shards[shard][a:b].astype(np.int64).tolist(),
                          windows.masks[shard][a:b].astype(bool).tolist()))
    return convs


# Each attention path: Llama's causal SDPA, a sliding band (Mistral), Gemma 3's sliding/global layers with QK-norm,
# Gemma 2's soft-capped eager scores, GPT's learned positions.
GEMMA = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, tie_embeddings=True)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {"llama": {}, "mistral": {"sliding_window": 8}, "gpt": {},
            "gemma3": {**GEMMA, "sliding_window_pattern": 2, "qk_norm": True, "rope_local_base_freq": 1e4},
            "gemma2": {**GEMMA, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.0},
            "qwen3_moe": {**MOE, "qk_norm": True},
            "mixtral": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_windows_give_each_conversation_its_own_logits(tmp_path: Path, family: str) -> None:
    windows = TokenWindows(chat_dataset(tmp_path, QWEN, 24), "train", SEQ, 512)
    m = ModelConfig(family=family, **MODEL, **FAMILIES[family])
    model = get_family(family).Reference(m, seed=3).eval()
    rows = windows.get_packed(list(range(len(windows))))
    (tokens, positions, docs), labels = packed_inputs(rows)
    assert (rows.doc_ids.max(dim=1).values >= 2).sum() >= 3  # windows packing several conversations
    with torch.no_grad():
        packed = model(tokens, (positions, docs))
        for w in range(len(windows)):
            for a, b in documents(windows, w):
                alone = model(rows.tokens[w:w + 1, a:b])[0]
                n = min(b, SEQ) - a  # the window's last token is only a label
                torch.testing.assert_close(packed[w, a:a + n], alone[:n], rtol=0, atol=1e-5)
                # Labels: the next token where it is the conversation's assistant token, nothing across the end.
                want = [int(t) if mk else IGNORE for t, mk in zip(rows.tokens[w, a + 1:b], rows.mask[w, a + 1:b],
                                                                  strict=True)]
                assert labels[w, a:b - 1].tolist() == want[:SEQ - a]
                if b < SEQ:
                    assert labels[w, b - 1] == IGNORE
    assert windows.trained_tokens(range(len(windows))) == int((labels != IGNORE).sum())


def _windows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """`pack_windows`'s flat arrays as each window's documents."""
    members, bounds = pack_windows(lengths, capacity)
    return [members[a:b].tolist() for a, b in pairwise(bounds.tolist())]


def test_windows_pack_whole_documents_best_fit_decreasing() -> None:
    lengths = np.array([3, 2, 4, 1, 4])
    # Longest first (4, 4, 3, 2, 1), each into the fullest window it fits: of 5 tokens [3, 2] [4] [4, 1]; of 9
    # [3, 2] [4, 4, 1] (in order, as before: [3, 2, 4] [1, 4], and a third window at 5 too).
    assert _windows(lengths, 5) == [[0, 1], [2], [3, 4]]
    assert _windows(lengths, 9) == [[0, 1], [2, 3, 4]]
    assert _windows(np.array([4]), 4) == [[0]]  # a document of exactly a window
    lognormal = np.random.default_rng(0).lognormal(np.log(300), 1.0, 5000).astype(np.int64) + 8
    kept = lognormal[lognormal <= 2049]
    packed = _windows(kept, 2049)
    assert sorted(d for w in packed for d in w) == list(range(len(kept)))  # every document, once
    assert all(int(kept[w].sum()) <= 2049 for w in packed)
    assert [w[0] for w in packed] == sorted(w[0] for w in packed)  # ordered by their first document
    assert kept.sum() / (len(packed) * 2049) > 0.95  # bench/packing.py: the efficiency goal is 0.9
    with pytest.raises(InvalidInputError, match="5 tokens does not fit a window of 4"):
        pack_windows(np.array([2, 5]), 4)


def test_packing_in_chunks_packs_as_all_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop takes the documents a chunk at a time (its Python ints), which changes nothing it packs."""
    from tasks.data import packing

    lengths = np.random.default_rng(3).integers(1, 120, 3000)
    whole = _windows(lengths, 129)
    monkeypatch.setattr(packing, "_PACK_CHUNK", 7)
    assert _windows(lengths, 129) == whole


def test_a_warmed_chat_dataset_reads_as_its_source(tmp_path: Path) -> None:
    """The warm copies the masks and document starts with the shards; only the shards are checked as tokens."""
    from tasks.data.tokens import ShardRules
    from tasks.data.warm import warm

    source = chat_dataset(tmp_path, QWEN, 24)
    result = warm(str(source), tmp_path / "cache", progress=False, rules=ShardRules(512, ("train",), "data"))
    here, there = (TokenWindows(d, "train", SEQ, 512) for d in (source, result.dataset_dir))
    assert there.packed and np.array_equal(here.index, there.index) and np.array_equal(here.ends, there.ends)
    assert here.members.tolist() == there.members.tolist()
    everything = list(range(len(here)))
    for a, b in zip(vars(here.get_packed(everything)).values(), vars(there.get_packed(everything)).values(),
                    strict=True):
        assert torch.equal(a, b)


def test_the_warm_packs_a_chat_split_once_and_the_ranks_map_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A node's warm packs each chat split the run reads at the model's sequence length into the cache, once; a
    rank then maps the packing without packing anything, and gets the windows a rank packing for itself gets. A
    damaged packing is not mapped (the rank packs for itself, saying so); an evicted dataset takes its packing."""
    from tasks.data import packing
    from tasks.data.cache import CacheLayout, remove_dataset
    from tasks.data.tokens import ShardRules
    from tasks.data.warm import warm

    source = chat_dataset(tmp_path, QWEN, 40, heldout_fraction=0.25)
    rules = ShardRules(512, ("train", "heldout"), "data")
    result = warm(str(source), tmp_path / "cache", progress=False, rules=rules, seq_len=SEQ)
    layout, dsid = CacheLayout(tmp_path / "cache"), result.dataset_dir.name
    written = sorted(p.relative_to(layout.packing_dir(dsid)).as_posix()
                     for p in layout.packing_dir(dsid).rglob("*.npy"))
    assert written == [f"v{packing.PACKING_FORMAT}-window{SEQ + 1}/{split}/shard-00000.bin.{part}.npy"
                       for split in ("heldout", "train") for part in ("bounds", "members")]
    stamps = {p: p.stat().st_mtime_ns for p in layout.packing_dir(dsid).rglob("*.npy")}
    warm(str(source), tmp_path / "cache", progress=False, rules=rules, seq_len=SEQ)  # a re-warm packs nothing
    assert {p: p.stat().st_mtime_ns for p in layout.packing_dir(dsid).rglob("*.npy")} == stamps

    for split in ("train", "heldout"):
        here = TokenWindows(source, split, SEQ, 512)  # outside a cache: packed by this rank
        with monkeypatch.context() as patched:
            patched.setattr(packing, "pack_windows", lambda *a: pytest.fail("a rank packed a warmed split"))
            there = TokenWindows(result.dataset_dir, split, SEQ, 512)
        assert np.array_equal(here.index, there.index) and np.array_equal(here.ends, there.ends)
        assert np.array_equal(here.members, there.members) and len(here) > 1

    bounds = next(layout.packing_dir(dsid).rglob("train/*.bounds.npy"))
    np.save(bounds, np.array([0, 1, 2], dtype=np.int64))  # two windows of one document each: not this shard's
    with caplog.at_level("WARNING", logger="tasks.data.packing"):
        damaged = TokenWindows(result.dataset_dir, "train", SEQ, 512)
    assert "the cached packing does not fit the shard: packing it here" in caplog.text
    assert np.array_equal(damaged.members, TokenWindows(source, "train", SEQ, 512).members)
    bounds.write_bytes(b"not an array")
    assert np.array_equal(TokenWindows(result.dataset_dir, "train", SEQ, 512).index, damaged.index)
    assert "the cached packing is unreadable" in caplog.text

    remove_dataset(layout, dsid)
    assert not layout.packing_dir(dsid).exists()


def test_a_cached_packing_counts_in_the_disk_budget(tmp_path: Path) -> None:
    """The warm's packing of a chat dataset takes disk beside it: a budget that holds the next dataset beside the
    first's files but not beside its packing too evicts the first, packing and all."""
    from tasks.base.fsutil import dir_bytes
    from tasks.data.cache import CacheLayout
    from tasks.data.manifest import read_manifest
    from tasks.data.tokens import ShardRules
    from tasks.data.warm import warm

    rules = ShardRules(512, ("train",), "data")
    first = warm(str(chat_dataset(tmp_path / "a", QWEN, 30)), tmp_path / "cache", progress=False, rules=rules,
                 seq_len=SEQ)
    layout = CacheLayout(tmp_path / "cache")
    packing = dir_bytes(layout.packing_dir(first.dataset_dir.name))
    second = chat_dataset(tmp_path / "b", QWEN, 30, seed=9)
    held = max(dir_bytes(first.dataset_dir), layout.reserved(first.dataset_dir.name))  # what make_room counts
    budget = held + read_manifest(str(second)).total_bytes + packing - 1
    warm(str(second), tmp_path / "cache", progress=False, rules=rules, disk_budget_bytes=budget)
    assert packing > 0 and not first.dataset_dir.exists()
    assert not layout.packing_dir(first.dataset_dir.name).exists()


def test_a_chat_shard_whose_document_starts_go_backwards_is_refused_at_the_warm(tmp_path: Path) -> None:
    """A producer's starts file that its manifest vouches for but that cannot be this shard's conversations (an
    offset before the one it follows): the node's warm refuses it naming the shard, before any rank starts and
    without packing anything."""
    from tasks.base.dataset_format import STARTS_DTYPE, starts_key
    from tasks.data.cache import CacheLayout
    from tasks.data.tokens import ShardRules
    from tasks.data.warm import warm

    source = chat_dataset(tmp_path, QWEN, 12)
    path = source / starts_key("train/shard-00000.bin")
    starts = np.fromfile(path, dtype=STARTS_DTYPE)
    starts[[1, 2]] = starts[[2, 1]]  # two conversations' offsets swapped: the second ends before it starts
    path.write_bytes(starts.tobytes())
    manifest = json.loads((source / "manifest.json").read_text())  # the producer vouches for the new bytes
    for entry in manifest["files"]:
        if entry["key"] == starts_key("train/shard-00000.bin"):
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (source / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidInputError, match=r"datasets/[0-9a-f]{16}/train/shard-00000\.bin: its document "
                                                r"starts do not match its tokens"):
        warm(str(source), tmp_path / "cache", progress=False, rules=ShardRules(512, ("train",), "data"),
             seq_len=SEQ)
    assert not (CacheLayout(tmp_path / "cache").root / "packed").exists()


def hf_loss(m: ModelConfig, seed: int, convs: list[tuple[list[int], list[bool]]]) -> tuple[float, int]:
    """transformers' loss of our seeded initial weights, conversation by conversation, labels -100 outside the
    assistant tokens, as one mean over every assistant token; and how many there are."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = get_family(m.family)
    config = AutoConfig.for_model(**{k: v for k, v in family.hf_config(m, dtype="float32").items()
                                     if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict({family.hf_name(n): t for n, t in family.Reference(m, seed).state_dict().items()},
                       strict=not m.tie_embeddings)
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, mask in convs:
            ids = torch.tensor([tokens])
            labels = ids.masked_fill(~torch.tensor([mask], dtype=torch.bool), IGNORE)
            n = int((labels[:, 1:] != IGNORE).sum())
            total += float(hf(ids, labels=labels).loss) * n
            count += n
    return total / count, count


LAYOUTS = {"one-rank": {}, "tp2-pp2": {"parallel.tp": 2, "parallel.pp": 2}}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_loss_is_transformers_loss_over_the_assistant_tokens(tmp_path: Path, make_config,
                                                                     layout: str) -> None:
    """Two micro-batches per step (tp2-pp2: the packing tensors cross the stage boundary with the activations,
    and the loss is vocab-parallel)."""
    dataset = chat_dataset(tmp_path, LLAMA3, 40)
    windows = TokenWindows(dataset, "train", SEQ, 512)
    half = len(windows) // 2
    assert half >= 2
    cfg = make_config({"model.family": "llama", **{f"model.{k}": v for k, v in MODEL.items()},
                       "train.steps": 1, "train.checkpoint_every": 1, "train.micro_batch_size": half,
                       "parallel.micro_batches": 2, **LAYOUTS[layout]})
    summary = train(cfg, dataset)
    # Step 1's global batch is 2 x half windows of the packed dataset: the conversations they hold, whole.
    step = np.random.default_rng([cfg.train.seed, 0]).permutation(len(windows))[:2 * half]
    convs = conversations_in(windows, step.tolist())
    want, trained = hf_loss(cfg.model, cfg.train.seed, convs)
    assert abs(summary["first_loss"] - want) <= 1e-5 * want, (summary["first_loss"], want)
    row = json.loads(Path(summary["telemetry_path"]).read_text().splitlines()[0])
    assert row["trained_tokens"] == trained
    assert row["packed_efficiency"] == sum(len(t) for t, _ in convs) / (2 * half * (SEQ + 1))


@pytest.mark.multiproc
def test_a_mixture_of_experts_trains_on_conversations_across_stages(tmp_path: Path, make_config) -> None:
    """Qwen3-MoE at pp=2 on packed conversations: the positions, the documents and the auxiliary loss's carrier
    cross the stage boundary together; the loss is transformers' cross entropy over the assistant tokens plus
    the auxiliary loss (coef x E x sum_e f_e P_e: positive, at most coef x E x k)."""
    dataset = chat_dataset(tmp_path, LLAMA3, 40)
    windows = TokenWindows(dataset, "train", SEQ, 512)
    half = len(windows) // 2
    coef = 1e-3
    cfg = make_config({"model.family": "qwen3_moe", **{f"model.{k}": v for k, v in {**MODEL, **MOE}.items()},
                       "model.qk_norm": True, "model.router_aux_loss_coef": coef, "train.steps": 1,
                       "train.checkpoint_every": 1, "train.micro_batch_size": half, "parallel.micro_batches": 2,
                       "parallel.pp": 2})
    summary = train(cfg, dataset)
    step = np.random.default_rng([cfg.train.seed, 0]).permutation(len(windows))[:2 * half]
    want, _ = hf_loss(cfg.model, cfg.train.seed, conversations_in(windows, step.tolist()))
    assert 0 < summary["first_loss"] - want <= coef * MOE["num_experts"] * MOE["num_experts_per_tok"], (
        summary["first_loss"], want)
