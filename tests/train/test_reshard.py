"""Resume at another data-parallel size (issue 27): a dp=2 run that lost a node resumes at dp=1 with the same
global batch and trains on as if nothing happened (a LoRA run too, whose checkpoints hold only the adapters and
their optimizer states); a tp/pp change is refused before any rank starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tasks.base.errors import InvalidInputError
from tasks.base.job_status import STATUS_FILE
from tasks.launch import train
from tasks.runs.identity import for_dataset
from tasks.train import checkpoint as ck
from tasks.train.reshard import overlapping, partition_numel
from tests.checkpoints import write_base_weights
from tests.train.conftest import tiny_config, write_dataset
from tests.train.test_faults import _children, _rank_of, _reap, _start, _wait_for

LLAMA = {"model.family": "llama", "model.n_layers": 2, "train.steps": 6, "train.checkpoint_every": 3,
         "train.keep_last": 3, "train.micro_batch_size": 2}
DP2 = {**LLAMA, "parallel.dp": 2, "parallel.micro_batches": 1}
DP1 = {**LLAMA, "parallel.dp": 1, "parallel.micro_batches": 2}  # the same global batch: 2 x 2 x 1
LORA = {"train.lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "down_proj"]}}


def _global_order(log: Path) -> dict[int, list[int]]:
    """Per step, the window indices of its global batch in order (micro-batch j of dp rank r is rows
    [j x mbs x dp + r x mbs, ...)), from every rank's sample log."""
    rows: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in log.parent.glob(f"{log.name}.rank*"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            for j, ids in enumerate(entry["micro_batches"]):
                rows.setdefault(entry["step"], {})[(j, entry["dp_rank"])] = ids
    return {step: [i for key in sorted(parts) for i in parts[key]] for step, parts in rows.items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("lora", [{}, LORA], ids=["full", "lora"])
def test_dp2_run_killed_resumes_at_dp1_with_the_same_losses_samples_and_only_its_files(
        tmp_path: Path, hooked, monkeypatch, lora) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    base = write_base_weights(tiny_config(tmp_path, {**DP2, **lora}).model, tmp_path / "base") if lora else None
    hooked(HOOK_SAMPLE_LOG=str(tmp_path / "straight-samples"))
    straight = train(tiny_config(tmp_path, {**DP2, **lora}, out="straight"), dataset, init_path=base)

    # The same experiment, mirrored; rank 1's node dies after step 3 reached the mirror.
    mirror = tmp_path / "mirror"
    cfg2 = tiny_config(tmp_path, {**DP2, **lora, "train.checkpoint_url": f"file://{mirror}"}, out="killed")
    out, root = Path(cfg2.train.output_dir), ck.ckpt_root(cfg2.train.output_dir)
    out.mkdir(parents=True)
    run = for_dataset(cfg2, dataset)
    hooked(HOOK_STEP_DELAY_S="1.0", HOOK_SAMPLE_LOG=str(tmp_path / "killed-samples"))
    proc = _start(cfg2, dataset, run, base)
    try:
        _wait_for(lambda: (mirror / run.run_id / "step-000003" / ck.MARKER).is_file(), proc, "step 3 in the mirror")
        os.kill({_rank_of(pid): pid for pid in _children(proc.pid)}[1], signal.SIGKILL)
    finally:
        assert _reap(proc) != 0
    mirrored = sorted(p.name for p in (mirror / run.run_id / "step-000003").iterdir())
    shutil.rmtree(root)  # the run continues on a replacement machine: an empty disk, one rank

    # One node left: dp=1, two micro-batches; the same key, so the same run and its mirrored checkpoint.
    cfg1 = tiny_config(tmp_path, {**DP1, **lora, "train.checkpoint_url": f"file://{mirror}"}, out="killed")
    assert for_dataset(cfg1, dataset).experiment_key == run.experiment_key
    monkeypatch.delenv("HOOK_STEP_DELAY_S")
    hooked(HOOK_SAMPLE_LOG=str(tmp_path / "resumed-samples"))
    proc = _start(cfg1, dataset, run, base)
    assert _reap(proc) == 0, (out / "torchrun.log").read_text()[-3000:]
    resumed = json.loads((out / "summary.json").read_text())

    assert resumed["resumed_from_step"] == 3
    assert resumed["resharded"] == {"from_dp": 2, "to_dp": 1, "at_step": 3}
    assert "from dp=2 to dp=1" in (out / "torchrun.log").read_text()
    assert len(resumed["losses"]) == len(straight["losses"]) == 6
    for step, (got, want) in enumerate(zip(resumed["losses"], straight["losses"], strict=True), start=1):
        assert abs(got - want) <= 1e-6, f"step {step}: resumed at dp=1 {got} vs unbroken dp=2 {want}"
    want_order, got_order = _global_order(tmp_path / "straight-samples"), _global_order(tmp_path / "resumed-samples")
    assert sorted(got_order) == [4, 5, 6]
    assert {s: want_order[s] for s in got_order} == got_order

    # The replacement fetched what its one rank loads: the weights, the engine's state, both old ZeRO
    # partitions (its share is now both), rank 0's state; never rank 1's.
    fetched = sorted(p.name for p in (root / "step-000003").iterdir() if p.name != ck.MARKER)
    expected = [n for n in mirrored if n not in (ck.MARKER, ck.rank_file(Path(), 1).name)]
    assert fetched == expected
    assert sum(n.startswith("zero_pp_rank_") for n in fetched) == 2 and len(fetched) == len(mirrored) - 2


@pytest.mark.parametrize("change", [{"parallel.tp": 2}, {"parallel.pp": 2}])
def test_tp_or_pp_change_against_the_checkpoint_is_refused_before_any_rank(tmp_path: Path, change) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    written = tiny_config(tmp_path, {"train.steps": 6})
    run = for_dataset(written, dataset)
    root = ck.ckpt_root(written.train.output_dir)
    (root / "tmp-step-000003").mkdir(parents=True)
    ck.finalize(root, "step-000003", ck.make_marker(written, run, "step-000003", 3, 1), keep_last=2)

    changed = written.with_overrides(change)
    assert for_dataset(changed, dataset).experiment_key == run.experiment_key  # the same run, its checkpoint
    with pytest.raises(InvalidInputError) as err:
        train(changed, dataset)
    what = next(iter(change)).split(".")[1]
    assert f"{what}=1 -> 2" in str(err.value) and "parallel.dp may change" in str(err.value)
    assert str(root / "step-000003") in str(err.value)
    assert not (Path(written.train.output_dir) / STATUS_FILE).exists()  # no rank ever started


def test_a_new_share_reads_only_the_old_partitions_it_overlaps() -> None:
    old = partition_numel(1000, 4, 2)  # 250 each at dp=4
    assert old == 250 and partition_numel(1001, 4, 2) == 252
    new = partition_numel(1000, 3, 2)  # 334 at dp=3: rank 1 holds [334, 668)
    assert list(overlapping(new, 2 * new, old)) == [1, 2]
    assert list(overlapping(0, 1000, old)) == [0, 1, 2, 3]  # dp=1: all four
    assert list(overlapping(1000, 1000, old)) == []  # a share that is all padding reads nothing


def test_the_key_follows_the_global_batch_not_the_layout(tmp_path: Path) -> None:
    base = tiny_config(tmp_path, {"parallel.dp": 4, "parallel.micro_batches": 1})
    same = [{"parallel.dp": 2, "parallel.micro_batches": 2}, {"parallel.dp": 1, "parallel.micro_batches": 4},
            {"parallel.tp": 2, "parallel.pp": 2}]
    assert all(base.with_overrides(o).fingerprint() == base.fingerprint() for o in same)
    other = [{"parallel.dp": 2}, {"train.micro_batch_size": 2}, {"parallel.zero_stage": 0}]
    assert all(base.with_overrides(o).fingerprint() != base.fingerprint() for o in other)


def test_lowering_dp_without_raising_micro_batches_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """A dp=2 run stopped at step 4 of 8 (its node died); the person edits the config to dp=1 and forgets the
    micro-batches: the global batch halves, which is a new experiment that would start over from step 0. The
    run is refused before anything starts, naming the setting that resumes the stopped run; with it set, the
    run is the stopped one again; forced, the new run may start; a finished run at another batch is no loss."""
    import yaml

    from tasks.data.synthetic import make_data
    from tasks.models.resolve import load_config
    from tasks.stages.lifecycle import stage_identify, stage_plan
    from tests.test_weekly_retrain import retrainer, week_config

    config = week_config(tmp_path)
    doc = yaml.safe_load(config.read_text())

    def edit(**parallel: int) -> Path:
        doc["parallel"].update(parallel)
        config.write_text(yaml.safe_dump(doc))
        return config

    cfg2 = load_config(edit(dp=2, micro_batches=1))
    make_data(cfg2.data.source_url, name=cfg2.name, n_train_shards=2, tokens_per_shard=16384)
    stopped = stage_identify(cfg2)
    root = ck.ckpt_root(stopped.run_dir(cfg2))
    (root / "tmp-step-000004").mkdir(parents=True)
    ck.finalize(root, "step-000004", ck.make_marker(cfg2, stopped, "step-000004", 4, 1), keep_last=2)

    done = retrainer("run", str(edit(dp=1)), tmp=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"run {stopped.run_id}" in done.stderr and "stopped at step 4 of 8" in done.stderr
    assert "set parallel.micro_batches: 2" in done.stderr
    assert [p.name for p in Path(cfg2.train.output_dir).iterdir()] == [stopped.run_id]  # nothing else started

    fixed = load_config(edit(dp=1, micro_batches=2))
    assert stage_identify(fixed).run_id == stopped.run_id  # the stopped run, which resumes
    assert stage_plan(fixed, stopped).fits

    forgot = load_config(edit(dp=1, micro_batches=1))
    assert stage_plan(forgot, stage_identify(forgot), force=True).fits  # forced: the new run may start
    (root / "tmp-step-000008").mkdir()
    ck.finalize(root, "step-000008", ck.make_marker(cfg2, stopped, "step-000008", 8, 1), keep_last=2)
    assert stage_plan(forgot, stage_identify(forgot)).fits  # the dp=2 run finished: another experiment
