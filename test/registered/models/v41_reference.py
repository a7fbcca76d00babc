"""An independent fp32 reference of the DeepSeek-V4.1 text model, for tests only.

Written from a description of the architecture (single-pass mHC, CSA2 compressor ratios 1/2,
shared latents, the V4.1 indexer with reused top-k and candidate blocks, Engram, MoE with
`gate_temp`, the QAT fake-quantisers), not from the engine, and sharing no code with
`sgl_dspark`: it reads
`config.json`, `model.safetensors` (released tensor names) and `tokenizer.json` itself, and runs
one whole sequence at a time (no cache, positions 0..S-1), every rule written per query row.
Decode logits are the rows of a longer one-shot run: every visibility rule is positional, so a
cached engine must agree with it row for row.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import unicodedata

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

NEG_INF = float("-inf")

# ---- fake-quantisers (written independently of the engine's: frexp and torch.round) ----------


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= t (t > 0, normal fp32)."""
    mant, exp = torch.frexp(t)  # t = mant * 2**exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(t), exp)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP8 E4M3 value (ties to even), |v| <= 448: 3 mantissa bits,
    exponents >= -6, subnormal step 2**-9."""
    mag = v.abs()
    _, exp = torch.frexp(torch.where(mag > 0, mag, torch.ones_like(mag)))
    unbiased = torch.clamp(exp - 1, min=-6)
    step = torch.ldexp(torch.ones_like(mag), unbiased - 3)
    return torch.copysign(torch.round(mag / step) * step, v)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to even); a value rounding to zero is
    +0.0 whatever its sign."""
    mag = v.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    q = torch.clamp(torch.round(mag / step) * step, max=6.0)
    out = torch.where(v < 0, -q, q)
    return torch.where(q == 0, torch.zeros_like(out), out)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None  # left unquantised
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fq8_window(x: torch.Tensor) -> torch.Tensor:
    """FP8 window KV: 32-channel blocks, power-of-two scale."""
    b = _blocks(x, 32)
    if b is None:
        return x
    a = torch.clamp(b.abs().amax(-1, keepdim=True), min=1e-4)
    s = pow2_ceil(a * (1.0 / 448.0))
    q = round_e4m3(torch.clamp(b / s, -448.0, 448.0)) * s
    return q.reshape(x.shape).to(x.dtype)


def fq4_latent(x: torch.Tensor) -> torch.Tensor:
    """FP4 compressed latent: 16-channel blocks, E4M3 scale."""
    b = _blocks(x, 16)
    if b is None:
        return x
    a = torch.clamp(b.abs().amax(-1, keepdim=True), min=6.0 * 2.0**-9)
    s = torch.clamp(round_e4m3(torch.clamp(a / 6.0, max=448.0)), min=2.0**-9)
    q = round_e2m1(torch.clamp(b / s, -6.0, 6.0)) * s
    return q.reshape(x.shape).to(x.dtype)


def fq4_index(x: torch.Tensor) -> torch.Tensor:
    """FP4 indexer query / key: 32-channel blocks, power-of-two scale."""
    b = _blocks(x, 32)
    if b is None:
        return x
    a = torch.clamp(b.abs().amax(-1, keepdim=True), min=6.0 * 2.0**-126)
    s = pow2_ceil(a * (1.0 / 6.0))
    q = round_e2m1(torch.clamp(b / s, -6.0, 6.0)) * s
    return q.reshape(x.shape).to(x.dtype)


