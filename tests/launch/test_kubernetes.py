"""The kubernetes launcher's PyTorchJob: rendered with the official client's models and checked against the
CRD structure. No cluster runs here: a job's life is checked only as far as the API calls go, against an
HTTP stand-in of the API server (tests/launch/k8s_api.py) whose pods' logs are real spawners' output."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import jsonschema
import pytest

from tasks.base.errors import InvalidInputError
from tasks.config.schema import JobConfig
from tasks.launch import JobSpec, get_launcher
from tasks.launch.k8s_schema import PYTORCHJOB_SCHEMA
from tasks.launch.kubernetes import KubernetesLauncher, validate_manifest
from tests.launch.conftest import tiny_config, write_dataset


def k8s_config(tmp_path: Path, **overrides: object) -> JobConfig:
    return tiny_config(tmp_path, {"cluster.launcher": "kubernetes", "cluster.image": "registry.example/retrainer:1",
                                  "cluster.namespace": "ml-train", "cluster.kubernetes.nodes": 2,
                                  "parallel.dp": 4, **overrides})


def render(tmp_path: Path, **overrides: object) -> dict:
    cfg = k8s_config(tmp_path, **overrides)
    launcher = get_launcher(cfg)
    assert isinstance(launcher, KubernetesLauncher)
    spec = JobSpec("0123456789abcdef", Path(cfg.train.output_dir))
    return launcher.manifest(cfg, spec, tmp_path / "cache" / "ds", spec.output_dir / "job.json", "ab" * 16)


def pod_spec(job: dict, replica: str = "Master") -> dict:
    return job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]


def test_manifest_is_a_valid_pytorchjob_with_master_workers_gpus_env_and_volumes(tmp_path: Path) -> None:
    job = render(tmp_path, **{"cluster.kubernetes.memory": "32Gi", "cluster.kubernetes.cpu": "8"})
    jsonschema.Draft7Validator.check_schema(PYTORCHJOB_SCHEMA)
    jsonschema.validate(job, PYTORCHJOB_SCHEMA)

    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["namespace"] == "ml-train"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1  # 2 nodes
    pod = specs["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["image"] == "registry.example/retrainer:1"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2", "cpu": "8", "memory": "32Gi"}
    env = {e["name"]: e["value"] for e in container["env"]}  # plain values only: no secret configured
    assert env["RETRAINER_LAUNCH_ID"] == "ab" * 16 and env["OMP_NUM_THREADS"] == "1"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "2097152"  # the ranks' allocator setting (issue 38) reaches the pods
    cfg = k8s_config(tmp_path)
    scoring = get_launcher(cfg).manifest(cfg, JobSpec("0123456789abcdef", Path(cfg.train.output_dir)),
                                         tmp_path / "cache" / "ds", tmp_path / "job.json", "ab" * 16, evaluation=True)
    (scorer,) = pod_spec(scoring, "Worker")["containers"]
    scoring_env = {e["name"]: e["value"] for e in scorer["env"]}
    assert scoring_env["OMP_NUM_THREADS"] == "1" and scoring_env["THP_MEM_ALLOC_ENABLE"] == "1"
    assert scoring_env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)  # the evaluation ranks' own allocator setting
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["ssd-cache"] == str(tmp_path / "cache") and "hostPath" in volumes["ssd-cache"]
    assert volumes["output"]["persistentVolumeClaim"]["claimName"] == "retrainer-output"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert [p["name"] for p in container["ports"]] == ["pytorchjob-port"]
    # torchrun per pod: 2 nodes x 2 ranks, node rank and rendezvous from the operator's env.
    assert container["command"][:2] == ["bash", "-c"]
    words = shlex.split(container["command"][2])
    assert "--nnodes=2" in words and "--nproc-per-node=2" in words
    assert "--node-rank=$RANK" in words and "--master-addr=$MASTER_ADDR" in words
    assert "--master-port=$MASTER_PORT" in words and "tasks.train.worker" in words
    # Under the node agent, which relays the run's status file into the log the launcher follows.
    assert words[2:6] == ["-m", "tasks.launch.agent", "run", "--tag"]
    assert words[words.index("--relay-status") + 1] == str(tmp_path / "run" / "status.json")
    # One name per run: a retry finds (and deletes) the job an earlier attempt left.
    assert job["metadata"]["name"] == "retrainer-tiny-test-0123456789ab"


def test_resources_service_account_and_secret_env_come_from_the_config(tmp_path: Path) -> None:
    section = {"nodes": 2, "gpus_per_node": 8, "cpu": "16", "memory": "64Gi", "output_claim": "train-out",
               "cache_host_path": "/mnt/nvme/cache", "python": "/usr/bin/python3", "service_account": "trainer",
               "env": {"NCCL_DEBUG": "WARN"},
               "env_from_secrets": {"HF_TOKEN": {"secret": "hf-credentials", "key": "token"}}}
    job = render(tmp_path, **{"cluster.kubernetes": section})
    jsonschema.validate(job, PYTORCHJOB_SCHEMA)
    validate_manifest(job)
    for replica in ("Master", "Worker"):
        pod = pod_spec(job, replica)
        assert pod["serviceAccountName"] == "trainer"
        (container,) = pod["containers"]
        quantities = {"nvidia.com/gpu": "8", "cpu": "16", "memory": "64Gi"}
        assert container["resources"] == {"limits": quantities, "requests": quantities}
        env = {e["name"]: e for e in container["env"]}
        assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "WARN"}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN",
                                   "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}}
        assert shlex.split(container["command"][2])[1] == "/usr/bin/python3"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["ssd-cache"]["hostPath"]["path"] == "/mnt/nvme/cache"
        assert volumes["output"]["persistentVolumeClaim"]["claimName"] == "train-out"


def test_schema_refuses_a_secret_reference_without_its_key(tmp_path: Path) -> None:
    job = render(tmp_path, **{"cluster.kubernetes.env_from_secrets": {"TOKEN": {"secret": "s", "key": "k"}}})
    (container,) = pod_spec(job)["containers"]
    ref = next(e for e in container["env"] if e["name"] == "TOKEN")["valueFrom"]["secretKeyRef"]
    del ref["key"]
    with pytest.raises(InvalidInputError, match="secretKeyRef"):
        validate_manifest(job)


def test_single_node_job_has_only_a_master(tmp_path: Path) -> None:
    job = render(tmp_path, **{"cluster.kubernetes.nodes": 1, "cluster.kubernetes.gpus_per_node": 0})
    validate_manifest(job)
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert pod_spec(job)["containers"][0]["resources"] == {}  # no GPU asked for, no limits rendered


@pytest.mark.parametrize(("path", "value", "field"), [
    (["spec", "pytorchReplicaSpecs", "Master", "replicas"], 2, "spec.pytorchReplicaSpecs.Master.replicas"),
    (["spec", "pytorchReplicaSpecs", "Chief"], {}, "spec.pytorchReplicaSpecs"),
    (["spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"], "Sometimes", "restartPolicy"),
    (["metadata", "name"], "Bad_Name", "metadata.name"),
    (["spec", "runPolicy", "cleanPodPolicy"], "Everything", "spec.runPolicy.cleanPodPolicy"),
])
def test_schema_refuses_what_the_operator_would(tmp_path: Path, path: list[str], value: object, field: str) -> None:
    job = copy.deepcopy(render(tmp_path))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(InvalidInputError, match=field.split(".")[-1]):
        validate_manifest(job)


def test_bad_quantity_and_missing_container_name_are_refused(tmp_path: Path) -> None:
    job = render(tmp_path)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "two"
    with pytest.raises(InvalidInputError, match="resources"):
        validate_manifest(job)
    container["resources"]["limits"]["nvidia.com/gpu"] = "2"
    container["name"] = "trainer"
    with pytest.raises(InvalidInputError, match="containers"):
        validate_manifest(job)


def test_missing_image_is_a_clear_config_error(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, {"cluster.launcher": "kubernetes"})
    with pytest.raises(InvalidInputError, match=r"cluster\.image"):
        get_launcher(cfg).manifest(cfg, JobSpec("0123456789abcdef", tmp_path / "run"), tmp_path / "ds",
                                   tmp_path / "job.json", "ef" * 16)


def test_init_container_warms_every_pod_node_and_keeps_credentials_out_of_the_manifest(tmp_path: Path) -> None:
    import json

    from tasks.inputs.node import SPEC_VAR, node_spec
    from tasks.runs.identity import identity, scratch

    cfg = k8s_config(tmp_path, **{"cluster.kubernetes.cache_volume": "claim",
                                  "cluster.kubernetes.cache_claim": "local-ssd",
                                  "cluster.kubernetes.env_from_secrets": {
                                      "AWS_SECRET_ACCESS_KEY": {"secret": "s3-creds", "key": "secret"}}})
    run = identity(cfg, "e" * 64, scratch(cfg))
    launcher = get_launcher(cfg)
    out = Path(cfg.train.output_dir)
    job = launcher.manifest(cfg, JobSpec(run.run_id, out), tmp_path / "cache" / "ds", out / "job.json", "ab" * 16,
                            node_spec(cfg, run, out))
    for replica in ("Master", "Worker"):
        pod = pod_spec(job, replica)
        (init,) = pod["initContainers"]
        assert init["name"] == "warm" and init["image"] == "registry.example/retrainer:1"
        assert init["command"][:3] == ["python", "-m", "tasks.inputs.node"]
        assert init["command"][init["command"].index("--report-dir") + 1] == str(tmp_path / "run" / "warm")
        env = {e["name"]: e for e in init["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "secret"}
        spec = json.loads(env[SPEC_VAR]["value"])
        assert spec["manifest_hash"] == "e" * 64 and spec["source_url"] == cfg.data.source_url
        assert {m["name"] for m in init["volumeMounts"]} == {"ssd-cache", "output"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["ssd-cache"] == {"name": "ssd-cache", "persistentVolumeClaim": {"claimName": "local-ssd"}}

    leaky = k8s_config(tmp_path, **{"data.storage_options": {"key": "AKIA-EXAMPLE", "secret": "hunter2",
                                                            "client_kwargs": {"endpoint_url": "http://s3:9000"}}})
    with pytest.raises(InvalidInputError, match=r"data\.storage_options: key, secret would be written into the "
                                                r"PyTorchJob.*env_from_secrets"):
        get_launcher(leaky).manifest(leaky, JobSpec(run.run_id, out), tmp_path / "cache" / "ds", Path("job.json"),
                                     "ab" * 16, node_spec(leaky, identity(leaky, "e" * 64, scratch(leaky)), out))


def test_evaluation_ranks_run_the_evaluation_worker_in_their_own_job(tmp_path: Path) -> None:
    """The evaluate stage's job (tasks/evaluate ranks_launch) is named for the evaluation and writes in its
    `eval/<id>` directory; the run's training job is named for the run. Both under the run's real identity."""
    from tasks.evaluate import ranks_launch
    from tasks.runs.identity import identity, scratch

    cfg = k8s_config(tmp_path)
    run = identity(cfg, "e" * 64, scratch(cfg))
    models = [{"name": "candidate", "path": str(run.run_dir(cfg) / "ckpt" / "step-3")}]
    launch = ranks_launch(cfg, run, models, [{"name": "heldout"}], [], "s" * 64, tmp_path / "ds",
                          run.run_dir(cfg) / "eval")
    assert launch.run == run and launch.job.output_dir.parent == run.run_dir(cfg) / "eval"
    launcher = get_launcher(launch.cfg)
    job = launcher.manifest(launch.cfg, launch.job, tmp_path / "cache" / "ds", launch.job.output_dir / "job.json",
                            "ab" * 16, evaluation=launch.options.evaluating)
    jsonschema.validate(job, PYTORCHJOB_SCHEMA)
    container = pod_spec(job)["containers"][0]
    words = shlex.split(container["command"][2])
    assert "tasks.evaluate.worker" in words and "tasks.train.worker" not in words
    assert words[words.index("--relay-status") + 1] == str(launch.job.output_dir / "status.json")
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["output"] == str(launch.job.output_dir)
    eval_name = job["metadata"]["name"]
    assert eval_name == f"retrainer-tiny-test-{launch.job.name}" and eval_name.startswith("retrainer-tiny-test-eval-")
    assert len(eval_name) <= 63 and job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"][
        "labels"]["retrainer/job"] == eval_name
    training = launcher.manifest(cfg, JobSpec(run.run_id, run.run_dir(cfg)), tmp_path / "cache" / "ds",
                                 run.run_dir(cfg) / "job.json", "ab" * 16)
    assert training["metadata"]["name"] == f"retrainer-tiny-test-{run.run_id[:12]}" != eval_name


def test_priority_class_and_kueue_queue_reach_the_job(tmp_path: Path) -> None:
    job = render(tmp_path, **{"cluster.kubernetes.priority_class_name": "retrain-high",
                              "cluster.kubernetes.kueue_queue": "gpu-queue"})
    validate_manifest(job)
    assert all(pod_spec(job, r)["priorityClassName"] == "retrain-high" for r in ("Master", "Worker"))
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    plain = render(tmp_path / "plain")
    assert "priorityClassName" not in pod_spec(plain) and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]


def _node_output(tmp_path: Path, node_rank: int) -> bytes:
    """What a pod's container prints: `tasks.base.spawn` for node `node_rank` of 2 (2 ranks each), whose rank 3
    raises IndexError and rank 0 RuntimeError (its entry point records them, as every rank program's does)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nfrom tasks.base.rank_failure import record\nrank = int(os.environ['RANK'])\n"
                      "try:\n"
                      "    if rank == 3:\n        [1, 2][rank]\n"
                      "    if rank == 0:\n        raise RuntimeError('Connection closed by peer')\n"
                      "except Exception as exc:\n    record(exc)\n    sys.exit(1)\n")
    done = subprocess.run([sys.executable, "-m", "tasks.base.spawn", "--nnodes=2", f"--node-rank={node_rank}",
                           "--nproc-per-node=2", str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=60)
    assert done.returncode == 1, done.stdout
    return done.stdout


def test_a_rank_failed_on_a_worker_pod_reaches_the_error_a_deferred_task_collects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 3 (on the Worker pod) raised first; rank 0 (on the Master) failed after it. The launcher follows
    every pod's log, not only the Master's: the collected error names rank 3, its exception, message and
    line, and each pod's lines reach the log under the pod's name."""
    import asyncio
    import json
    import logging

    from kubernetes.config import kube_config

    from tasks.base.errors import TrainingFailedError
    from tasks.base.job_status import Status, relay_line
    from tasks.launch import Outcome, collect, follow
    from tasks.runs.identity import for_dataset
    from tests.launch.k8s_api import kubernetes_api

    worker_log = _node_output(tmp_path, 1)  # first: its rank 3's failure is the earlier one
    master_log = _node_output(tmp_path, 0)
    line = (tmp_path / "rank.py").read_text().splitlines().index("        [1, 2][rank]") + 1
    cfg = k8s_config(tmp_path, **{"cluster.hang_timeout_s": 30})  # a job that never ends fails the test, soon
    dataset = write_dataset(tmp_path / "dataset")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: the kubeconfig is used
    monkeypatch.setattr(KubernetesLauncher, "poll_interval_s", 0.1)
    with kubernetes_api() as api:
        # What KUBECONFIG says, read by the client when it is first imported (an earlier test may have):
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(api.kubeconfig(tmp_path / "kubeconfig")))
        handle = json.loads(json.dumps(get_launcher(cfg).submit(cfg, dataset, run=for_dataset(cfg, dataset))))
        name = handle["name"]
        assert list(api.jobs) == [name]
        status = Status(state="training", step=1, steps=cfg.train.steps, loss=5.5, at=1.0)
        api.logs[f"{name}-master-0"] = (relay_line(status) + "\n").encode() + master_log
        api.logs[f"{name}-worker-0"] = worker_log
        with caplog.at_level(logging.INFO, logger="tasks.launch.ranks"):
            event = json.loads(json.dumps(asyncio.run(follow(cfg, handle)).to_dict()))  # the trigger's event is JSON
        outcome = Outcome.from_dict(event)
        assert outcome.rc == 1 and outcome.last_step == 1 and not outcome.preempted, outcome
        with pytest.raises(TrainingFailedError) as failed:
            collect(cfg, handle, outcome)
        assert api.jobs == {}  # deleted on the way out
    host = event["rank_failure"]["host"]
    assert str(failed.value) == ("training of tiny-test failed (kubernetes launcher): rank 3 failed: IndexError: "
                                 f"list index out of range ({tmp_path / 'rank.py'}:{line} on {host})")
    relayed = {(r.levelno, r.getMessage()) for r in caplog.records if r.name == "tasks.launch.ranks"}
    assert (logging.ERROR, f"[{name}-worker-0] tasks.base.spawn: rank 3 failed: IndexError: list index out of range "
                           f"({tmp_path / 'rank.py'}:{line} on {host}); stopping this node's other ranks") in relayed
    assert any(level == logging.ERROR and text.startswith(f"[{name}-master-0] tasks.base.spawn: rank 0 failed")
               for level, text in relayed)
    assert not [text for _, text in relayed if "RETRAINER-" in text]  # reports and statuses are not log lines
