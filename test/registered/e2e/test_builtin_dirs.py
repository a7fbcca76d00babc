"""The built-in tiny model as a Hugging Face directory: transformers loads its tokenizer with the
same ids, text and chat template as the server's byte tokenizer; served from the directory (with
its bundled DSpark draft) it generates what `tiny` generates; it is written once, identically;
`init_dspark_draft --target-path tiny` uses it."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
from sgl_dspark import Engine
from sgl_dspark.srt.entrypoints.builtin_dirs import materialize
from sgl_dspark.srt.tokenizer import ByteTokenizer, get_tokenizer
from sgl_dspark.tools.init_dspark_draft import main as init_draft_main

PIECES = ["a", " ", "é", "\n", "<|user|>", "<bos>", "<eos>", "<mask>", "😀", "\x00", "  x", "ü"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("cache")
    os.environ["SGL_DSPARK_CACHE"] = str(root)
    try:
        return materialize("tiny")
    finally:
        del os.environ["SGL_DSPARK_CACHE"]


def _digest(path: str) -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(path):
        for name in files:
            full = os.path.join(base, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_written_once_and_deterministically(tiny_dir, tmp_path):
    assert materialize("tiny", root=os.path.dirname(os.path.dirname(tiny_dir))) == tiny_dir
    other = materialize("tiny", root=str(tmp_path))
    assert os.path.basename(other) == os.path.basename(tiny_dir)
    assert _digest(other) == _digest(tiny_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(tiny_dir)
    )
    assert materialize("tiny", seed=1, root=str(tmp_path)) != other
    with pytest.raises(ValueError, match="not a built-in model"):
        materialize("huge")


def test_transformers_tokenizer_matches_byte_tokenizer(tiny_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = ByteTokenizer()
    assert get_tokenizer(tiny_dir).__class__ is ByteTokenizer  # the server's own choice
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        ids = ours.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text, False), text
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip), text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert len(hf) == ours.vocab_size


def test_chat_template_matches(tiny_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = ByteTokenizer()
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "ünï"}}]
    for gen in (True, False):
        for kwargs in ({}, {"tools": tools}):
            text = hf.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False, **kwargs
            )
            assert text == "<bos>" + ours.apply_chat_template(
                messages, add_generation_prompt=gen, **kwargs
            )
            ids = hf.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False, **kwargs
            )
            assert list(ids) == ours.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, **kwargs
            )


@pytest.mark.parametrize("name", ["tiny", "tiny-v41"])
def test_served_from_the_directory_like_the_builtin(name, tiny_dir, tmp_path):
    """The directory serves the built-in's model and draft: the same tokens with DSpark."""
    directory = tiny_dir if name == "tiny" else materialize(name, root=str(tmp_path))
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    prompts = ["the directory", "serves the same model"]
    outputs = []
    for path in (name, directory):
        engine = Engine(
            model_path=path,
            context_length=256,
            speculative_algorithm="DSpark",
            max_total_tokens=4096,
        )
        try:
            outputs.append(
                [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=params)]
            )
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


def test_init_dspark_draft_from_tiny(tmp_path):
    os.environ["SGL_DSPARK_CACHE"] = str(tmp_path / "cache")
    try:
        init_draft_main(["--target-path", "tiny", "--output", str(tmp_path / "draft")])
    finally:
        del os.environ["SGL_DSPARK_CACHE"]
    with open(tmp_path / "draft" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["dspark_block_size"] == 5 and cfg["vocab_size"] == 512


def test_an_unwritable_cache_does_not_stop_the_server(tmp_path, monkeypatch):
    from sgl_dspark.srt.entrypoints.http_server import model_directory
    from sgl_dspark.srt.server_args import ServerArgs

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SGL_DSPARK_CACHE", str(blocker / "cache"))
    assert model_directory(ServerArgs(model_path="tiny")) is None
    monkeypatch.setenv("SGL_DSPARK_CACHE", str(tmp_path / "cache"))
    path = model_directory(ServerArgs(model_path="tiny"))
    assert path is not None and os.path.isfile(os.path.join(path, "tokenizer.json"))
