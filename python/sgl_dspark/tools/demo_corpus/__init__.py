"""The demo model pair's training text (`python -m sgl_dspark.tools.build_demo_corpus`): GSM8K
train problems, number-varied re-computations of their worked solutions (`variants`), generated
arithmetic with worked answers (`arithmetic`), and a byte-level BPE tokenizer trained on it
(`tokenizer`)."""
