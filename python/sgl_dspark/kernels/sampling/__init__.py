"""Token selection ("sampling" kernel family): `reference.py` holds the greedy argmax reference
and the fixed-point inverse CDF every sampled draw uses; `vocab_argmax.py` is the greedy argmax
over vocab shards without gathering the logits."""
