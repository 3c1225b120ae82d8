"""retrainer: the retraining lifecycle as plain Python (no Airflow imports here)."""

from pathlib import Path

__version__ = "0.1.0"

# The checkout the package runs from (an editable install): configs/, sql/ and the DAGs live beside tasks/.
REPO_ROOT = Path(__file__).resolve().parent.parent
