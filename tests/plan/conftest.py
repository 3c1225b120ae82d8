"""Config builder for planner tests: a JobConfig from just the sections a test cares about."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.config.schema import JobConfig


def make_config(model: dict[str, Any] | None = None, parallel: dict[str, Any] | None = None,
                train: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None,
                serving: dict[str, Any] | None = None, evaluate: dict[str, Any] | None = None) -> JobConfig:
    return JobConfig.model_validate({
        "name": "plan-test",
        "model": {"family": "gpt", **(model or {})},  # the planner tests' hand-worked numbers are GPT's
        "data": {"source_url": "/nonexistent/data", "cache_dir": "/nonexistent/cache"},
        "parallel": parallel or {},
        "train": {"output_dir": "/nonexistent/out", **(train or {})},
        "cluster": cluster or {},
        "serving": serving or {},
        "evaluate": evaluate or {},
        "publish": {"registry_url": "sqlite://", "store_url": "/nonexistent/store", "model_name": "m"},
    })


@pytest.fixture
def config_factory():
    return make_config
