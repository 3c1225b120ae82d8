"""`kubernetes`: a Kubeflow `PyTorchJob` (kubeflow.org/v1): one Master pod plus Workers, `tasks.base.spawn` in each.

Why build the pod template from the official client's models: the `kubernetes`
package's V1* classes check required fields as they are built, and
`sanitize_for_serialization` renders exactly what the API server receives.
The whole object is then checked against the PyTorchJob CRD's structure
(`k8s_schema.PYTORCHJOB_SCHEMA`) before anything is sent.

In each pod the training operator sets MASTER_ADDR, MASTER_PORT (from the
container port named `pytorchjob-port`) and RANK (the pod's index); the
trainer's node command gets node rank and rendezvous from them. The SSD
cache is mounted at `data.cache_dir` (`cache_volume`: the node's hostPath, a
PersistentVolumeClaim such as a local PV, or an emptyDir); run from the
lifecycle, an init container `warm` in every pod first warms the dataset and
the starting weights into it (tasks/inputs/node.py, like Kubeflow's dataset and
model initializers: the pods that warm are the pods that train; storage
credentials reach it only through `env_from_secrets`), writes its report to
`<output_dir>/warm/<node>.json`, and on failure the reason to the status file. The job's directory
(`JobSpec.output_dir`) a shared PersistentVolumeClaim mounted there (same paths as
here), /dev/shm an in-memory emptyDir. `cluster.kubernetes.env` is rendered as
values, `env_from_secrets` as `valueFrom.secretKeyRef`: a secret's value never
passes through the launcher or the manifest. Status is followed until a Succeeded
or Failed condition; every pod's log is streamed into `logging` (the Master's carries
the relayed status; any pod's may carry a failed rank's report, and a pod is deleted
soon after its job failed, so its log is read as it comes); cancelling deletes the job
(foreground propagation) and waits until no pod of it is left.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.base.credentials import credential_keys
from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.job_status import STATUS_FILE, Status
from tasks.base.rank_failure import RankFailure, earliest
from tasks.config.cluster import KubernetesConfig
from tasks.config.schema import JobConfig
from tasks.inputs.node import REPORT_DIR, SPEC_VAR, node_spec
from tasks.launch import torchrun
from tasks.launch.base import Job, Launcher
from tasks.launch.logs import LineSink
from tasks.launch.procs import TAG_VAR
from tasks.launch.shell import per_node_line
from tasks.launch.spec import JobSpec, LaunchOptions
from tasks.runs.identity import RunIdentity

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
JOB_LABEL = "training.kubeflow.org/job-name"  # set by the operator on every pod of a job


KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"  # Kueue admits the job from this LocalQueue (quota, priority)
# A pod the cluster took away (preempted for a higher priority, evicted for node pressure): not the job's fault.
_PREEMPTED_REASONS = ("Preempt", "Evict")


def job_name(cfg: JobConfig, spec: JobSpec) -> str:
    """The PyTorchJob name of one rank job (a DNS label, at most 63 characters): how a later attempt finds the
    job an earlier one left. The spec name's last part is cut to 12 characters (a training's:
    `retrainer-<config>-<run id[:12]>`), a prefix before it (`eval-`) is kept and the config's part shortened."""
    prefix, _, ident = spec.name.rpartition("-")
    tail = f"{prefix}-{ident[:12]}" if prefix else ident[:12]
    base = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-")[:52 - len(tail)] or "job"
    return f"retrainer-{base}-{tail}"


