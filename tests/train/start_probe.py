"""Run by tests/train/test_lean_start.py as a rank program (`python -m tasks.train.start tests.train.start_probe
ARG`): what a worker finds loaded after the ranks' start-up."""

import importlib
import json
import os
import sys

if __name__ == "__main__":
    for worker in ("tasks.train.worker", "tasks.evaluate.worker"):  # both import DeepSpeed at module level
        importlib.import_module(worker)
    loaded = {name: name in sys.modules for name in ("deepspeed", "mlflow", "sqlalchemy")}
    import mlflow  # what rank 0's tracker does when a run asks for MLflow

    print(json.dumps({**loaded, "mlflow_after": mlflow.__name__, "argv": sys.argv,
                      "accelerator": os.environ.get("DS_ACCELERATOR")}))
