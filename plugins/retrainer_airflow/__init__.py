"""Airflow glue the triggerer must import: the rank-job operator and its trigger.

They live under plugins/ because Airflow puts the plugins folder on every component's sys.path
(the triggerer included), and a trigger is found by its import path. No business logic: the
operator calls tasks.stages.lifecycle, the trigger tasks.launch.
"""
