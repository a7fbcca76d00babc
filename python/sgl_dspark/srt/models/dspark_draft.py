"""DSpark draft model for DeepSeek-V4 and V4.1 targets.

A block of Q = gamma rows per request ([anchor, mask, ..., mask] at positions s..s+gamma-1) runs
through `num_stages` V4-style stages (mHC + sliding-window MQA with sinks + MoE). Each stage's
attention sees the request's injected context KV at positions [s - window, s) plus all block rows
(bidirectional inside the block). Context KV comes from target features: for every committed token
t, `main_norm(main_proj(F_t))` projected by each stage's `kv_proj`/`kv_norm` and rotated at t.
The stream collapse (hc_head) gives y; base logits U = lm_head_target(norm(y)).

Parameter names: stages live under `model.layers.{k}` with the target's layer names so the
released-name mapping is shared; `main_proj`, `main_norm`, `markov_head.{embed,head}`,
`confidence_head.proj` are DSpark's own. Embedding and lm_head are the target's (not owned).

Choices the released sources leave open: block rows and context rows use the "main" rope (the draft
is sliding-window only; cos/sin are looked up in the draft's own `RopeTable` once the runtime has
built it, `build_rope_table`); context features are the target's tap streams (`tap_layers` of the
target: V4 the completed residual after each layer in `target_layer_ids`, V4.1 the streams
entering the layer after its Engram), averaged over mHC streams.

With a V4.1 target (`stage_config.v41`) the stages are V4.1 window-only layers: single-pass mHC
(y is the last FFN site's collapse; no `hc_head`), no per-head q norm, the V4.1 MoE, and the
FP8 window quantiser on every KV row (context and block), as on the target's window KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from sgl_dspark.kernels.attention.reference import draft_attention_ref
from sgl_dspark.srt.configs.dspark_config import DSparkConfig
from sgl_dspark.srt.configs.model_config import ModelConfig
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.fp8_linear import split_k_linear_impl
from sgl_dspark.srt.layers.fused_linear import LinearGroup, grouped_linear_impl, linear_impl
from sgl_dspark.srt.layers.mhc import (
    HyperConnection,
    HyperHead,
    hc_boundary_impl,
    hc_collapse,
    hc_expand,
    run_fused_hc_layers,
    run_single_pass_layers,
)
from sgl_dspark.srt.layers.moe import SparseMoE
from sgl_dspark.srt.layers.norm import RMSNorm, rms_norm_impl
from sgl_dspark.srt.layers.quantized import mark_quantizable, module_weight, split_rows_into_groups
from sgl_dspark.srt.layers.rotary import (
    RopeTable,
    rope_cos_sin,
    rope_inv_freq,
    rope_q_kv_impl,
    rope_store_impl,
)
from sgl_dspark.srt.models.deepseek_v4 import add_moe_and_mixers
from sgl_dspark.srt.quantization.fake_quant import WINDOW_BLOCK, quantizes

# (q [B, Q, H, Dh], ctx_pool [N, Dh], ctx_slots [B, C], ctx_valid [B, C], kv_block [B, Q, Dh],
#  sinks [H], scale, inverse_rope=None | (cos, sin) [B*Q, rd/2]) -> [B, Q, H, Dh], the output's
# rope channels rotated back when inverse_rope is given
DraftAttentionFn = Callable[..., torch.Tensor]
# The attention backends (`--attention-backend`) the draft's attention core has an
# implementation for.
DRAFT_ATTENTION_BACKENDS = ("torch", "triton")


def draft_attention_impl(attention_backend: str) -> DraftAttentionFn:
    """The draft attention core for the target's `--attention-backend`, bound once per layer.

    torch: `draft_attention_ref` (`kernels/attention/reference.py`). triton: one launch of
    `kernels/attention/draft.py` (within a tolerance of torch: fp32 online softmax), which reads
    the context rows through the slots.
    """
    if attention_backend == "torch":
        return draft_attention_ref
    if attention_backend == "triton":
        # Imported only when chosen: the torch path never loads Triton.
        from sgl_dspark.kernels.attention.draft import draft_attention

        return draft_attention
    raise ValueError(
        f"the DSpark draft has no attention core for --attention-backend "
        f"{attention_backend!r}; supported: {DRAFT_ATTENTION_BACKENDS}"
    )


class DraftAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, kernels: KernelChoice, attention_backend: str = "torch"
    ) -> None:
        super().__init__()
        self.rope_store = rope_store_impl(kernels)
        self.rope_q_kv = rope_q_kv_impl(kernels)
        self.attention = draft_attention_impl(attention_backend)
        # V4.1: KV rows hold the FP8 window quantiser's values (exact in the pool's dtype).
        self.window_fp8 = cfg.v41 is not None and quantizes(cfg.head_dim, WINDOW_BLOCK)
        d, hd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.q_head_norm, self.eps = cfg.q_head_norm, cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, hd, bias=False)
        self.kv_proj = nn.Linear(d, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        self.rms_norm = rms_norm_impl(kernels)
        self.x_proj = LinearGroup([self.q_a_proj, self.kv_proj], kernels)  # one GEMM, fused
        for lin in (self.q_b_proj, self.o_a_proj, self.o_b_proj):
            mark_quantizable(lin, "weight")
        self.linear = linear_impl(kernels)
        self.grouped_linear = grouped_linear_impl(kernels)

    def linear_groups(self) -> list[LinearGroup]:
        return [self.x_proj]

    def store_context_kv(
        self,
        main_x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """`pool[slots]` = the KV rows of target tokens from their projected features `main_x`
        (kv_norm and RoPE inside the store's launch where the kernels allow)."""
        self.rope_store(
            self.linear(main_x, module_weight(self.kv_proj)),
            cos,
            sin,
            pool,
            slots,
            norm=(self.kv_norm.weight, self.kv_norm.eps),
            quant="fp8_window" if self.window_fp8 else None,
        )

    def forward(
        self,
        u: torch.Tensor,
        ctx_pool: torch.Tensor,
        ctx_slots: torch.Tensor,
        ctx_valid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: int,
        q_len: int,
    ) -> torch.Tensor:
        """u `[B*Q, D]` normed block input; the context rows are `ctx_pool [N, Dh]` at
        `ctx_slots [B, C]`, visible where `ctx_valid [B, C]`."""
        rows = u.shape[0]
        q_a, kv = self.x_proj(u)
        qr = self.rms_norm(q_a, self.q_a_norm.weight, self.q_a_norm.eps)
        q = self.linear(qr, module_weight(self.q_b_proj)).view(rows, self.n_heads, self.head_dim)
        # One launch rotates q and the block's KV rows, both norms inside it (rope_q_kv_impl).
        q, kv_rows = self.rope_q_kv(
            q,
            kv,
            cos,
            sin,
            q_norm=(None, self.eps) if self.q_head_norm else None,
            kv_norm=(self.kv_norm.weight, self.kv_norm.eps),
            kv_quant="fp8_window" if self.window_fp8 else None,
        )
        assert kv_rows is not None
        q = q.view(batch, q_len, self.n_heads, self.head_dim)
        kv = kv_rows.view(batch, q_len, -1)
        # The output's rope channels are rotated back inside the attention (its epilogue).
        o = self.attention(
            q,
            ctx_pool,
            ctx_slots,
            ctx_valid,
            kv,
            self.sinks,
            self.head_dim**-0.5,
            inverse_rope=(cos, sin),
        ).reshape(rows, self.n_heads, -1)
        wa = split_rows_into_groups(module_weight(self.o_a_proj), self.groups)
        z = self.grouped_linear(o.reshape(rows, self.groups, -1), wa).reshape(rows, -1)
        return self.linear(z, module_weight(self.o_b_proj))


class DraftStage(nn.Module):
    # set by add_moe_and_mixers (declared for type checkers)
    mlp: SparseMoE
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    attn_hc: HyperConnection
    ffn_hc: HyperConnection

    def __init__(self, cfg: ModelConfig, kernels: KernelChoice, attention_backend: str) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, kernels, attention_backend)
        # Draft stages use learned routing only (no hash table).
        add_moe_and_mixers(self, cfg, False, kernels)


