"""The training forward of a DeepSeek-V4.1 target: whole padded sequences `[B, S]`, no caches,
differentiable, over the parameters of the serving model (`DeepseekV41ForCausalLM` built with
the torch kernels), so a trained model is saved with `state_dict()` and served as it is.

Every token-local step is the serving module's own torch path: the mHC boundary
(`run_single_pass_layers` without fused boundaries), Engram, the router and experts, the norms
and the rope. Only the attention is written here, because serving reads paged caches: the window
keys and the compressed latents of a whole sequence are computed at once, and every visibility
rule is the serving one stated per query position (window (p - W, p]; group g of ratio m visible
when g < (p + 1) // m; top-k with ties to the lower entry; candidate blocks pinning the newest
visible group). A test checks these logits against the serving engine's prefill.

The QAT quantisers (FP8 window KV, FP4 latents, FP4 index keys and queries) are applied with a
straight-through gradient: the forward values are exactly the serving quantisers', the backward
passes the gradient through unchanged. The top-k selection is not differentiable: the indexer
gets no gradient from it (the demo config makes the selection cover every visible group; see
`demo_target.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from sgl_dspark.kernels.indexer.reference import candidate_block_max_ref
from sgl_dspark.kernels.norm.reference import rms_norm_ref
from sgl_dspark.srt.configs.deepseek_v41 import LayerRole
from sgl_dspark.srt.layers.attention.csa2 import select_candidate_blocks, topk_lower_index_first
from sgl_dspark.srt.layers.mhc import run_single_pass_layers
from sgl_dspark.srt.layers.moe.router import score_fn
from sgl_dspark.srt.layers.rotary import apply_rope_tail, rope_cos_sin
from sgl_dspark.srt.models.deepseek_v41 import DecoderLayer, DeepseekV41ForCausalLM
from sgl_dspark.srt.models.deepseek_v41_attention import Csa2Attention
from sgl_dspark.srt.quantization.fake_quant import (
    fake_quant_fp4_index,
    fake_quant_fp4_latent,
    fake_quant_fp8_window,
)

NEG_INF = float("-inf")


class _StraightThrough(torch.autograd.Function):
    """Forward: `quantise(x)` exactly; backward: the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantise: Callable[[torch.Tensor], torch.Tensor]):
        del ctx
        return quantise(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        del ctx
        return grad, None


def straight_through(x: torch.Tensor, quantise: Callable[[torch.Tensor], torch.Tensor]):
    return _StraightThrough.apply(x, quantise)


@dataclass
class RouterStats:
    """Per MoE layer, over the real (unpadded) tokens: the fraction of routes each expert got
    `[E]` and the mean normalised router score `[E]` (for the balancing loss)."""

    load: list[torch.Tensor] = field(default_factory=list)
    mean_score: list[torch.Tensor] = field(default_factory=list)

    def balance_loss(self) -> torch.Tensor:
        """Switch-style balance loss `E * sum_e load_e * score_e`, averaged over layers (1 when
        balanced, E when one expert takes everything)."""
        terms = [s.numel() * (f.detach() * s).sum() for f, s in zip(self.load, self.mean_score)]
        return torch.stack(terms).mean()


@dataclass
class _Sequences:
    """The batch as the attention needs it: B rows of S positions."""

    B: int
    S: int
    positions: torch.Tensor  # [T] position of every flattened row (T = B * S)
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]  # rope kind -> cos, sin [T, rd/2]
    compress_inv_freq: torch.Tensor
    latents: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [B, G, Dh]
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [B, G, Di]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [B, S, G] bool
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, nb] bool


