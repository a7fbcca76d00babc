"""DSpark acceptance measured on GSM8K with real drafts (no simulated acceptance).

Modules: `run` (the CLI, `python -m benchmark.acceptance`), `configs` (policy specs -> engine
arguments), `drafts` (the draft under test and the random-draft control), `decode` (zero-shot
GSM8K through the offline engine, per-question records, run summaries), `loops` (the
repetition-loop check), `ngram` (the n-gram lookup control), `report` (the markdown fragment).
"""
