"""Benchmark gates as a team uses them: its own lm-evaluation-harness task folder (a multiple-choice task and a
rolling perplexity), the same config every week, a model of its own with its tokenizer. Week 2's candidate,
trained on another kind of text, loses the benchmark's accuracy and is refused with the harness's numbers in
the refusal; the published version records the pinned settings and the harness version; and our ranks' numbers
are the ones lm-eval's own transformers backend gives on the published export.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml

from tasks.base.errors import InvalidInputError
from tasks.data.prepare.core import PrepareOptions, prepare
from tasks.evaluate.harness import without_environment_report
from tasks.models.resolve import load_config
from tasks.registry import ArtifactStore, Registry
from tasks.stages.lifecycle import run_lifecycle
from tests.chat import LLAMA3, chat_tokenizer
from tests.evaluate.test_forgetting_gate import DIGITS, ENGLISH
from tests.models.test_hf_import_export import _config, make_hf_llama

pytestmark = pytest.mark.multiproc

# (context, choices, answer): the true next words of the English text against digit groups.
ITEMS = [("The quick brown fox jumps over the", [" lazy", " 0712", " 3349"], 0),
         ("while the cat sleeps in the", [" 5561", " warm", " 8820"], 1),
         ("The quick brown fox", [" 1934", " 6677", " jumps"], 2),
         ("jumps over the lazy dog while the", [" cat", " 2048", " 9090"], 0),
         ("sleeps in the warm sun. The quick", [" 4411", " brown", " 7365"], 1),
         ("the lazy dog while", [" 0712", " 3349", " the"], 2)]


# (context, target): greedy generation until "." must give the rest of the sentence.
GENERATE = [("the cat sleeps in the warm", "sun"), ("jumps over the lazy dog while the cat sleeps in the", "warm sun"),
            ("The quick brown fox jumps over the lazy dog while the cat sleeps in", "the warm sun")]


def task_folder(root: Path) -> Path:
    """A team's own tasks: YAML and JSONL side by side (data_files relative to the folder)."""
    root.mkdir(parents=True)
    common = {"dataset_path": "json", "test_split": "test"}
    (root / "english_mc.yaml").write_text(yaml.safe_dump({
        "task": "english_mc", **common, "dataset_kwargs": {"data_files": {"test": "english_mc.jsonl"}},
        "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc", "aggregation": "mean",
                                                        "higher_is_better": True}]}))
    (root / "english_mc.jsonl").write_text("".join(
        json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in ITEMS))
    (root / "english_ppl.yaml").write_text(yaml.safe_dump({
        "task": "english_ppl", **common, "dataset_kwargs": {"data_files": {"test": "english_ppl.jsonl"}},
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]}))
    (root / "english_next.yaml").write_text(yaml.safe_dump({
        "task": "english_next", **common, "dataset_kwargs": {"data_files": {"test": "english_next.jsonl"}},
        "output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": ["."], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "regexes_to_ignore": [" "]},
                        {"metric": "chrf", "aggregation": "chrf", "higher_is_better": True}]}))
    (root / "english_next.jsonl").write_text("".join(json.dumps({"context": c, "target": t}) + "\n"
                                                     for c, t in GENERATE))
    (root / "english_ppl.jsonl").write_text("".join(json.dumps({"text": ENGLISH[:90 * n]}) + "\n" for n in (1, 2, 3)))
    return root


