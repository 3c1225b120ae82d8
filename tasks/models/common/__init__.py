"""The shared decoder library every family builds on: what a family states once and reuses.

init.py: per-layer init generators, skipped default init; names.py: block-name parsing; reference.py: the
single-process Reference and the untied pipeline plan; rotary.py: rotary frequencies; blocks.py: the rotary
dense decoder's layers (RMSNorm, GQA attention, gated MLP, vocab-parallel embedding and head: Llama's, which the
other rotary families subclass where they differ); sharding.py: those layers' shapes, TP shard rules and counts;
hf.py: their Hugging Face tensor names and the config.json keys every llama-style family writes and reads.
"""
