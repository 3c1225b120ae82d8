"""`retrainer prepare-data`: tokenize JSONL / Parquet / text corpora into a dataset (shards + manifest).

The main process expands the inputs and reads them in ~1 MiB chunks (`readers`);
worker processes parse rows and tokenize (`worker`, `rows`, `split`); the main
process writes the results back in input order (`shards`), so the output is the
same bytes whatever the worker count. `core.prepare` drives it; `cli` is the verb.
With `--chat`, rows are conversations rendered with the model's chat template (`chat`), written
with a loss mask and document starts beside each shard.
Nothing here is imported by `retrainer --help`: tokenizers and pyarrow load only
inside the verb.
"""
