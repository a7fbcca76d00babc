"""Engram pieces of the engine: the compressed token map and the hash ids against the fixture's
stored values, the gate at a zero dot product, refusals of a bad tokenizer; and the startup
refusal of kernel / attention choices that do not compute V4.1."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.engram import Engram, EngramHash, ngram_history
from sgl_dspark.srt.tokenizer.engram_map import compressed_token_map

C2 = pathlib.Path(__file__).resolve().parent / "fixtures" / "deepseek_v41" / "c2_hc4_sigmoid_engram"


@pytest.fixture(scope="module")
def c2():
    cfg = ModelConfig.from_pretrained(str(C2))
    meta = json.loads((C2 / "vectors.json").read_text())["engram"]
    return cfg, meta, load_file(str(C2 / "vectors.safetensors"))


def test_token_map_and_refusals(c2, tmp_path):
    cfg, meta, _ = c2
    e = cfg.v41.engram
    token_map = compressed_token_map(str(C2 / "tokenizer.json"), 320, e.compressed_vocab_size, 2)
    assert token_map.tolist() == meta["token_map"]
    # ids past the tokenizer (a padded vocabulary) read as the pad token
    padded = compressed_token_map(str(C2 / "tokenizer.json"), 330, e.compressed_vocab_size, 2)
    assert padded[320:].tolist() == [meta["token_map"][2]] * 10
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        compressed_token_map(str(C2 / "tokenizer.json"), 320, 280, 2)
    with pytest.raises(ValueError, match="tokenizer"):
        compressed_token_map(str(tmp_path / "tokenizer.json"), 320, 281, 2)


def test_hash_ids_of_the_stored_prompt(c2):
    """A two-chunk prefill (the second chunk's history reaches into the first) hashes every
    position to the rows HF recorded."""
    cfg, meta, vec = c2
    e = cfg.v41.engram
    ids = vec["p2.input_ids"]
    want = vec["p2.debug.engram_hash_ids"]  # [S, layers, (N - 1) * heads]
    token_map = torch.tensor(meta["token_map"])
    req_to_token = torch.arange(128).view(1, 128).repeat(2, 1)
    token_ids = torch.zeros(128, dtype=torch.int64)
    split = 29
    got = []
    for start, end in ((0, split), (split, ids.shape[0])):
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [ids[start:end].tolist()], [start], [1], req_to_token
        )
        token_ids[batch.out_cache_loc] = batch.input_ids
        history = ngram_history(batch, token_ids, e.max_ngram_size, e.pad_id)
        got.append(torch.stack([EngramHash(e, i)(token_map[history]) for i in range(2)], 1))
    assert torch.equal(torch.cat(got), want)


def test_gate_at_zero_dot_is_sigmoid_of_the_floor(c2):
    cfg, _, _ = c2
    engram = Engram(cfg.v41.engram, 0, cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps)
    with torch.no_grad():
        engram.q_weight.zero_()  # every dot product is exactly 0
        engram.embed.weight.normal_()
        engram.wkv.weight.normal_()
    streams = torch.randn(3, cfg.hc_mult, cfg.hidden_size)
    history = torch.randint(0, 200, (3, cfg.v41.engram.max_ngram_size))
    out = engram(streams, history)
    kv = engram.wkv(engram.embed(engram.hash(history)).flatten(1))
    value = kv[:, cfg.hc_mult * cfg.hidden_size :]
    gate = torch.sigmoid(torch.tensor(1e-3))  # copysign(sqrt(1e-6), +0.0)
    torch.testing.assert_close(out, streams + gate * value[:, None, :])


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
def test_triton_engram_matches_torch(c2):
    """The "engram" family on Triton (the rest on torch, so both modules see the same `wkv`
    output) binds the fused gate and gives the torch module's output within the gate's
    tolerance (`test_engram_gate.py`), in bf16 as the model runner casts it."""
    cfg, _, _ = c2
    args = (cfg.v41.engram, 0, cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps)
    torch_engram = Engram(*args, KernelChoice())
    triton_engram = Engram(*args, KernelChoice("torch", (("engram", "triton"),)))
    assert triton_engram.gate.__name__ == "engram_gate"
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        torch_engram.embed.weight.copy_(torch.randn(torch_engram.embed.weight.shape, generator=g))
        wkv = torch_engram.wkv.weight
        wkv.copy_(torch.randn(wkv.shape, generator=g) * wkv.shape[1] ** -0.5)
        for w in (torch_engram.q_weight, torch_engram.k_weight):
            w.copy_(1 + 0.5 * torch.randn(w.shape, generator=g))
    triton_engram.load_state_dict(torch_engram.state_dict())
    torch_engram, triton_engram = torch_engram.bfloat16(), triton_engram.bfloat16()
    streams = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=g).to(torch.bfloat16)
    history = torch.randint(0, 200, (5, cfg.v41.engram.max_ngram_size), generator=g)
    want = torch_engram(streams, history)
    got = triton_engram(streams, history)
    assert not torch.equal(want, streams)  # the gated value was added
    # One bf16 unit in the last place, plus a gate error of 1e-5 times |value| (< 10 here).
    eps = torch.finfo(torch.bfloat16).eps
    larger = torch.maximum(got.float().abs(), want.float().abs())
    assert ((got.float() - want.float()).abs() <= eps * larger + 1e-4).all()