class DraftBody(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelChoice, attention_backend: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DraftStage(cfg, kernels, attention_backend) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Single-pass mHC (V4.1) collapses with the last FFN site's pre: no hyper head.
        self.hc_head = (
            None
            if cfg.hc_pre_from_prev_sublayer
            else HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        )


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)  # W1 [V, r]
        self.head = nn.Linear(rank, vocab, bias=False)  # W2 [V, r]

    def teacher_forced_logits(
        self, base_logits: torch.Tensor, prev_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step logits z_k = U_k + W2 W1[prev_k] and the Markov embeddings e_k = W1[prev_k]
        of every position at once, with the previous tokens given (training: the anchor, then
        the target's tokens), differentiable in U, W1 and W2. The serving loop computes the same
        values one step at a time from its own drafts (`markov_sample`): per step the same
        operations, so equal previous tokens give equal bits.

        Args:
            base_logits: U `[B, gamma, V]`; prev_tokens: `[B, gamma]` int64.
        Returns:
            z `[B, gamma, V]` fp32 and e `[B, gamma, r]` (W1's dtype).
        """
        w1, w2 = self.embed.weight, self.head.weight
        steps, embeds = [], []
        for k in range(base_logits.shape[1]):
            e = w1[prev_tokens[:, k]]
            steps.append(base_logits[:, k].float() + torch.matmul(e.to(w2.dtype), w2.t()).float())
            embeds.append(e)
        return torch.stack(steps, dim=1), torch.stack(embeds, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=False)


class DSparkDraftModel(nn.Module):
    inv_freq: torch.Tensor

    def __init__(
        self,
        dcfg: DSparkConfig,
        kernels: KernelChoice | None = None,
        attention_backend: str = "torch",
    ) -> None:
        """`attention_backend`: the target's `--attention-backend`; it picks the attention core
        of every stage (`draft_attention_impl`)."""
        super().__init__()
        self.kernels = kernels or KernelChoice()
        cfg = dcfg.stage_config
        self.dcfg = dcfg
        self.cfg = cfg
        d = cfg.hidden_size
        self.model = DraftBody(cfg, self.kernels, attention_backend)
        self.hc_boundary = hc_boundary_impl(self.kernels)
        self.rms_norm = rms_norm_impl(self.kernels)
        self.main_proj = nn.Linear(dcfg.num_stages * d, d, bias=False)
        mark_quantizable(self.main_proj, "weight")
        self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, dcfg.markov_rank)
        self.confidence_head = ConfidenceHead(d, dcfg.markov_rank)
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.rope_main, cfg.qk_rope_head_dim), persistent=False
        )
        self.linear = linear_impl(self.kernels)
        # The main projection (K = taps x D at the graph's row count): split-K W8A8 with FP8
        # activations on (`layers/fp8_linear.py`), else the family's linear.
        self.main_linear = split_k_linear_impl(self.kernels, self.linear)
        self.rope_table: RopeTable | None = None

    def build_rope_table(self, length: int) -> None:
        """Precompute cos/sin of positions [0, length) (on the draft's device; before any graph
        capture). Its rows are `rope_cos_sin`'s bits, so it only saves the per-forward launches
        (cast, outer product, cos, sin) for one gather."""
        self.rope_table = RopeTable(self.inv_freq, length)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[N, rd/2]` of `positions [N]`: from the table when built (positions must
        then lie below its length), else computed."""
        if self.rope_table is None:
            return rope_cos_sin(positions, self.inv_freq)
        return self.rope_table.lookup(positions)

    def write_context_kv(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        pools: Sequence[torch.Tensor],
        slots: torch.Tensor,
    ) -> None:
        """Each stage's context KV of target tokens with features `[N, n_f * D]` at
        `positions [N]`, stored at `pools[stage][slots]`."""
        weight = module_weight(self.main_proj)
        if isinstance(weight, torch.Tensor):  # a quantised weight computes in x's dtype
            features = features.to(weight.dtype)
        main_x = self.rms_norm(
            self.main_linear(features, weight),
            self.main_norm.weight,
            self.main_norm.eps,
        )
        cos, sin = self.cos_sin(positions)
        stages = cast(Sequence[DraftStage], self.model.layers)
        for stage, pool in zip(stages, pools, strict=True):
            stage.self_attn.store_context_kv(main_x, cos, sin, pool, slots)

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_pools: Sequence[torch.Tensor],
        ctx_slots: torch.Tensor,
        ctx_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block rows through every stage.

        Args:
            block_embeds: `[B, Q, D]` target embeddings of [anchor, mask, ...].
            positions: `[B, Q]` absolute positions of the rows.
            ctx_pools: per stage the context-KV pool `[N, Dh]` (indexed by KV slot).
            ctx_slots: `[B, C]` int slots of the context positions, shared by every stage;
            ctx_valid: `[B, C]` bool, which of them are visible (slots of invisible ones are
                never read by the Triton core).
        Returns:
            y `[B, Q, D]`: the collapsed, pre-norm hidden state (the confidence feature), and
            `final_norm(y)` (the base-logit input; fused with the hyper head on the mhc kernels).
        """
        batch, q_len, d = block_embeds.shape
        x = block_embeds.reshape(batch * q_len, d)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        cos, sin = self.cos_sin(positions.reshape(-1))
        stages = cast("Sequence[DraftStage]", self.model.layers)
        head = self.model.hc_head
        if head is None:
            y, y_normed = run_single_pass_layers(
                streams,
                stages,
                lambda k, u: stages[k].self_attn(
                    u, ctx_pools[k], ctx_slots, ctx_valid, cos, sin, batch, q_len
                ),
                lambda k, u: stages[k].mlp(u, None),
                self.hc_boundary,
                (self.model.norm, self.rms_norm),
            )
            return y.view(batch, q_len, d), y_normed.view(batch, q_len, d)
        if self.hc_boundary is not None:
            _, head_out = run_fused_hc_layers(
                streams,
                stages,
                lambda k, u: stages[k].self_attn(
                    u, ctx_pools[k], ctx_slots, ctx_valid, cos, sin, batch, q_len
                ),
                lambda k, u: stages[k].mlp(u, None),
                self.hc_boundary,
                head=(head, self.model.norm),
            )
            assert head_out is not None
            y, y_normed = head_out
            return (y.view(batch, q_len, d), y_normed.view(batch, q_len, d))
        for stage, pool in zip(stages, ctx_pools):
            pre, post, comb = stage.attn_hc.coeffs(streams)
            u = stage.input_layernorm(hc_collapse(streams, pre))
            a = stage.self_attn(u, pool, ctx_slots, ctx_valid, cos, sin, batch, q_len)
            streams = hc_expand(streams, a, post, comb)
            pre, post, comb = stage.ffn_hc.coeffs(streams)
            f = stage.mlp(stage.post_attention_layernorm(hc_collapse(streams, pre)), None)
            streams = hc_expand(streams, f, post, comb)
        y = head(streams).view(batch, q_len, d)
        return y, self.final_norm(y)

    def final_norm(self, y: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(y, self.model.norm.weight, self.model.norm.eps)