class V41TrainingForward:
    """Binds a serving `DeepseekV41ForCausalLM` (torch kernels) for training forwards."""

    def __init__(self, model: DeepseekV41ForCausalLM) -> None:
        cfg = model.cfg
        if cfg.v41 is None:
            raise ValueError("V41TrainingForward needs a DeepSeek-V4.1 model")
        self.model = model
        self.cfg = cfg
        self.layers = cast("Sequence[DecoderLayer]", model.model.layers)
        engram = cfg.v41.engram
        self.engram = engram

    def __call__(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, stats: RouterStats | None = None
    ) -> torch.Tensor:
        """input_ids `[B, S]` (each row starts at position 0; rows shorter than S are padded at
        the end), lengths `[B]` -> logits `[B, S, V]` fp32. Padding never changes the logits
        of real positions (everything is causal or token-local)."""
        model, m = self.model, self.model.model
        B, S = input_ids.shape
        device = input_ids.device
        n = self.cfg.hc_mult
        flat_ids = input_ids.reshape(-1)
        positions = torch.arange(S, device=device).repeat(B)
        real = (torch.arange(S, device=device)[None, :] < lengths[:, None]).reshape(-1)
        tables = {
            "main": rope_cos_sin(positions, m.inv_freq_main),
            "compress": rope_cos_sin(positions, m.inv_freq_compress),
        }
        seqs = _Sequences(B, S, positions, tables, m.inv_freq_compress)
        streams = m.embed_tokens(flat_ids).unsqueeze(1).expand(-1, n, -1).contiguous()
        history = self._engram_history(input_ids) if self.engram is not None else None
        layers = self.layers

        def before_layer(i: int, s: torch.Tensor) -> torch.Tensor:
            engram = layers[i].engram
            if engram is None:
                return s
            assert history is not None
            return engram(s, history)

        def ffn(i: int, x: torch.Tensor) -> torch.Tensor:
            mlp = layers[i].mlp
            if stats is not None:
                self._record_routing(mlp.gate, x, real, stats)
            return mlp(x, flat_ids)

        _, h = run_single_pass_layers(
            streams,
            layers,
            lambda i, x: attention(layers[i].self_attn, x, seqs),
            ffn,
            None,
            (m.norm, rms_norm_ref),
            before_layer,
            rewrites={i for i, layer in enumerate(layers) if layer.engram is not None},
        )
        return model.compute_logits(h).view(B, S, -1)

    def _engram_history(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[B * S, N]` compressed ids at positions p, p-1, ..., p-(N-1) (pad before 0)."""
        assert self.engram is not None
        B, S = input_ids.shape
        N = self.engram.max_ngram_size
        shifts = torch.arange(N, device=input_ids.device)
        pos = torch.arange(S, device=input_ids.device)[:, None] - shifts[None, :]  # [S, N]
        hist = input_ids[:, pos.clamp(min=0)]  # [B, S, N]
        hist = torch.where(pos[None] >= 0, hist, torch.full_like(hist, self.engram.pad_id))
        return self.model.model.engram_token_map[hist.reshape(B * S, N)]

    @staticmethod
    def _record_routing(gate: Any, x: torch.Tensor, real: torch.Tensor, stats: RouterStats):
        logits = F.linear(x.float(), gate.weight.float())
        if gate.gate_temp is not None:
            logits = logits / gate.gate_temp
        scores = score_fn(logits, gate.scoring_func)[real]
        biased = scores.detach() + gate.e_score_correction_bias
        ids = torch.topk(biased, gate.top_k, dim=-1).indices
        counts = torch.bincount(ids.reshape(-1), minlength=scores.shape[1]).float()
        stats.load.append(counts / counts.sum().clamp(min=1))
        normalised = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        stats.mean_score.append(normalised.mean(0))


def _rotate_groups(
    x: torch.Tensor, group_pos: torch.Tensor, inv_freq: torch.Tensor, B: int
) -> torch.Tensor:
    """x `[B, G, D]` rotated (compress rope) at the groups' first positions `[G]`."""
    G = x.shape[1]
    cos, sin = rope_cos_sin(group_pos, inv_freq)
    flat = x.reshape(B * G, -1)
    return apply_rope_tail(flat, cos.repeat(B, 1), sin.repeat(B, 1)).view(B, G, -1)


def _compress(a: Csa2Attention, x: torch.Tensor, seqs: _Sequences) -> None:
    """A kv source: the latents and index keys of every group complete within S, published for
    its consumers (rotated at the group's first position, quantised as the caches store them)."""
    comp, indexer = a.compressor, a.indexer
    assert comp is not None and indexer is not None
    assert indexer.k_proj is not None and indexer.k_norm is not None
    B, S, ratio = seqs.B, seqs.S, a.ratio
    kv = F.linear(x, comp.kv_proj.weight).view(B, S, -1)
    if ratio == 1:
        pooled = kv
    else:
        assert comp.gate_proj is not None
        G = S // ratio
        score = F.linear(x, comp.gate_proj.weight).view(B, S, -1)
        kv_pairs = kv[:, : G * ratio].reshape(B, G, ratio, -1).float()
        sc_pairs = score[:, : G * ratio].reshape(B, G, ratio, -1).float()
        pooled = (torch.softmax(sc_pairs, dim=2) * kv_pairs).sum(dim=2).to(kv.dtype)
    latent = rms_norm_ref(pooled, comp.kv_norm.weight, comp.kv_norm.eps)
    G = latent.shape[1]
    group_pos = torch.arange(G, device=x.device) * ratio
    keys = rms_norm_ref(F.linear(latent, indexer.k_proj.weight), indexer.k_norm.weight, a.eps)
    keys = _rotate_groups(keys, group_pos, seqs.compress_inv_freq, B)
    seqs.index_keys[a.layer_id] = straight_through(keys, fake_quant_fp4_index)
    latent = _rotate_groups(latent, group_pos, seqs.compress_inv_freq, B)
    seqs.latents[a.layer_id] = straight_through(latent, fake_quant_fp4_latent)


@torch.no_grad()
def _select(a: Csa2Attention, x: torch.Tensor, qr: torch.Tensor, seqs: _Sequences) -> None:
    """An index source: its top-k mask `[B, S, G]` over its kv source's groups (and, for the
    candidate source, the candidate blocks)."""
    indexer = a.indexer
    assert indexer is not None and a.source is not None
    B, S, T = seqs.B, seqs.S, seqs.B * seqs.S
    keys = seqs.index_keys[a.source].detach().float()  # [B, G, Di]
    G = keys.shape[1]
    qi = F.linear(qr, indexer.q_b_proj.weight).view(T, indexer.n_heads, indexer.index_dim)
    qi = fake_quant_fp4_index(apply_rope_tail(qi, *seqs.tables["compress"]))
    head_w = F.linear(x, indexer.weights_proj.weight).float() * indexer.n_heads**-0.5
    scores = torch.einsum("bshd,bgd->bshg", qi.float().view(B, S, indexer.n_heads, -1), keys)
    scores = torch.relu(scores) * indexer.index_dim**-0.5
    scores = (scores * head_w.view(B, S, -1, 1)).sum(dim=2).reshape(T, G)
    visible = (seqs.positions + 1) // a.ratio
    hidden = torch.arange(G, device=x.device)[None, :] >= visible[:, None]
    blocks, size = a.candidate_blocks
    if a.candidate_of is not None:
        keep = seqs.candidates[a.candidate_of]
        hidden |= ~keep.repeat_interleave(size, dim=1)[:, :G]
    scores = scores.masked_fill(hidden, NEG_INF)
    if a.publishes_candidates:
        seqs.candidates[a.layer_id] = select_candidate_blocks(
            scores, visible, blocks, size, candidate_block_max_ref
        )
    k = min(indexer.topk, S // a.ratio)
    values, picks = topk_lower_index_first(scores, k)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(1, picks, values > NEG_INF)
    seqs.topk[a.source] = mask.view(B, S, G)


def attention(a: Csa2Attention, x: torch.Tensor, seqs: _Sequences) -> torch.Tensor:
    """One V4.1 attention sublayer over whole sequences: x `[T, D]` -> `[T, D]`."""
    B, S, T = seqs.B, seqs.S, seqs.B * seqs.S
    cos, sin = seqs.tables[a.rope_kind]
    qr = rms_norm_ref(F.linear(x, a.q_a_proj.weight), a.q_a_norm.weight, a.q_a_norm.eps)
    q = F.linear(qr, a.q_b_proj.weight).view(T, a.n_heads, a.head_dim)
    if a.q_head_norm:
        q = rms_norm_ref(q, None, a.eps)
    q = apply_rope_tail(q, cos, sin).view(B, S, a.n_heads, a.head_dim)
    kv = rms_norm_ref(F.linear(x, a.kv_proj.weight), a.kv_norm.weight, a.kv_norm.eps)
    window = straight_through(apply_rope_tail(kv, cos, sin), fake_quant_fp8_window)
    window = window.view(B, S, a.head_dim)
    pos = torch.arange(S, device=x.device)
    offset = pos[:, None] - pos[None, :]  # query p, key j: p - j
    window_mask = (offset >= 0) & (offset < a.window)  # [S, S]
    scale = a.head_dim**-0.5
    logits = torch.einsum("bshd,bjd->bhsj", q, window) * scale
    logits = logits.masked_fill(~window_mask[None, None], NEG_INF)
    keys = [window]
    if a.ratio > 0:
        if a.role is LayerRole.FULL:
            _compress(a, x, seqs)
        if a.role in (LayerRole.FULL, LayerRole.REINDEX):
            _select(a, x, qr, seqs)
        assert a.source is not None
        latents, picked = seqs.latents[a.source], seqs.topk[a.source]
        compressed = torch.einsum("bshd,bgd->bhsg", q, latents.to(q.dtype)) * scale
        compressed = compressed.masked_fill(~picked[:, None], NEG_INF)
        logits = torch.cat((logits, compressed), dim=-1)
        keys.append(latents.to(q.dtype))
    sink = a.sinks.to(logits.dtype)[None, :, None, None].expand(B, -1, S, 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    o = torch.einsum("bhsk,bkd->bshd", probs, torch.cat(keys, dim=1)).reshape(T, a.n_heads, -1)
    o = apply_rope_tail(o, cos, sin, inverse=True)
    wa = a.o_a_proj.weight.view(a.groups, a.o_rank, -1)
    z = torch.einsum("tgi,gri->tgr", o.reshape(T, a.groups, -1), wa).reshape(T, -1)
    return F.linear(z, a.o_b_proj.weight)


__all__ = ["RouterStats", "V41TrainingForward", "attention", "straight_through"]
