"""Job configuration, one module per job. The schema: `schema` (`JobConfig`, the job as a whole, and its data,
parallel and train sections) built from one module per remaining section (`model`, `cluster`, `evaluation`,
`release`, `tracking`) over `bounds` (the limits every field is checked against). Around it: `load` (YAML, `${VAR}`
expansion, overrides, validation once per process), `key` (which fields define the experiment key), `duration`
(durations as people write and say them), `util` (entry points, canonical JSON hashing), `endpoints` (the
registry a config names). Import each name from the module that defines it.
"""
