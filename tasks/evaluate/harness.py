"""Benchmark gates: lm-evaluation-harness tasks scored by the evaluation ranks (`evaluate.benchmarks`).

Why the ranks and not the harness's own transformers backend: a model at real size exists only as slices
across GPUs, and the ranks already hold the candidate (rounded as it will be published, LoRA adapters
included) and the live version in any tp x pp x dp layout. Rank 0 runs the harness with `RanksLM`, whose
loglikelihoods every rank computes: rank 0 hands each batch of requests to all ranks (`RequestScorer`), each
DP replica scores its share, and the answers come back to rank 0. Tokenization, truncation and is_greedy
follow the harness's transformers backend, so the numbers are the ones a team gets from `lm_eval --model hf`
on the export with `max_length` = `model.seq_len`, the context the ranks score in (recorded;
tests/evaluate/test_benchmarks.py compares them). Generation tasks decode greedily (sampling is refused).
What is run, pinned and refused before the ranks start is tasks/evaluate/benchmarks.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.evaluate.benchmarks import HARNESS, PINNED, harness_version, task_manager

if TYPE_CHECKING:
    from tasks.evaluate.sharded import ShardedModel

log = logging.getLogger(__name__)


class RequestScorer:
    """Loglikelihood and generation requests answered by every evaluation rank. Rank 0 (which runs the harness)
    hands each call's requests to all ranks; each DP replica takes every dp-th batch (longest first); the last
    stage's answers return to rank 0. The other ranks `serve` until rank 0 `stop`s them (with its error, when it
    failed)."""

    def __init__(self, model: ShardedModel, batch_size: int, max_length: int) -> None:
        """`batch_size` requests per forward; `max_length`: the context, model.seq_len."""
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.rank = tdist.get_rank()
        self.dp = model.dp

    def score(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """On rank 0: the (logprob, is_greedy) of each request (context tokens, continuation tokens)."""
        return self._call(("loglikelihood", requests))  # type: ignore[return-value]

    def generate(self, requests: list[tuple[list[int], int]], eos: int) -> list[list[int]]:
        """On rank 0: each request's (context tokens, most new tokens) greedy continuation, up to its EOS."""
        return self._call(("generate", requests, eos))  # type: ignore[return-value]

    def serve(self) -> None:
        while self._call(None) is not None:
            pass

    def stop(self, error: str | None = None) -> None:
        tdist.broadcast_object_list([error], src=0)

    def _call(self, payload: tuple[Any, ...] | None) -> list[Any] | None:
        """Collective: rank 0's payload (the others pass None) reaches every rank, each DP replica does its
        share, and the answers gather on rank 0 (the others get []); None once rank 0 has stopped them."""
        box: list[Any] = [payload]
        tdist.broadcast_object_list(box, src=0)
        got = box[0]
        if isinstance(got, str):
            raise RetrainerError(f"benchmarks: rank 0 failed: {got}")
        if got is None:
            return None
        mine = self._score_share(got[1]) if got[0] == "loglikelihood" else self._generate_share(got[1], got[2])
        gathered: list[Any] | None = [None] * tdist.get_world_size() if self.rank == 0 else None
        tdist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return []
        found = {i: answer for part in gathered for i, answer in part.items()}
        return [found[i] for i in range(len(got[1]))]

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """This replica's batches of request indices: longest first, every dp-th batch."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches = [order[b:b + self.batch_size] for b in range(0, len(order), self.batch_size)]
        return batches[self.model.dp_rank::self.dp]

    @property
    def _keeps(self) -> bool:
        """Whether this rank reports its replica's answers (the last stage's first TP rank: peers hold the same)."""
        return self.model.last_stage and self.model.tp.rank == 0

    @staticmethod
    def _right_padded(rows: list[list[int]]) -> torch.Tensor:
        """[len(rows), longest] token ids, zero-padded on the right: a causal model's earlier positions do not see
        the padding."""
        out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for j, row in enumerate(rows):
            out[j, :len(row)] = torch.tensor(row)
        return out

    def _generate_share(self, requests: list[tuple[list[int], int]], eos: int) -> dict[int, list[int]]:
        """Greedy decoding of this replica's batches, one full forward per new token (no KV cache: a
        benchmark's few hundred prompts, not serving), each row until its EOS or its token budget."""
        out: dict[int, list[int]] = {}
        for batch in self._batches([len(context) for context, _ in requests]):
            seqs = [list(requests[i][0]) for i in batch]
            budget = [requests[i][1] for i in batch]
            new: list[list[int]] = [[] for _ in batch]
            done = [False] * len(batch)
            while not all(done):
                picked = self.model.next_tokens(self._right_padded(seqs), torch.tensor([len(s) - 1 for s in seqs]))
                for j in range(len(batch)):
                    if done[j]:
                        continue
                    token = int(picked[j])
                    if token == eos:
                        done[j] = True
                        continue
                    new[j].append(token)
                    seqs[j].append(token)
                    done[j] = len(new[j]) >= budget[j]
            if self._keeps:
                out.update(zip(batch, new, strict=True))
        return out

    def _score_share(self, requests: list[tuple[list[int], list[int]]]) -> dict[int, tuple[float, bool]]:
        """This replica's loglikelihood batches, left-truncated to `max_length` as the transformers backend does."""
        rows = []
        for context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise InvalidInputError(f"benchmarks: a continuation of {len(continuation)} tokens does not fit "
                                        f"model.seq_len {self.max_length}")
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        out: dict[int, tuple[float, bool]] = {}
        batches = ((self._right_padded([rows[i][0] for i in batch]), self._right_padded([rows[i][1] for i in batch]),
                    batch) for batch in self._batches([len(r[0]) for r in rows]))
        for batch, scored in self.model.loglikelihood_batches(batches):  # one pipeline over the batches
            if scored is None or not self._keeps:
                continue
            nll, greedy = scored[0].double().cpu(), scored[1].cpu()
            for j, i in enumerate(batch):
                end, n = len(rows[i][0]), rows[i][2]
                out[i] = (-float(nll[j, end - n:end].sum()), bool(greedy[j, end - n:end].all()))
        return out


