"""The model-registry page inside the Airflow 3 UI (a FastAPI app mounted by the plugin).

Kept out of Airflow's plugin scan (see plugins/.airflowignore): the scanner imports every
.py file as a top-level module, so only `retrainer_registry_plugin.py` is a plugin file and
it imports this package normally (the plugins folder is on sys.path).
"""
