"""The trainer tests' fixtures (a dataset dir, tiny configs) for the LoRA tests."""

from tests.train.conftest import dataset_dir, make_config  # noqa: F401  (pytest fixtures)
