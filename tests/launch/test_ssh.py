"""The ssh launcher across two real hosts (network namespaces with their own sshd)."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import pytest

from tasks.base.errors import TrainingFailedError
from tasks.config.schema import JobConfig
from tasks.launch import LaunchOptions, get_launcher
from tasks.models.weights import weights_digest
from tests.launch.conftest import NetnsHosts, tiny_config, write_dataset
from tests.launch.helpers import is_rank, launched, source_line, training_processes, wait_for_step

pytestmark = pytest.mark.multiproc


def ssh_config(tmp_path: Path, hosts: NetnsHosts, out: str, **overrides: object) -> JobConfig:
    return tiny_config(tmp_path, {**hosts.overrides(), **overrides}, out=out)


def test_two_nodes_by_two_ranks_match_one_node_of_four(netns_hosts: NetnsHosts, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    multi_cfg = ssh_config(tmp_path, netns_hosts, "multi", **{"parallel.dp": 4})
    multi = get_launcher(multi_cfg, env=netns_hosts.env).run(multi_cfg, dataset)

    single_cfg = tiny_config(tmp_path, {"parallel.dp": 4}, out="single")
    single = get_launcher(single_cfg).run(single_cfg, dataset)

    assert multi["world_size"] == single["world_size"] == 4
    assert len(multi["losses"]) == multi_cfg.train.steps
    assert multi["losses"] == single["losses"]
    assert weights_digest(multi["checkpoint_dir"], multi_cfg.model) == weights_digest(single["checkpoint_dir"],
                                                                                       single_cfg.model)
    assert netns_hosts.left_behind() == []


def test_sigterm_to_launcher_leaves_no_process_on_any_node(netns_hosts: NetnsHosts, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    cfg = ssh_config(tmp_path, netns_hosts, "killed", **{"parallel.dp": 2, "train.steps": 200})
    env = {**netns_hosts.env, "HOOK_STEP_DELAY_S": "0.3"}
    with launched(cfg, dataset, env, tmp_path / "launcher.log") as launcher:
        wait_for_step(cfg.train.output_dir, 2, launcher)
        assert netns_hosts.training_pids(0) and netns_hosts.training_pids(1)  # really running on both nodes
        launcher.send_signal(signal.SIGTERM)
        rc = launcher.wait(timeout=120)
    log = (tmp_path / "launcher.log").read_text()
    assert rc == 143, log[-3000:]
    assert "cancelled" in log
    assert netns_hosts.training_pids(0) == [], "processes left on node 1"
    assert netns_hosts.training_pids(1) == [], "processes left on node 2"
    assert training_processes(cfg.train.output_dir) == []
    assert not (Path(cfg.train.output_dir) / "summary.json").exists()


def test_hung_rank_is_detected_and_the_job_cancelled_on_every_node(netns_hosts: NetnsHosts, tmp_path: Path,
                                                                    hooked) -> None:
    dataset = write_dataset(tmp_path / "dataset")
    cfg = ssh_config(tmp_path, netns_hosts, "hung", **{"parallel.dp": 2, "train.steps": 100,
                                                       "cluster.hang_timeout_s": 10, "cluster.startup_timeout_s": 300})
    hooked(HOOK_STEP_DELAY_S="0.3")
    env = netns_hosts.env
    stopped: list[int] = []

    def hang_the_rank_on_node_2() -> None:
        wait_for_step(cfg.train.output_dir, 2)
        ranks = [p for p in training_processes(cfg.train.output_dir)
                 if p.pid in netns_hosts.pids(1) and is_rank(p)]
        ranks[0].send_signal(signal.SIGSTOP)
        stopped.append(ranks[0].pid)

    thread = threading.Thread(target=hang_the_rank_on_node_2, daemon=True)
    thread.start()
    with pytest.raises(TrainingFailedError, match=r"hung .*last finished step \d+.*cancelled on every node"):
        get_launcher(cfg, env=env).run(cfg, dataset)
    thread.join(timeout=10)
    assert stopped, "the rank was never stopped"
    assert netns_hosts.left_behind() == []
    assert training_processes(cfg.train.output_dir) == []
    assert not (Path(cfg.train.output_dir) / "summary.json").exists()


def test_a_ranks_exception_on_the_second_host_reaches_the_launchers_error(netns_hosts: NetnsHosts, tmp_path: Path,
                                                                         hooked) -> None:
    """The rank on the second host dies of an IndexError at step 2 (a token id past the vocabulary,
    tests/hooks): its node's spawner reports it over the ssh channel, and the launcher's error names the
    rank, the exception, its message and the line of our code, not a bare exit status."""
    dataset = write_dataset(tmp_path / "dataset")
    cfg = ssh_config(tmp_path, netns_hosts, "crash", **{"parallel.dp": 2, "train.steps": 4})
    hooked(HOOK_BAD_TOKEN_AT="2:1")
    with pytest.raises(TrainingFailedError) as failed:
        get_launcher(cfg, env=netns_hosts.env).run(cfg, dataset)
    where = source_line("tasks/models/gpt/model.py", "self.drop(self.tok(tokens)")
    assert re.fullmatch(r"training of tiny-test failed \(ssh launcher\): rank 1 failed: IndexError: index out of "
                        rf"range in self \({re.escape(where)} on \S+\)", str(failed.value)), str(failed.value)
    assert netns_hosts.left_behind() == []


def test_no_secret_reaches_a_node_argv_or_the_run_dir_while_running_or_after_a_kill(
    netns_hosts: NetnsHosts, tmp_path: Path
) -> None:
    """The launcher's environment and config carry secrets; no node's process table, no rank's environment
    and no file under the run directory may show them, while the ranks run and after a SIGKILL."""
    import secrets

    from tests.secrets_scan import argv_containing, environments_containing, files_containing

    password, aws_secret = f"dbpw-{secrets.token_hex(8)}", f"aws-{secrets.token_hex(16)}"
    values = [password, aws_secret]
    dataset = write_dataset(tmp_path / "dataset")
    cfg = ssh_config(tmp_path, netns_hosts, "secret", **{
        "parallel.dp": 2, "train.steps": 200,
        "publish.registry_url": f"postgresql+psycopg://u:{password}@db.internal/registry",
        "data.storage_options": {"key": "AKIA0", "secret": aws_secret}})
    env = {**netns_hosts.env, "HOOK_STEP_DELAY_S": "0.3", "AWS_SECRET_ACCESS_KEY": aws_secret,
           "RETRAINER_DB_URL": f"postgresql://u:{password}@db.internal/registry"}
    out = Path(cfg.train.output_dir)
    with launched(cfg, dataset, env, tmp_path / "launcher.log") as launcher:
        wait_for_step(out, 2, launcher)
        on_nodes = netns_hosts.training_pids(0) + netns_hosts.training_pids(1)
        assert len([p for p in training_processes(out) if is_rank(p)]) == 2
        assert argv_containing(values, netns_hosts.names) == []
        assert environments_containing(on_nodes, values) == []
        run_files = [p for p in out.iterdir() if p.is_file() and p.suffix == ".json"]
        assert run_files  # the worker config and the status are there, and clean
        assert files_containing([out], values) == []
        launcher.kill()  # SIGKILL of the task: no cleanup code runs on this side
        launcher.wait()
    assert files_containing([out], values) == []
    assert "dbpw-" not in (tmp_path / "launcher.log").read_text()
    # Each node's agent tears its node down once its ssh channel is gone.
    assert netns_hosts.left_behind(timeout_s=90) == []


def test_each_host_warms_its_own_copy_from_s3_refetches_a_corrupt_file_and_fails_by_name_without_s3(
        netns_hosts: NetnsHosts, tmp_path: Path) -> None:
    import subprocess

    from tasks.data.synthetic import make_data
    from tasks.data.warm import remote_manifest_hash, warm_for_config
    from tasks.runs.identity import identity, scratch
    from tests.services import S3Endpoint

    s3 = S3Endpoint.start(ip=netns_hosts.service_addr)  # on the hosts' bridge: both reach it
    try:
        source = f"s3://{s3.create_bucket()}/corpus"
        make_data(source, name="tiny-test", seed=5, tokens_per_shard=16384, storage_options=s3.storage_options)
        data = {"data.cache_dir": str(netns_hosts.node_cache), "data.source_url": source,
                "data.storage_options": s3.storage_options, "parallel.dp": 2}
        cfg = ssh_config(tmp_path, netns_hosts, "warmed", **data)
        run = identity(cfg, remote_manifest_hash(source, storage_options=s3.storage_options), scratch(cfg))
        here = warm_for_config(cfg)  # the Airflow worker's own copy (planning, evaluation), in its own node-cache
        summary = get_launcher(cfg, env=netns_hosts.env).run(cfg, here.dataset_dir, run=run,
                                                             options=LaunchOptions(node_warm=True))

        nodes = summary["nodes"]
        assert [n["node"] for n in nodes] == netns_hosts.addrs
        assert all(n["manifest_hash"] == run.data_manifest_hash and n["files_fetched"] == n["files"] > 0
                   for n in nodes)  # each host fetched its own copy from S3
        dataset = Path(nodes[0]["dataset_dir"]).relative_to(netns_hosts.node_cache)
        for private in netns_hosts.host_caches:  # on its own disk
            assert (private / dataset / "manifest.json").is_file()
        single_cfg = tiny_config(tmp_path, {"parallel.dp": 2}, out="single")
        single = get_launcher(single_cfg).run(single_cfg, here.dataset_dir)
        assert summary["losses"] == single["losses"]
        assert weights_digest(summary["checkpoint_dir"], cfg.model) == weights_digest(single["checkpoint_dir"],
                                                                                       cfg.model)

        # A byte flipped in host 2's copy: its next warm re-fetches that file (and only that one).
        shard = sorted((netns_hosts.host_caches[1] / dataset / "train").glob("*"))[0]
        good = shard.read_bytes()
        shard.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
        again_cfg = ssh_config(tmp_path, netns_hosts, "again", **data)
        again = get_launcher(again_cfg, env=netns_hosts.env).run(again_cfg, here.dataset_dir, run=run,
                                                                 options=LaunchOptions(node_warm=True))
        assert [n["files_fetched"] for n in again["nodes"]] == [0, 1]
        assert shard.read_bytes() == good

        # Host 2 loses its route to S3: the launch fails naming it, before any rank starts.
        blocked_cfg = ssh_config(tmp_path, netns_hosts, "blocked", **data)
        route = ["ip", "-n", netns_hosts.names[1], "route", "add", "blackhole", f"{netns_hosts.service_addr}/32"]
        subprocess.run(route, check=True)
        try:
            with pytest.raises(TrainingFailedError, match=rf"warm on node {netns_hosts.addrs[1]} failed, no rank "
                                                          r"started"):
                get_launcher(blocked_cfg, env=netns_hosts.env).run(blocked_cfg, here.dataset_dir, run=run,
                                                                   options=LaunchOptions(node_warm=True))
        finally:
            subprocess.run([*route[:4], "del", *route[5:]], check=True)
        assert not (Path(blocked_cfg.train.output_dir) / "status.json").exists()

        # New data lands after the run was planned: the hosts refuse it, naming themselves.
        make_data(source, name="tiny-test", seed=6, tokens_per_shard=16384, storage_options=s3.storage_options)
        late = ssh_config(tmp_path, netns_hosts, "late", **data)
        with pytest.raises(TrainingFailedError, match=r"warm on node 10\.[\d.]+ failed, no rank started: node "
                                                      r"10\.[\d.]+: the dataset at .* verified as manifest"):
            get_launcher(late, env=netns_hosts.env).run(late, here.dataset_dir, run=run,
                                                        options=LaunchOptions(node_warm=True))
        assert netns_hosts.left_behind() == []
    finally:
        s3.stop()


def test_each_host_refuses_a_shard_the_model_cannot_read_before_any_rank_starts(netns_hosts: NetnsHosts,
                                                                                 tmp_path: Path) -> None:
    """Each node's own warm (tasks/inputs/node.py) runs the warm stage's token check: a shard holding an id the
    model has no row for stops the launch, naming the node, the shard and the id; nothing of it stays cached."""
    import numpy as np

    from tasks.data.synthetic import make_data
    from tasks.data.warm import remote_manifest_hash, warm
    from tasks.runs.identity import identity, scratch
    from tests.data.warm.test_dataset_checks import rewrite

    source = tmp_path / "corpus"
    make_data(str(source), name="tiny-test", seed=5, tokens_per_shard=16384)
    ids = np.fromfile(source / "train" / "shard-00001.bin", dtype="<u2")
    ids[100] = 300
    rewrite(source, "train/shard-00001.bin", ids.tobytes())
    cfg = ssh_config(tmp_path, netns_hosts, "refused", **{"data.cache_dir": str(netns_hosts.node_cache),
                                                          "data.source_url": str(source), "parallel.dp": 2})
    run = identity(cfg, remote_manifest_hash(str(source)), scratch(cfg))
    here = warm(str(source), tmp_path / "here", progress=False)  # this machine's copy, warmed without a model
    with pytest.raises(TrainingFailedError, match=r"warm on node 10\.[\d.]+ failed, no rank started: .*"
                                                  r"train/shard-00001\.bin holds token id 300, not below "
                                                  r"model\.vocab_size 256"):
        get_launcher(cfg, env=netns_hosts.env).run(cfg, here.dataset_dir, run=run,
                                                   options=LaunchOptions(node_warm=True))
    assert not (Path(cfg.train.output_dir) / "status.json").exists()
    refused = run.data_manifest_hash[:16]  # the cache's name for this dataset (other tests' datasets may stay)
    for private in netns_hosts.host_caches:
        assert not [p for p in private.rglob("*") if p.is_file() and "datasets" in p.parts
                    and (refused in p.name or refused in p.parts)], private  # its lock files may stay
    assert netns_hosts.left_behind() == []


def test_node_local_run_dirs_are_mirrored_and_a_host_that_lost_its_disk_resumes_bit_for_bit(
        netns_hosts: NetnsHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """...and the finished run is evaluated on those hosts: the weights come from their disks and the mirror."""
    import shutil

    from tasks.data.synthetic import make_data
    from tasks.evaluate import evaluate
    from tasks.runs.identity import for_dataset

    mirror = tmp_path / "mirror"
    layout = {"parallel.dp": 2, "train.steps": 6, "train.checkpoint_every": 2, "train.keep_last": 2}
    reference_cfg = tiny_config(tmp_path, layout, out="one-machine")
    dataset = Path(reference_cfg.data.source_url)  # a local source is a warmed dataset's layout too
    make_data(str(dataset), name="tiny-test", n_train_shards=2, tokens_per_shard=8192, seed=4)
    reference = get_launcher(reference_cfg).run(reference_cfg, dataset)
    cfg = ssh_config(tmp_path, netns_hosts, "unused", **layout, **{
        "train.output_dir": str(netns_hosts.node_run), "train.checkpoint_url": f"file://{mirror}"})
    run_id = for_dataset(cfg, dataset).run_id

    # Each host's run directory is its own (status and summary come back through node 1's agent). Killed once
    # step 4 is mirrored; then host 2 loses its disk (a replacement node, an empty SSD).
    with launched(cfg, dataset, {**netns_hosts.env, "HOOK_STEP_DELAY_S": "1"}, tmp_path / "first.log") as launcher:
        deadline = time.monotonic() + 300
        while (mirror / run_id / "step-000004" / "COMPLETE").exists() is False:
            assert launcher.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "step 4 never reached the mirror"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 143
    for leftover in netns_hosts.host_runs[1].iterdir():
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    assert not (netns_hosts.node_run / "ckpt").exists()  # the launcher's own view holds no checkpoint either

    resumed = get_launcher(cfg, env=netns_hosts.env).run(cfg, dataset)
    assert resumed["resumed_from_step"] >= 4 and resumed["losses"] == reference["losses"]
    # The replaced host fetched only what its own rank loads: rank 0's ZeRO partition and state stayed behind.
    tag = f"step-{resumed['resumed_from_step']:06d}"
    mirrored = {p.name for p in (mirror / run_id / tag).iterdir()}
    on_new_disk = {p.name for p in (netns_hosts.host_runs[1] / "ckpt" / tag).iterdir()}
    assert on_new_disk == mirrored - {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "rank-00000.pt"}
    assert len(on_new_disk) == len(mirrored) - 2
    for host_run in netns_hosts.host_runs:  # each host committed step 6 on its own disk
        assert (host_run / "ckpt" / "step-000006" / "COMPLETE").is_file()
    assert (netns_hosts.host_runs[0] / "summary.json").is_file()  # the summary came back through the agent
    assert not (netns_hosts.node_run / "summary.json").exists()
    assert weights_digest(netns_hosts.host_runs[0] / "ckpt" / "step-000006", cfg.model) == weights_digest(
        reference["checkpoint_dir"], cfg.model)
    assert (mirror / run_id / "latest").read_text().strip() == "step-000006"
    assert sorted(p.name for p in (mirror / run_id).iterdir() if p.name.startswith("step-")) == [
        "step-000004", "step-000006"]  # pruned to keep_last there too

    # Evaluate the run where it lives: this side sees no checkpoint; host 1 holds the weight files, host 2 (its
    # new disk has only its own part) fetches them from the mirror. Same numbers as the one-machine run's.
    expected = evaluate(reference_cfg, for_dataset(reference_cfg, dataset), reference["checkpoint_dir"], dataset)
    for name, value in netns_hosts.env.items():
        monkeypatch.setenv(name, value)
    scored = evaluate(cfg, for_dataset(cfg, dataset), netns_hosts.node_run / "ckpt" / "step-000006", dataset)
    assert scored.metrics == pytest.approx(expected.metrics, rel=1e-9)
    assert scored.checkpoint_tag == "step-000006" and scored.step == 6
    fetched = list(netns_hosts.host_runs[1].glob("eval/*/weights/step-000006/layer_*"))
    assert fetched and not list(netns_hosts.host_runs[1].glob("eval/*/weights/step-000006/*optim*"))
    assert not list(netns_hosts.host_runs[0].glob("eval/*/weights"))  # host 1 had them: nothing fetched
    assert netns_hosts.left_behind() == []


def test_a_retried_run_reuses_the_export_each_host_holds_a_part_of(netns_hosts: NetnsHosts, tmp_path: Path) -> None:
    """pp=2 over two hosts, each with its own run dir: each host keeps the reports of its own stage's files. The
    train task retried after the ranks exported (killed before its result was recorded) trains nothing and
    reuses the union of both hosts' reports: no file is written again, every byte is what was reported."""
    import hashlib

    from tasks.stages.lifecycle import export_spec

    cfg = ssh_config(tmp_path, netns_hosts, "unused", **{
        "parallel.pp": 2, "train.steps": 2, "train.checkpoint_every": 2,
        "train.output_dir": str(netns_hosts.node_run), "train.checkpoint_url": f"file://{tmp_path / 'mirror'}"})
    dataset = write_dataset(tmp_path / "dataset")
    first_spec, retry_spec = export_spec(cfg)[0], export_spec(cfg)[0]
    first = get_launcher(cfg, env=netns_hosts.env).run(cfg, dataset, options=LaunchOptions(export=first_spec))
    files = [shard["file"]["path"] for shard in first["export"]["shards"]]
    assert files == [f"model-{i:05d}-of-00008.safetensors" for i in range(1, 9)]
    held = [sorted(p.name for p in (run / "export" / "step-000002").iterdir()) for run in netns_hosts.host_runs]
    assert held == [[f"shard-{i:05d}.json" for i in range(4)], [f"shard-{i:05d}.json" for i in range(4, 8)]]

    retried = get_launcher(cfg, env=netns_hosts.env).run(cfg, dataset, options=LaunchOptions(export=retry_spec))
    assert retried["trained_steps"] == 0 and retried["resumed_from_step"] == 2
    assert retried["export"] == first["export"]  # every shard reused, from the first staging area
    assert list(Path(retry_spec["staging"].removeprefix("file://")).iterdir()) == []
    for shard in retried["export"]["shards"]:
        data = (Path(shard["staging"].removeprefix("file://")) / shard["file"]["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (shard["file"]["size"], shard["file"]["sha256"])
    assert netns_hosts.left_behind() == []


def test_evaluation_ranks_across_two_hosts_match_one_local_rank(netns_hosts: NetnsHosts, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation through the ssh launcher, tp=2 x pp=2 over two hosts (stage-to-stage sends cross hosts):
    the same numbers as one local rank (in fp32: `evaluate.dtype`'s layout-exact mode), and nothing left on either
    host."""
    from tasks.evaluate import evaluate
    from tests.checkpoints import reference_checkpoint

    cfg = ssh_config(tmp_path, netns_hosts, "eval", **{"model.family": "llama", "evaluate.dtype": "fp32"})
    run, ckpt = reference_checkpoint(cfg)
    local = evaluate(cfg.with_overrides({"cluster.launcher": "local", "cluster.master_addr": "127.0.0.1"}), run, ckpt,
                     cfg.data.source_url)
    for name, value in netns_hosts.env.items():
        monkeypatch.setenv(name, value)
    remote = evaluate(cfg.with_overrides({"evaluate.parallel": {"tp": 2, "pp": 2, "dp": 1}}), run, ckpt,
                      cfg.data.source_url)
    assert remote.metrics["heldout.loss"] == pytest.approx(local.metrics["heldout.loss"], rel=1e-6, abs=0)
    assert remote.tokens == local.tokens
    assert netns_hosts.left_behind() == []