def render_pytorchjob(cfg: JobConfig, k8s: KubernetesConfig, spec: JobSpec, dataset_dir: Path, config_json: Path,
                      tag: str, *, shm_size: str = "8Gi", warm_spec: dict[str, Any] | None = None,
                      evaluation: bool = False) -> dict[str, Any]:
    """The PyTorchJob manifest of the job `spec` names as the API server receives it (a plain dict), the shared
    output claim mounted at the job's directory; with `warm_spec` (tasks/inputs/node.py) every pod's init
    container warms its node first."""
    from kubernetes import client as k

    if not cfg.cluster.image:
        raise InvalidInputError("cluster.image: the kubernetes launcher needs a container image")
    cmd = torchrun.node_command(cfg, dataset_dir, config_json, nnodes=k8s.nodes, node_rank=0, python=k8s.python,
                                evaluation=evaluation)
    line = per_node_line(cmd, node_rank="$RANK", master_addr="$MASTER_ADDR", master_port="$MASTER_PORT")
    # The node agent relays the run's status into the log the launcher follows (no stdin in a pod).
    agent = [k8s.python, "-m", "tasks.launch.agent", "run", "--tag", tag, "--relay-status",
             str(spec.output_dir / STATUS_FILE), "--"]
    per_node = cfg.cluster.nproc_per_node or cfg.parallel.layout.world_size // k8s.nodes
    gpus = per_node if k8s.gpus_per_node is None else k8s.gpus_per_node
    wanted = {"nvidia.com/gpu": str(gpus) if gpus else None, "cpu": k8s.cpu, "memory": k8s.memory}
    limits = {name: quantity for name, quantity in wanted.items() if quantity}
    plain = {**torchrun.rank_env_defaults(evaluation), **k8s.env, TAG_VAR: tag}
    env = [k.V1EnvVar(name=n, value=v) for n, v in plain.items()]
    env += [k.V1EnvVar(name=n, value_from=k.V1EnvVarSource(secret_key_ref=k.V1SecretKeySelector(
        name=ref.secret, key=ref.key))) for n, ref in k8s.env_from_secrets.items()]
    container = k.V1Container(
        name="pytorch",  # the operator finds the training container by this name
        image=cfg.cluster.image,
        command=["bash", "-c", "exec " + " ".join(shlex.quote(a) for a in agent) + " " + line],
        env=sorted(env, key=lambda e: e.name),
        ports=[k.V1ContainerPort(name="pytorchjob-port", container_port=cfg.cluster.master_port)],
        resources=k.V1ResourceRequirements(limits=limits or None, requests=dict(limits) or None),
        volume_mounts=[
            k.V1VolumeMount(name="ssd-cache", mount_path=cfg.data.cache_dir),
            k.V1VolumeMount(name="output", mount_path=str(spec.output_dir)),
            k.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
        ],
    )
    init_containers = None
    if warm_spec is not None:
        out = spec.output_dir
        node = k.V1EnvVar(name="NODE_NAME", value_from=k.V1EnvVarSource(
            field_ref=k.V1ObjectFieldSelector(field_path="spec.nodeName")))
        init_containers = [k.V1Container(
            name="warm", image=cfg.cluster.image,
            command=[k8s.python, "-m", "tasks.inputs.node", "--report-dir", str(out / REPORT_DIR),
                     "--status-dir", str(out)],
            env=sorted([*env, node, k.V1EnvVar(name=SPEC_VAR, value=json.dumps(pod_warm_spec(warm_spec)))],
                       key=lambda e: e.name),
            volume_mounts=container.volume_mounts[:2],
        )]
    if k8s.cache_volume == "claim":
        cache = k.V1Volume(name="ssd-cache", persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(
            claim_name=k8s.cache_claim))
    elif k8s.cache_volume == "ephemeral":
        cache = k.V1Volume(name="ssd-cache", empty_dir=k.V1EmptyDirVolumeSource())
    else:
        cache = k.V1Volume(name="ssd-cache", host_path=k.V1HostPathVolumeSource(
            path=k8s.cache_host_path or cfg.data.cache_dir, type="DirectoryOrCreate"))
    volumes = [
        cache,
        k.V1Volume(name="output", persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(
            claim_name=k8s.output_claim)),
        k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory", size_limit=shm_size)),
    ]
    labels = {"app.kubernetes.io/name": "retrainer", "retrainer/job": job_name(cfg, spec)}
    template = k.V1PodTemplateSpec(
        metadata=k.V1ObjectMeta(labels=labels),
        spec=k.V1PodSpec(containers=[container], init_containers=init_containers, volumes=volumes,
                         restart_policy="Never", service_account_name=k8s.service_account,
                         priority_class_name=k8s.priority_class_name),
    )
    rendered = k.ApiClient().sanitize_for_serialization(template)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": rendered}}
    if k8s.nodes > 1:
        replicas["Worker"] = {"replicas": k8s.nodes - 1, "restartPolicy": "Never", "template": rendered}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(cfg, spec), "namespace": cfg.cluster.namespace,
                     "labels": {**labels, **({KUEUE_QUEUE: k8s.kueue_queue} if k8s.kueue_queue else {})}},
        "spec": {
            # Retries are Airflow's (they resume from the latest checkpoint); the job itself never restarts.
            "runPolicy": {"cleanPodPolicy": "All", "backoffLimit": 0},
            "pytorchReplicaSpecs": replicas,
        },
    }


