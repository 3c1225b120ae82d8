"""Deploy on model events: when an alias moves, put the version it now points to into service, or move it back.

Stages (the deploy DAG, dags/deploy.py, runs each as a task on the serving host's queue; `retrainer deploy
CONFIG` chains them in one process, tasks/deploy/run.py):
1. `resolve_target` (target.py): the version live *now* (an alias that moved again since the event is deployed as
   it is now; the later move's own event deploys again), and the history row of the move that made it live.
2. `pull` (pull.py): the version's artifact into `<models_dir>/v<N>-<digest>/`, every byte verified while
   streaming (the registry's own pull); a directory pulled before is reused when every file is there with its size.
3. `smoke_test` (check.py): a process of its own (smoke.py) loads the export with transformers and checks it.
4. `run_hook` (handoff.py): the user's hook (`deploy.command` or `deploy.entry_point`; hooks.py and vllm_lora.py
   are examples) deploys it, in a process of its own, with the version in `RETRAINER_DEPLOY_*` environment
   variables (never on a command line).
5. On a failure of any of them, `roll_back` (rollback.py): the alias goes back to the version live before
   (compare-and-swap on the version that failed, audited; the reason names the failure). That move's event deploys
   the version rolled back to, so serving gets the old one back. Should that deploy fail too, nothing is rolled
   back again (the alias history says the move was a rollback): it fails loudly and leaves the alias to a person.

Child processes (the smoke test, the hook) run through process.py: their own session, output logged, killed on
timeout.

Why the serving host: it can hold the model for serving by definition, so it can load it once more for the
smoke test; an Airflow worker elsewhere could not. Loading uses `device_map="auto"` (every GPU of the host, then
CPU memory; transformers builds the model on the meta device and streams each safetensors shard in), in a child
process, so an out-of-memory kill or a crash takes the child, never the task that then rolls back.
"""
