"""5-shot GSM8K evaluation (SGLang's prompt format) and the paired non-inferiority comparison.

Modules: `data` (files, prompt format), `extract` (answer extraction), `run_eval` (CLI),
`compare` (paired comparison CLI).
"""
