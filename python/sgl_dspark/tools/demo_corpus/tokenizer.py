"""A byte-level BPE tokenizer trained locally with the `tokenizers` package, saved as the
`tokenizer.json` + `tokenizer_config.json` pair the engine's tokenizer loader reads."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Chat turns in the corpus's own format: a user message is a question, the reply its answer.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}Question: "
    "{{ message['content'] }}\nAnswer:{% elif message['role'] == 'assistant' %} "
    "{{ message['content'] }}\n{% endif %}{% endfor %}"
)

# Ids 0..3, in this order: the DSpark draft's mask token is a real row of the embedding that
# text never produces.
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|dspark_mask|>")
BOS, EOS, PAD, MASK = SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if vocab_size & (vocab_size - 1) or vocab_size < 512:
        raise ValueError(f"--vocab-size {vocab_size} must be a power of two >= 512")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
