"""Objects fetched from an object store into a local folder, every byte verified (fetcher.py).

Shared by the dataset warm (tasks/data/warm.py) and the pull of a model tree from a remote store
(tasks/registry/store.py): both need the same ranged parallel reads, retries and O_DIRECT writes,
so neither keeps a fetcher of its own. Nothing here knows what the objects are; a caller that
wants their content checked too (the warm's token scan) passes a `ContentCheck`.
"""
