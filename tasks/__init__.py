"""retrainer: the retraining lifecycle as plain Python (no Airflow imports here)."""

__version__ = "0.1.0"
