"""The built-in models as Hugging Face-format directories that other tools can load.

`--model-path tiny` (or `tiny-v41`) needs no files, but SGLang's benchmark, lm-eval and
`transformers` look a model up by path. `materialize("tiny")` writes, once, a directory with

- `config.json` (the built-in's config: DeepSeek-V4 for `tiny`, the composite DeepSeek-V4.1
  config for `tiny-v41`) and `model.safetensors` (its seeded weights, HF names: `--model-path
  <dir>` serves the same model as `--model-path tiny`; tensors the loader derives from other
  files, such as V4.1's Engram token map from the tokenizer, are left out);
- `tokenizer.json` + `tokenizer_config.json` (with the chat template as Jinja) +
  `special_tokens_map.json`: the byte tokenizer in the `tokenizers` format, so
  `AutoTokenizer.from_pretrained(<dir>)` gives the same ids and text as `ByteTokenizer`;
- `sgl_dspark_tokenizer.json`, which makes this server use `ByteTokenizer` itself for the dir;
- `dspark/`: the built-in draft (`tiny-dspark`, `tiny-v41-dspark`; config.json + weights),
  where the server looks for a target's draft.

The directory lives under `$SGL_DSPARK_CACHE` (default `~/.cache/sglang-dspark`) in
`models/<name>-seed<seed>-<fingerprint>`; the fingerprint hashes everything that determines the
files, so a changed model gets a new directory and a directory is never rewritten. Writing goes
through a temporary directory renamed into place (safe with concurrent servers).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

from sgl_dspark.env import cache_root
from sgl_dspark.srt.models.tiny import TINY_HF_CONFIG, TINY_MODEL_NAME, tiny_config, tiny_weights
from sgl_dspark.srt.models.tiny_v41 import (
    TINY_V41_DSPARK_CONFIG,
    TINY_V41_MODEL_NAME,
    tiny_v41_config,
    tiny_v41_hf_config,
    tiny_v41_weights,
)
from sgl_dspark.srt.tokenizer.byte_tokenizer import (
    BYTE_OFFSET,
    BYTE_VOCAB_SIZE,
    MASK_ID,
    NUM_BYTES,
    SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
)
from sgl_dspark.srt.tokenizer.hf_tokenizer import MARKER_FILE

BUILTIN_MODELS = (TINY_MODEL_NAME, TINY_V41_MODEL_NAME)
# Tensors of the built-ins that the loader derives from other files of the directory.
_DERIVED_TENSORS = frozenset({"model.engram_token_map"})
_LAYOUT_VERSION = 1  # bump when the files written here change


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer and
    decoder of `tokenizers` use)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def byte_tokenizer_json() -> dict[str, Any]:
    """`ByteTokenizer` in the `tokenizers` JSON format: a byte-level BPE without merges over the
    256 byte ids, the special tokens as added tokens (`<mask>` is a plain vocabulary entry, so
    text never encodes to it, as in `ByteTokenizer`), and the reserved ids as unreachable
    vocabulary entries. The template processor adds `<bos>` with `add_special_tokens`."""
    byte_chars = _bytes_to_unicode()
    vocab: dict[str, int] = {byte_chars[b]: BYTE_OFFSET + b for b in range(NUM_BYTES)}
    vocab[SPECIAL_TOKENS[MASK_ID]] = MASK_ID
    for token_id in range(BYTE_OFFSET + NUM_BYTES, BYTE_VOCAB_SIZE):
        vocab[f"<reserved_{token_id}>"] = token_id
    for token_id, token in SPECIAL_TOKENS.items():
        if token_id != MASK_ID:
            vocab[token] = token_id
    added = [
        {
            "id": token_id,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token_id, token in sorted(SPECIAL_TOKENS.items())
        if token_id != MASK_ID
    ]
    bos = SPECIAL_TOKENS[0]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            "merges": [],
        },
    }


def byte_tokenizer_config() -> dict[str, Any]:
    names = {"bos_token": 0, "eos_token": 1, "pad_token": 2}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{key: SPECIAL_TOKENS[token_id] for key, token_id in names.items()},
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(TINY_HF_CONFIG["max_position_embeddings"]),
        "chat_template": TINY_CHAT_TEMPLATE,
    }


def _fingerprint(name: str, seed: int) -> str:
    from sgl_dspark.srt.speculative.dspark.factory import TINY_DSPARK_CONFIG

    hf_config, draft = (
        (TINY_HF_CONFIG, TINY_DSPARK_CONFIG)
        if name == TINY_MODEL_NAME
        else (tiny_v41_hf_config(), TINY_V41_DSPARK_CONFIG)
    )
    spec = {
        "layout": _LAYOUT_VERSION,
        "name": name,
        "seed": seed,
        "config": hf_config,
        "draft": draft,
        "tokenizer": byte_tokenizer_json(),
        "tokenizer_config": byte_tokenizer_config(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")


def _write_builtin(name: str, out: str, seed: int) -> None:
    from sgl_dspark.srt.configs.dspark_config import DSparkConfig
    from sgl_dspark.srt.core.kernel_choice import KernelChoice
    from sgl_dspark.srt.models.dspark_draft import DSparkDraftModel
    from sgl_dspark.srt.models.registry import model_entry
    from sgl_dspark.srt.speculative.dspark.draft_checkpoint import save_draft_checkpoint
    from sgl_dspark.srt.speculative.dspark.factory import TINY_DSPARK_CONFIG

    if name == TINY_MODEL_NAME:
        cfg, hf_config, draft_keys, make_weights = (
            tiny_config(),
            TINY_HF_CONFIG,
            TINY_DSPARK_CONFIG,
            tiny_weights,
        )
    else:
        cfg, hf_config, draft_keys, make_weights = (
            tiny_v41_config(),
            tiny_v41_hf_config(),
            TINY_V41_DSPARK_CONFIG,
            tiny_v41_weights,
        )
    model = model_entry(cfg).build_model(cfg, KernelChoice())
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    weights = {
        k: v.contiguous()
        for k, v in make_weights(cfg, shapes, seed=seed)
        if k not in _DERIVED_TENSORS
    }
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out, "config.json"), hf_config)
    _write_json(os.path.join(out, "tokenizer.json"), byte_tokenizer_json())
    _write_json(os.path.join(out, "tokenizer_config.json"), byte_tokenizer_config())
    _write_json(
        os.path.join(out, "special_tokens_map.json"),
        {k: v for k, v in byte_tokenizer_config().items() if k.endswith("_token")},
    )
    _write_json(os.path.join(out, MARKER_FILE), {"type": "byte"})
    _write_json(os.path.join(out, "generation_config.json"), {"bos_token_id": 0, "eos_token_id": 1})
    # The draft, as the built-in draft is built for this seed (the factory uses seed + 1).
    dcfg = DSparkConfig.from_dict(draft_keys, cfg)
    draft = DSparkDraftModel(dcfg)
    draft_shapes = [(k, tuple(v.shape)) for k, v in draft.state_dict().items()]
    draft_weights = dict(tiny_weights(dcfg.stage_config, draft_shapes, seed=seed + 1))
    save_draft_checkpoint(
        draft_weights, dcfg, {**hf_config, **draft_keys}, os.path.join(out, "dspark")
    )


def materialize(name: str, seed: int = 0, root: str | None = None) -> str:
    """The directory of built-in model `name` (written on first use); see the module doc."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"{name!r} is not a built-in model (built-in: {list(BUILTIN_MODELS)})")
    root = root or cache_root()
    final = os.path.join(root, "models", f"{name}-seed{seed}-{_fingerprint(name, seed)}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(final))
    try:
        with torch.no_grad():
            _write_builtin(name, tmp, seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise  # not a concurrent writer that finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