def snapshot(text: str, base: Path, url: Path, tmp: Path) -> None:
    """A week's data at the same URL: plain-text documents (the text's cycle of words, rotated and repeated, so
    each is its own document) prepared with the model's own tokenizer."""
    words = text.split()
    cycle = words[:words.index(words[0], 1)] if words[0] in words[1:] else words
    docs = [" ".join((cycle[i % len(cycle):] + cycle[:i % len(cycle)]) * (1 + i // len(cycle) % 8))
            for i in range(8 * len(cycle))]
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(PrepareOptions(inputs=[str(rows)], tokenizer=str(base), dest=str(url), workers=1, heldout_fraction=0.2,
                           tokens_per_shard=1024, overwrite=True))


def job(tmp: Path, base: Path, tasks: Path) -> Path:
    doc = _config(tmp, base)
    doc["parallel"] = {"tp": 1, "pp": 2, "dp": 1, "zero_stage": 1, "micro_batches": 2}
    doc["train"].update(steps=120, checkpoint_every=120, lr=1e-2, warmup_steps=4, micro_batch_size=4)
    doc["evaluate"] = {
        "batches": 2, "batch_size": 4, "dtype": "fp32", "parallel": {"tp": 1, "pp": 1, "dp": 2},
        "benchmarks": [
            {"name": "mc", "tasks": ["english_mc"], "include_path": str(tasks)},
            {"name": "ppl", "tasks": ["english_ppl"], "include_path": str(tasks),
             "metrics": ["word_perplexity", "bits_per_byte"]},
            {"name": "gen", "tasks": ["english_next"], "include_path": str(tasks), "metrics": ["exact_match"]}],
        "gate": {"rules": [{"metric": "heldout.loss"},
                           {"metric": "mc.english_mc.acc", "direction": "max"},
                           {"metric": "ppl.english_ppl.word_perplexity", "tolerance": 0.5}]},
    }
    path = tmp / "team-llama.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def harness_on_export(export: Path, tasks: Path, max_length: int) -> dict:
    """lm-eval's own transformers backend on a published export: what a team would run by hand (with the
    context the ranks score in, model.seq_len: the backend's own default is config.json's position limit)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with contextlib.chdir(tasks), without_environment_report():  # as the ranks run it: no `pip list` etc.
        out = simple_evaluate(model="hf", model_args={"pretrained": str(export), "dtype": "float32",
                                                           "max_length": max_length},
                              tasks=["english_mc", "english_ppl", "english_next"], num_fewshot=0, device="cpu",
                              log_samples=False,
                              task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    return out["results"]


def test_a_candidate_that_loses_benchmark_accuracy_is_refused_with_the_harness_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    from lm_eval import __version__ as harness_version

    from tasks.registry import upgrade

    base = make_hf_llama(tmp_path / "hf", vocab=512, layers=2, tokenizer=False)
    chat_tokenizer(base, LLAMA3)  # the team's tokenizer (BOS and EOS named in tokenizer_config.json)
    tasks = task_folder(tmp_path / "team-tasks")
    path = job(tmp_path, base, tasks)
    cfg = load_config(path)
    upgrade(cfg.publish.registry_url)
    url = Path(cfg.data.source_url)

    snapshot(ENGLISH, base, url, tmp_path)
    first = run_lifecycle(cfg)
    assert first["train"]["trained_steps"] == 120 and first["publish"]["version"] == 1
    registry = Registry(cfg.publish.registry_url)
    v1 = registry.get_version("team-llama", 1)
    assert v1.metrics["metrics"]["mc.english_mc.acc"] == 1.0  # it learned the English text
    settings = v1.metrics["benchmarks"]["mc"]["settings"]
    assert (settings["harness"], settings["harness_version"], settings["num_fewshot"], settings["limit"],
            settings["apply_chat_template"], settings["fewshot_random_seed"]) == (
        "lm-eval", harness_version, 0, None, False, 1234)
    assert settings["include_digest"] and v1.metrics["benchmarks"]["mc"]["n-samples"]["english_mc"]["effective"] == 6

    # The ranks' numbers are lm-eval's own on the published export (its transformers backend, one process).
    export = ArtifactStore(cfg.publish.store_url).get_tree(v1.artifact_digest, tmp_path / "v1")
    assert settings["max_length"] == cfg.model.seq_len == 32
    theirs = harness_on_export(export, tasks, settings["max_length"])
    ours = v1.metrics["metrics"]
    assert ours["mc.english_mc.acc"] == theirs["english_mc"]["acc,none"]
    assert ours["ppl.english_ppl.word_perplexity"] == pytest.approx(theirs["english_ppl"]["word_perplexity,none"],
                                                                    rel=1e-4)
    assert ours["gen.english_next.exact_match"] == theirs["english_next"]["exact_match,none"] == 1.0
    assert ours["ppl.english_ppl.bits_per_byte"] == pytest.approx(theirs["english_ppl"]["bits_per_byte,none"],
                                                                  rel=1e-4)

    snapshot(DIGITS, base, url, tmp_path)  # week 2: new data of another kind, same URL, same config
    second = run_lifecycle(load_config(path))
    assert second["run"]["init"]["version"] == 1 and second["train"]["trained_steps"] == 120
    ev, gate = second["evaluate"], second["gate"]
    assert ev["live"]["version"] == 1 and ev["live"]["metrics"]["mc.english_mc.acc"] == 1.0
    new_acc = ev["metrics"]["mc.english_mc.acc"]
    assert new_acc < 1.0 and ev["metrics"]["heldout.loss"] < ev["live"]["metrics"]["heldout.loss"]
    assert not gate["publish"] and "publish" not in second
    assert [r["passed"] for r in gate["rules"]] == [True, False, False]
    assert ev["live"]["metrics"]["gen.english_next.exact_match"] == 1.0  # generation: scored for both
    assert ev["metrics"]["gen.english_next.exact_match"] < 1.0
    assert (f"evaluate.gate.rules[1] (mc.english_mc.acc max vs live, tolerance 0 relative): {new_acc:.6g} < 1 "
            "(live v1 1 -> limit 1)") in gate["reason"]
    assert "ppl.english_ppl.word_perplexity min vs live" in gate["reason"]
    assert registry.live_version("team-llama", "production").version == 1  # what is live: still v1


def test_a_task_the_harness_does_not_know_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    from tasks.evaluate.benchmarks import resolve_benchmarks

    base = make_hf_llama(tmp_path / "hf", vocab=512, layers=2, tokenizer=False)
    tasks = task_folder(tmp_path / "team-tasks")
    cfg = load_config(job(tmp_path, base, tasks))
    with pytest.raises(InvalidInputError, match=r"evaluate\.benchmarks\[0\]\.tasks: english_mcq not known"):
        resolve_benchmarks(cfg.with_overrides({"evaluate.gate.rules": [], "evaluate.benchmarks": [
            {"name": "mc", "tasks": ["english_mcq"], "include_path": str(tasks)}]}))
    (tasks / "escape.jsonl").symlink_to(tmp_path / "hf" / "config.json")
    with pytest.raises(InvalidInputError, match=r"evaluate\.benchmarks\[0\]\.include_path: .*escape\.jsonl: a "
                                                r"symlink"):
        resolve_benchmarks(cfg)
