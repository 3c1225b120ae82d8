"""Job configuration, one module per job: `schema` (the pydantic models, `JobConfig`), `load` (YAML, `${VAR}`
expansion, overrides, validation once per process), `key` (which fields define the experiment key), `duration`
(durations as people write and say them), `util` (entry points, canonical JSON hashing), `endpoints` (the
registry a config names). Import each name from the module that defines it.
"""