def pod_warm_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The warm spec as a pod may carry it (the manifest lives in the API server): storage credentials are
    refused, naming the option; pods get them from `cluster.kubernetes.env_from_secrets` (e.g. AWS_*)."""
    sections = {"data.storage_options": spec["storage_options"],
                "model.pretrained_storage_options": spec["weights"]["model"]["pretrained_storage_options"],
                "publish.storage_options": spec["weights"]["store_options"]}
    for field, options in sections.items():
        found = sorted(credential_keys(options))
        if found:
            raise InvalidInputError(f"{field}: {', '.join(found)} would be written into the PyTorchJob; give "
                                    "credentials to the pods by cluster.kubernetes.env_from_secrets instead")
    return spec


def validate_manifest(manifest: dict[str, Any]) -> None:
    """Check a manifest against the PyTorchJob CRD structure; InvalidInputError names the bad field."""
    import jsonschema

    from tasks.launch.k8s_schema import PYTORCHJOB_SCHEMA  # lazy: the CRD schema is only read to validate

    errors = sorted(jsonschema.Draft7Validator(PYTORCHJOB_SCHEMA).iter_errors(manifest), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.path) or "(top level)"
        raise InvalidInputError(f"PyTorchJob manifest: {where}: {first.message}")


def pod_names(name: str, nodes: int) -> list[str]:
    """The pods the training operator creates for a PyTorchJob of `nodes` pods, the Master first."""
    return [f"{name}-master-0", *(f"{name}-worker-{i}" for i in range(nodes - 1))]


class KubernetesJob(Job):
    def __init__(self, launcher: KubernetesLauncher, name: str, namespace: str, *, logs: bool = True) -> None:
        self.launcher, self.name, self.namespace = launcher, name, namespace
        ranks_log = logging.getLogger("tasks.launch.ranks")
        self.sinks = {pod: LineSink(ranks_log, prefix=f"[{pod}] ")
                      for pod in pod_names(name, launcher.section.nodes)}
        self.sink = self.sinks[f"{name}-master-0"]  # the Master's log carries the relayed status
        self._done = threading.Event()
        self._stopped = False
        self._preempted = False
        self._logs = [threading.Thread(target=self._stream_log, args=(pod, sink), name=f"log-{pod}", daemon=True)
                      for pod, sink in self.sinks.items()] if logs else []
        for thread in self._logs:
            thread.start()

    def handle(self) -> dict[str, str]:
        return {"name": self.name, "namespace": self.namespace}

    def preempted(self) -> bool:
        return self._preempted

    def close(self) -> None:
        self._done.set()
        for thread in self._logs:
            thread.join(timeout=10)

    def status(self) -> Status | None:
        return self.sink.status

    def rank_failure(self) -> RankFailure | None:
        return earliest(sink.rank_failure for sink in self.sinks.values())

    def _stream_log(self, pod: str, sink: LineSink) -> None:
        while not self._done.is_set():
            try:
                resp = self.launcher.core.read_namespaced_pod_log(
                    pod, self.namespace, container="pytorch", follow=True, _preload_content=False)
                for line in resp:  # whole lines, however the stream's chunks fall
                    sink(line.decode(errors="replace"))
                return
            except Exception as exc:  # pod not scheduled yet, or API hiccup: try again
                log.debug("waiting for %s logs: %s", pod, exc)
                self._done.wait(2.0)

    def poll(self) -> int | None:
        obj = self.launcher.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
        conditions = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []
                      if c.get("status") == "True"}
        if "Succeeded" in conditions:
            return 0
        if "Failed" in conditions:
            failed = conditions["Failed"]
            why = f"{failed.get('reason') or ''} {failed.get('message') or ''}"
            self._preempted = any(word in why for word in _PREEMPTED_REASONS)
            log.error("PyTorchJob %s failed: %s", self.name, why.strip())
            return 1
        return None

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.launcher.delete(self.name, self.namespace)
        finally:
            self.close()


class KubernetesLauncher(Launcher):
    """Creates the PyTorchJob `cluster.kubernetes` describes (kubeconfig context: in-cluster config first)."""

    name = "kubernetes"
    warms_nodes = True
    poll_interval_s = 5.0

    def __init__(self, section: KubernetesConfig) -> None:
        self.section = section
        self._custom: Any = None
        self._core: Any = None

    def _connect(self) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(context=self.section.kube_context)
        self._custom, self._core = client.CustomObjectsApi(), client.CoreV1Api()

    @property
    def custom(self) -> Any:
        if self._custom is None:
            self._connect()
        return self._custom

    @property
    def core(self) -> Any:
        if self._core is None:
            self._connect()
        return self._core

    def manifest(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
                 warm_spec: dict[str, Any] | None = None, *, evaluation: bool = False) -> dict[str, Any]:
        manifest = render_pytorchjob(cfg, self.section, spec, dataset_dir, config_json, tag, warm_spec=warm_spec,
                                     evaluation=evaluation)
        validate_manifest(manifest)
        return manifest

    def delete(self, name: str, namespace: str) -> bool:
        """Delete a PyTorchJob (foreground) and wait until no pod of it is left; False if there was none."""
        from kubernetes.client import V1DeleteOptions
        from kubernetes.client.exceptions import ApiException

        existed = True
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name,
                body=V1DeleteOptions(propagation_policy="Foreground", grace_period_seconds=30))
            log.warning("PyTorchJob %s deleted; waiting for its pods to go", name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            existed = False
        deadline = time.monotonic() + self.section.cancel_timeout_s
        while True:
            pods = self.core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}={name}")
            if not pods.items:
                return existed
            if time.monotonic() > deadline:
                raise RetrainerError(f"PyTorchJob {name}: {len(pods.items)} pod(s) still present "
                                     f"{self.section.cancel_timeout_s:.0f}s after delete")
            time.sleep(2.0)

    detachable = True

    def attach(self, handle: Mapping[str, Any], *, output: bool = False) -> Job:
        return KubernetesJob(self, handle["name"], handle["namespace"], logs=output)

    def cancel_earlier(self, cfg: JobConfig, spec: JobSpec) -> None:
        name = job_name(cfg, spec)
        if self.delete(name, cfg.cluster.namespace):
            log.warning("kubernetes: PyTorchJob %s was still there from an earlier attempt: deleted it before "
                        "launching", name)

    def prepare(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, options: LaunchOptions) -> None:
        self.manifest(cfg, spec, dataset_dir, spec.output_dir / "config.json", "0" * 32,
                      evaluation=options.evaluating)

    def start(self, cfg: JobConfig, spec: JobSpec, dataset_dir: Path, config_json: Path, tag: str,
              run: RunIdentity, options: LaunchOptions) -> Job:
        if options.secret_env:
            raise InvalidInputError("publish.storage_options: key/secret/token would be written into the "
                                    "PyTorchJob; give the pods the store's credentials by "
                                    "cluster.kubernetes.env_from_secrets instead")
        warm_spec = node_spec(cfg, run, spec.output_dir) if options.node_warm else None
        body = self.manifest(cfg, spec, dataset_dir, config_json, tag, warm_spec, evaluation=options.evaluating)
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        log.info("kubernetes: created PyTorchJob %s/%s (%d pod(s))", namespace, name,
                 sum(r["replicas"] for r in body["spec"]["pytorchReplicaSpecs"].values()))
        return KubernetesJob(self, name, namespace)
