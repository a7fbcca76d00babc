"""DSpark's speculative step ("spec" kernel family): `reference.py` is the torch spec of
acceptance, draft input staging and the greedy Markov draft; `accept.py`, `draft_inputs.py` and
`markov.py` run them in one or a few launches each."""