# ---- small ops ---------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope_freqs(theta: float, rd: int, yarn: dict | None) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if yarn is None:
        return freqs
    factor, orig = float(yarn["factor"]), float(yarn["original_max_position_embeddings"])
    fast, slow = float(yarn.get("beta_fast") or 32), float(yarn.get("beta_slow") or 1)

    def dim_of(rot: float) -> float:
        return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(dim_of(fast)), 0)
    hi = min(math.ceil(dim_of(slow)), rd - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = torch.clamp((torch.arange(rd // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def rotate(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, sign: float = 1.0):
    """Rotate the trailing 2*len(freqs) channels of x [N, ..., d] in interleaved pairs."""
    rd = 2 * freqs.shape[0]
    ang = pos.float()[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[0],)
    c, s = ang.cos().reshape(shape), sign * ang.sin().reshape(shape)
    a, b = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
    rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    return torch.cat((x[..., :-rd], rot), -1)


# ---- Engram hashing ----------------------------------------------------------------------------

_LONE_SPACE = "\ue000"


def compressed_token_map(tokenizer_json: pathlib.Path) -> list[int]:
    """Token id -> compressed id: ids whose decoded text normalises alike share one id, in
    first-seen order (texts with U+FFFD are keyed by their raw token string)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    keys: dict[str, int] = {}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
            t = "".join(ch for ch in t if unicodedata.category(ch) != "Mn").lower()
            t = re.sub(r"[ \t\r\n]+", " ", t)
            key = (_LONE_SPACE if t == " " else t).strip() or text
        out.append(keys.setdefault(key, len(keys)))
    return out


def _primes(layers: list[int], n_ngram: int, heads: int, vocab: int) -> list[list[list[int]]]:
    def prime(n: int) -> bool:
        return n > 1 and all(n % f for f in range(2, math.isqrt(n) + 1))

    used: set[int] = set()
    out = []
    for _ in layers:
        layer = []
        for _ in range(n_ngram - 1):
            run, p = [], vocab - 1
            for _ in range(heads):
                p += 1
                while not prime(p) or p in used:
                    p += 1
                used.add(p)
                run.append(p)
            layer.append(run)
        out.append(layer)
    return out


def engram_hash_ids(ids: list[int], cfg: dict, token_map: list[int]) -> torch.Tensor:
    """Row ids [S, n_engram_layers, (N-1)*heads] of a sequence starting at position 0."""
    import numpy as np

    layers, n = cfg["engram_layer_ids"], cfg["engram_max_ngram_size"]
    heads, cvocab = cfg["engram_n_heads"], cfg["engram_compressed_vocab_size"]
    primes = _primes(layers, n, heads, cfg["engram_vocab_size"])
    pad = token_map[cfg.get("engram_pad_id", 2)]
    bound = max(1, ((2**63 - 1) // cvocab) // 2)
    out = torch.zeros(len(ids), len(layers), (n - 1) * heads, dtype=torch.int64)
    for li, layer in enumerate(layers):
        mult = [int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, n)]
        flat = [p for run in primes[li] for p in run]
        offsets = [sum(flat[:j]) for j in range(len(flat))]
        for t in range(len(ids)):
            c = [token_map[ids[t - s]] if t - s >= 0 else pad for s in range(n)]
            r = c[0] * mult[0]
            for i in range(1, n):
                r ^= c[i] * mult[i]
                for h in range(heads):
                    col = (i - 1) * heads + h
                    out[t, li, col] = r % primes[li][i - 1][h] + offsets[col]
    return out


# ---- the model ---------------------------------------------------------------------------------


def _text_config(model_dir: pathlib.Path) -> dict:
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = {**raw, **(raw.get("text_config") or {})}
    cfg.setdefault("rms_norm_eps", 1e-20)
    cfg.setdefault("gate_temp", 1.0)
    return cfg


class V41Reference:
    """`forward(ids)` -> (logits [S, V] fp32, debug tensors named like the test vectors')."""

    def __init__(self, model_dir: str | pathlib.Path) -> None:
        d = pathlib.Path(model_dir)
        self.cfg = c = _text_config(d)
        self.w = {k: v.float() for k, v in load_file(str(d / "model.safetensors")).items()}
        self.n_layers = c["num_hidden_layers"]
        self.ratios = list(c["compress_ratios"])[: self.n_layers]
        self.kv_sources = set(c["kv_source_layer_ids"])
        self.index_sources = set(c["index_source_layer_ids"])
        self.cand_source = c.get("candidate_source_layer_id")
        self.cand_source = -1 if self.cand_source is None else self.cand_source
        self.eps = c["rms_norm_eps"]
        rd = c["qk_rope_head_dim"]
        rp = c.get("rope_parameters") or {}
        yarn = rp.get("compress") if isinstance(rp.get("compress"), dict) else None
        if yarn is None or yarn.get("rope_type", "default") != "yarn":
            yarn = c.get("rope_scaling") if isinstance(c.get("rope_scaling"), dict) else None
        self.freqs_main = rope_freqs(c["rope_theta"], rd, None)
        self.freqs_comp = rope_freqs(c["compress_rope_theta"], rd, yarn)
        self.engram_layers = list(c.get("engram_layer_ids") or [])
        self.token_map = compressed_token_map(d / "tokenizer.json") if self.engram_layers else None

    def p(self, name: str) -> torch.Tensor:
        return self.w[name]

    # -- mHC --
    def _mixes(self, rs: torch.Tensor, layer: int, site: str):
        n = self.cfg["hc_mult"]
        fn = self.p(f"layers.{layer}.hc_{site}_fn")
        base = self.p(f"layers.{layer}.hc_{site}_base")
        scale = self.p(f"layers.{layer}.hc_{site}_scale")
        he = self.cfg["hc_eps"]
        u = rmsnorm(rs.flatten(1), None, self.eps)
        mix = u @ fn.T
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + he
        post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        a = mix[:, 2 * n :].reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n)
        comb = torch.softmax(a, -1) + he
        comb = comb / (comb.sum(-2, keepdim=True) + he)
        for _ in range(self.cfg["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + he)
            comb = comb / (comb.sum(-2, keepdim=True) + he)
        return pre, post, comb

    @staticmethod
    def _collapse(rs: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre[:, :, None] * rs).sum(1)

    @staticmethod
    def _expand(rs, y, post, comb):
        return post[:, :, None] * y[:, None, :] + torch.einsum("sjk,sjd->skd", comb, rs)

    # -- Engram --
    def _engram(self, rs: torch.Tensor, layer: int, hash_ids: torch.Tensor) -> torch.Tensor:
        pre = f"layers.{layer}.engram."
        n, dim = rs.shape[1], rs.shape[2]
        e = self.p(pre + "embed.weight")[hash_ids].flatten(1)
        kv = e @ self.p(pre + "wkv.weight").T
        key, value = kv[:, : n * dim].reshape(-1, n, dim), kv[:, n * dim :]
        wqk = self.p(pre + "q_weight") * self.p(pre + "k_weight")
        rstd = torch.rsqrt(rs.pow(2).mean(-1) + self.eps) * torch.rsqrt(
            key.pow(2).mean(-1) + self.eps
        )
        dot = (rs * wqk * key).sum(-1) * rstd * dim**-0.5
        gate = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(dot.abs(), min=1e-6)), dot))
        return rs + gate[:, :, None] * value[:, None, :]

    # -- MoE --
    def _moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        c, pre = self.cfg, f"layers.{layer}.ffn."
        lim = c["swiglu_limit"]
        logits = (x @ self.p(pre + "gate.weight").T) / c["gate_temp"]
        if c["scoring_func"] == "sqrtsoftplus":
            s = F.softplus(logits).sqrt()
        else:
            assert c["scoring_func"] == "sigmoid", c["scoring_func"]
            s = torch.sigmoid(logits)
        k = c["num_experts_per_tok"]
        idx = torch.topk(s + self.p(pre + "gate.bias"), k, -1).indices
        w = s.gather(1, idx)
        if c.get("norm_topk_prob", True) and k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * c["routed_scaling_factor"]

        def expert(name: str, rows: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            g = rows @ self.p(name + "w1.weight").T
            u = torch.clamp(rows @ self.p(name + "w3.weight").T, -lim, lim)
            y = F.silu(torch.clamp(g, max=lim)) * u
            if weight is not None:
                y = weight[:, None] * y  # the routing weight before the down projection
            return y @ self.p(name + "w2.weight").T

        out = torch.zeros_like(x)
        for e in range(c["n_routed_experts"]):
            rows, slots = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(f"{pre}experts.{e}.", x[rows], w[rows, slots]))
        return out + expert(pre + "shared_experts.", x, None)

    # -- attention --
    def _compress(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Pre-RoPE latents [S // m, Dh] of the groups complete in the sequence."""
        m, pre = self.ratios[layer], f"layers.{layer}.attn.compressor."
        kv = x @ self.p(pre + "wkv.weight").T
        if m == 1:
            return rmsnorm(kv, self.p(pre + "norm.weight"), self.eps)
        groups, width = x.shape[0] // m, kv.shape[1]
        z = (x @ self.p(pre + "wgate.weight").T)[: groups * m].reshape(groups, m, width)
        kv = kv[: groups * m].reshape(groups, m, width)
        pooled = (torch.softmax(z, dim=1) * kv).sum(1)
        return rmsnorm(pooled, self.p(pre + "norm.weight"), self.eps)

    def _candidates(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[S, G] bool: the positions of the candidate blocks of every row."""
        b, keep_n = self.cfg["candidate_block_size"], self.cfg["candidate_topk_blocks"]
        rows, width = scores.shape
        n_blocks = -(-width // b)
        padded = torch.full((rows, n_blocks * b), NEG_INF)
        padded[:, :width] = scores
        block_max = padded.reshape(rows, n_blocks, b).amax(-1)
        for t in range(rows):
            if visible[t] > 0:
                block_max[t, (int(visible[t]) - 1) // b] = float("inf")
        top = torch.topk(block_max, min(keep_n, n_blocks), -1)
        keep = torch.zeros(rows, n_blocks, dtype=torch.bool)
        keep.scatter_(1, top.indices, top.values > NEG_INF)
        return keep.repeat_interleave(b, 1)[:, :width]

    def _indexer(self, x, qr, pos, layer: int, shared: dict, debug: dict) -> torch.Tensor:
        c, pre, m = self.cfg, f"layers.{layer}.attn.indexer.", self.ratios[layer]
        heads, dim = c["index_n_heads"], c["index_head_dim"]
        qi = (qr @ self.p(pre + "wq_b.weight").T).reshape(-1, heads, dim)
        qi = fq4_index(rotate(qi, pos, self.freqs_comp))
        w = (x @ self.p(pre + "weights_proj.weight").T) * heads**-0.5
        keys = shared["index_keys"]
        s = torch.einsum("shd,gd->shg", qi, keys).relu() * dim**-0.5
        s = (s * w[:, :, None]).sum(1)
        visible = (pos + 1) // m
        s = s.masked_fill(torch.arange(keys.shape[0])[None, :] >= visible[:, None], NEG_INF)
        if layer == self.cand_source:
            shared["candidates"] = self._candidates(s, visible)
            debug[f"candidate_mask.L{layer}"] = shared["candidates"]
        elif 0 <= self.cand_source < layer:
            s = s.masked_fill(~shared["candidates"], NEG_INF)
        top = torch.topk(s, min(c["index_topk"], keys.shape[0]), -1)
        picked = torch.zeros_like(s, dtype=torch.bool)
        picked.scatter_(1, top.indices, top.values > NEG_INF)
        return picked

    def _attention(self, x, pos, layer: int, shared: dict, debug: dict) -> torch.Tensor:
        c, pre, m = self.cfg, f"layers.{layer}.attn.", self.ratios[layer]
        heads, hd, window = c["num_attention_heads"], c["head_dim"], c["sliding_window"]
        freqs = self.freqs_main if m == 0 else self.freqs_comp
        qr = rmsnorm(x @ self.p(pre + "wq_a.weight").T, self.p(pre + "q_norm.weight"), self.eps)
        q = rotate((qr @ self.p(pre + "wq_b.weight").T).reshape(-1, heads, hd), pos, freqs)
        kv = rmsnorm(x @ self.p(pre + "wkv.weight").T, self.p(pre + "kv_norm.weight"), self.eps)
        win = fq8_window(rotate(kv, pos, freqs))
        debug[f"window_kv.L{layer}"] = win
        j = torch.arange(x.shape[0])
        keys, mask = win, (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - window)
        if m > 0:
            if layer in self.kv_sources:
                latent = self._compress(x, layer)
                gpos = torch.arange(latent.shape[0]) * m
                if layer in self.index_sources:
                    ik = latent @ self.p(pre + "indexer.wk.weight").T
                    ik = rmsnorm(ik, self.p(pre + "indexer.k_norm.weight"), self.eps)
                    shared["index_keys"] = fq4_index(rotate(ik, gpos, self.freqs_comp))
                    debug[f"index_k.L{layer}"] = shared["index_keys"]
                shared["latents"] = fq4_latent(rotate(latent, gpos, self.freqs_comp))
                debug[f"compressed_kv.L{layer}"] = shared["latents"]
            if layer in self.index_sources:
                shared["topk"] = self._indexer(x, qr, pos, layer, shared, debug)
            debug[f"topk_mask.L{layer}"] = shared["topk"]
            keys = torch.cat((keys, shared["latents"]))
            mask = torch.cat((mask, shared["topk"]), 1)
        logits = torch.einsum("shd,kd->shk", q, keys) * hd**-0.5
        logits = logits.masked_fill(~mask[:, None, :], NEG_INF)
        sink = self.p(pre + "attn_sink")[None, :, None].expand(x.shape[0], -1, 1)
        probs = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]
        o = rotate(torch.einsum("shk,kd->shd", probs, keys), pos, freqs, sign=-1.0)
        groups, rank = c["o_groups"], c["o_lora_rank"]
        wa = self.p(pre + "wo_a.weight").reshape(groups, rank, -1)
        z = torch.einsum("sgi,gri->sgr", o.reshape(x.shape[0], groups, -1), wa)
        return z.reshape(x.shape[0], -1) @ self.p(pre + "wo_b.weight").T

    # -- whole model --
    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c, n = self.cfg, self.cfg["hc_mult"]
        seq = len(ids)
        pos = torch.arange(seq)
        x = self.p("embed.weight")[torch.tensor(ids)]
        rs = x[:, None, :].repeat(1, n, 1)
        pre = torch.zeros(seq, n)
        pre[:, 0] = 1.0  # the first sublayer reads stream 0
        debug: dict[str, torch.Tensor] = {}
        hash_ids = None
        if self.engram_layers:
            assert self.token_map is not None
            hash_ids = engram_hash_ids(ids, c, self.token_map)
            debug["engram_hash_ids"] = hash_ids
        shared: dict = {}
        streams, inputs = [], []
        for layer in range(self.n_layers):
            if layer in self.engram_layers:
                assert hash_ids is not None
                rs = self._engram(rs, layer, hash_ids[:, self.engram_layers.index(layer)])
            inputs.append(rs)
            pre_a, post, comb = self._mixes(rs, layer, "attn")
            h = rmsnorm(
                self._collapse(rs, pre), self.p(f"layers.{layer}.attn_norm.weight"), self.eps
            )
            rs = self._expand(rs, self._attention(h, pos, layer, shared, debug), post, comb)
            pre_f, post, comb = self._mixes(rs, layer, "ffn")
            h = rmsnorm(
                self._collapse(rs, pre_a), self.p(f"layers.{layer}.ffn_norm.weight"), self.eps
            )
            rs = self._expand(rs, self._moe(h, layer), post, comb)
            pre = pre_f
            streams.append(rs)
        debug["layer_output_streams"] = torch.stack(streams)
        # the streams entering each layer's attention (after its Engram): DSpark's taps
        debug["layer_input_streams"] = torch.stack(inputs)
        h = rmsnorm(self._collapse(rs, pre), self.p("norm.weight"), self.eps)
        return h @ self.p("head.weight").T, debug
