"""Offline data layer: a built-in corpus, byte-level BPE tokenizers, token shards and the loaders.

Modules (import the one you need; this package imports nothing on its own):
  names           -- the TOML's dataset names and `on_exhausted` choices (a leaf: no imports)
  cache           -- cache folder, cross-process file lock, atomic folder builds, `gamma-titan cache`
  text_sources    -- parse and open a text source (file, folder, save_to_disk folder, hub id), streamed
  mixture_table   -- a `{ name = weight }` table: shard mixtures and the tokenizer's mix
  clean_text      -- text that is not clean: refused in one line, or replaced / skipped and counted
  builtin_corpus  -- English corpus generated from CPython's own documentation
  tokenizer       -- train / cache / resolve byte-level BPE tokenizers
  shards          -- the token-shard format: tokenizer identity, meta.json, memory-mapped reads
  pretokenize     -- `gamma-titan pretokenize`: text source -> token shards, parallel, resumable
  builtin_shards  -- the built-in corpus pretokenized once per tokenizer, in the cache
  sampling        -- global sample index -> token window: one stream, or a weighted mixture
  shard_sources   -- a job config's shard datasets -> their folders, weights and sample sequence
  rank_batches    -- one data-parallel rank's local batches of that sequence, checkpointable
  validation_set  -- the run's validation set: the first N sequences, each rank's padded share
  registry        -- register "hf" with TorchTitan; check any dataset choice before training
  loader          -- the dataloaders TorchTitan's Trainer and our validator get; the probe batch
  reads           -- what a run reads, said at its start: sources, weights, tokens, epochs, tokenizer
"""
