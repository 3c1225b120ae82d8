"""Continuing an adapter on a launcher that warms each node (ssh, Slurm, Kubernetes): each node's warm puts
the base where its ranks load their starting weights and the version's adapter (megabytes) into the run
directory, where the ranks read it, as the local launcher stages it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.base.fsutil import sha256_file
from tasks.data.synthetic import make_data
from tasks.data.warm import warm_mixture
from tasks.inputs.adapter import start_adapter_dir
from tasks.inputs.node import node_spec, warm_node
from tasks.models import get_family
from tasks.models.lora import apply_lora
from tasks.models.lora_export import write_adapter
from tasks.models.parallel import TPGroup
from tasks.models.weights import local_named_params, open_weights
from tasks.registry import ArtifactStore
from tasks.runs.identity import StartingWeights, identity
from tests.train.conftest import tiny_config

LORA = {"rank": 8, "alpha": 16, "target_modules": ["qkv", "fc2"]}


def test_each_node_warm_fetches_the_continued_adapter_beside_the_base(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(tmp_path, {"train.lora": LORA, "cluster.launcher": "ssh",
                                 "cluster.hosts": ["node-a", "node-b"]})
    make_data(cfg.data.source_url, name="tiny-test", seed=1, n_train_shards=1, tokens_per_shard=4096)
    primary = warm_mixture(cfg, progress=False)[0]
    m = cfg.model
    model = get_family(m.family).Reference(m, seed=3)
    base_file = tmp_path / "base.pt"
    torch.save({n: p.detach().clone() for n, p in local_named_params(model)}, base_file)
    apply_lora(model, m, cfg.train.lora, TPGroup(), seed=5)
    torch.save({n: p.detach().clone() for n, p in local_named_params(model)}, tmp_path / "trained.pt")
    published = write_adapter(m, cfg.train.lora, open_weights(tmp_path / "trained.pt", m), tmp_path / "v1",
                              base_model="")
    ref = ArtifactStore(cfg.publish.store_url).put_tree(published)
    base = StartingWeights(requested="base", digest=sha256_file(base_file), url=str(base_file), note="the base")
    v1 = StartingWeights(requested="live", version=1, digest=ref.digest, url=ref.url, kind="tree", note="v1")
    run = identity(cfg, primary.manifest_hash, v1, base=base)

    staged = start_adapter_dir(run.run_dir(cfg))
    for node in ("node-a", "node-b"):  # one run directory both nodes see: the second finds it there
        monkeypatch.setenv("NODE_NAME", node)
        node_cfg = cfg.with_overrides({"data.cache_dir": str(tmp_path / node)})
        report = warm_node(node_spec(node_cfg, run, run.run_dir(cfg)))
        assert report["weights_dir"] == str(base_file)  # the ranks load the base, never the adapter tree
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in published.iterdir())
    for file in published.iterdir():
        assert (staged / file.name).read_bytes() == file.read_bytes(), file.name
