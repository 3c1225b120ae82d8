"""retrainer: the retraining lifecycle as plain Python (no Airflow imports here)."""

from pathlib import Path

__version__ = "0.1.0"

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the package runs from (editable install)