def ranks_lm(scorer: RequestScorer, tokenizer: Any) -> Any:
    """The harness's model (a `TemplateLM`) whose loglikelihoods the evaluation ranks compute."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class RanksLM(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.tokenizer = tokenizer
            self.max_length = scorer.max_length

        @property
        def eot_token_id(self) -> int:
            return tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

        @property
        def tokenizer_name(self) -> str:
            return str(tokenizer.name_or_path).replace("/", "__")

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            # As the harness's transformers backend encodes (its add_bos_token unset).
            bos = tokenizer.decode(self.prefix_token_id)
            kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            if add_special_tokens is None and bos and string.startswith(bos):
                kw = {"add_special_tokens": False}
            return tokenizer.encode(string, **kw)

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=not add_generation_prompt)

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return super().loglikelihood(requests, disable_tqdm=True)  # a rank's stderr is relayed as log lines

        def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
            scored = scorer.score([(list(context), list(continuation)) for _, context, continuation in requests])
            assert scored is not None
            return scored

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            windows, owner = [], []
            for n, (string,) in enumerate(req.args for req in requests):
                for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                    windows.append((None, context, continuation))
                    owner.append(n)
            totals = [0.0] * len(requests)
            for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
                totals[n] += logprob
            return totals

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

            eos = tokenizer.decode(tokenizer.eos_token_id, skip_special_tokens=False)
            prompts, stops = [], []
            for req in requests:
                context, gen_kwargs = req.args
                kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
                if kwargs.get("do_sample"):
                    raise InvalidInputError(f"benchmarks: task {req.task_name} samples its generations (do_sample); "
                                            "a gate needs greedy, repeatable ones")
                most = kwargs["max_gen_toks"]
                if most >= self.max_length:
                    raise InvalidInputError(f"benchmarks: task {req.task_name} generates up to {most} tokens, not "
                                            f"less than model.seq_len {self.max_length}")
                prompts.append((self.tok_encode(context)[-(self.max_length - most):], most))
                stops.append(handle_stop_sequences(kwargs.get("until"), eos=eos))
            generated = scorer.generate(prompts, tokenizer.eos_token_id)
            return [postprocess_generated_text(tokenizer.decode(tokens, skip_special_tokens=True), until, None)
                    for tokens, until in zip(generated, stops, strict=True)]

    return RanksLM()


def run_benchmarks(scorer: RequestScorer, tokenizer_dir: Path | None, benchmarks: list[dict[str, Any]]
                   ) -> tuple[dict[str, float], dict[str, Any]]:
    """Every benchmark on the model the ranks hold: on rank 0, (metrics `<benchmark>.<task>.<metric>`, the
    harness's record of each run); on the others ({}, {}), after serving rank 0's requests. Collective."""
    if scorer.rank != 0:
        scorer.serve()
        return {}, {}
    metrics: dict[str, float] = {}
    record: dict[str, Any] = {}
    try:
        if tokenizer_dir is None:
            raise InvalidInputError("evaluate.benchmarks: the starting model has no tokenizer (tokenizer.json); "
                                    "the harness tokenizes text with it")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if tokenizer.eos_token_id is None:
            raise InvalidInputError(f"evaluate.benchmarks: {tokenizer_dir}'s tokenizer names no eos_token")
        for bench in benchmarks:
            got, record[bench["name"]] = run_benchmark(ranks_lm(scorer, tokenizer), bench)
            metrics.update(got)
    except BaseException as exc:
        scorer.stop(f"{type(exc).__name__}: {exc}")
        raise
    scorer.stop()
    return metrics, record


@contextlib.contextmanager
def without_environment_report() -> Iterator[None]:
    """The harness without its report of the machine: `simple_evaluate` ends every benchmark with torch's
    `collect_env` (`pip list`, compiler and driver probes: 2 s of CPU and ~7 s on a busy 2-core node, on rank 0
    while every other rank waits), for fields the record does not keep (`run_benchmark` keeps the scores,
    shots, samples and task versions; the harness's version is pinned in the config)."""
    from lm_eval import evaluator

    report = evaluator.add_env_info
    evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        evaluator.add_env_info = report


def run_benchmark(lm: Any, bench: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """One benchmark through the harness (in its task folder: relative data files are read from there)."""
    from lm_eval import simple_evaluate

    if bench["harness_version"] != harness_version():
        raise InvalidInputError(f"benchmark {bench['name']}: the evaluation node has {HARNESS} {harness_version()}, "
                                f"the config was resolved with {bench['harness_version']}")
    folder = bench["include_path"]
    if folder is not None:
        from tasks.registry.store import local_tree_manifest

        if local_tree_manifest(folder).digest != bench["include_digest"]:
            raise InvalidInputError(f"benchmark {bench['name']}: {folder} changed since the evaluation was "
                                    "planned (its digest differs)")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    with contextlib.chdir(folder) if folder is not None else contextlib.nullcontext(), without_environment_report():
        results = simple_evaluate(
            model=lm, tasks=list(bench["tasks"]), num_fewshot=bench["num_fewshot"], limit=bench["limit"],
            apply_chat_template=bench["apply_chat_template"], fewshot_as_multiturn=bench["apply_chat_template"],
            task_manager=task_manager(folder, defaults=bench["include_defaults"]),
            log_samples=False, **{k: bench[k] for k in PINNED})
    if results is None:
        raise RetrainerError(f"benchmark {bench['name']}: the harness returned no results")
    metrics = {}
    for task in bench["tasks"]:
        scores = results["results"].get(task, {})
        for metric in bench["metrics"]:
            value = scores.get(metric if "," in metric else f"{metric},none")
            if not isinstance(value, int | float):
                known = sorted(k for k, v in scores.items() if isinstance(v, int | float))
                raise InvalidInputError(f"benchmark {bench['name']}: the harness reports no {metric!r} for task "
                                        f"{task!r} (it reports: {', '.join(known) or 'nothing'})")
            metrics[f"{bench['name']}.{task}.{metric}"] = float(value)
    record = {"results": results["results"], "n-shot": results.get("n-shot"), "n-samples": results.get("n-samples"),
              "versions": results.get("versions")}
    log.info("benchmark %s: %s", bench["name"], ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    return metrics, record
