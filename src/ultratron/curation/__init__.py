"""The data curation pipeline (`ultratron data`): raw text → cleaned, deduplicated, filtered
JSONL parts → the trainer's token shards, with a decision log for every document.

Modules depend one way: runner → stages → frame → executors → config (see docs/data.md).
"""
