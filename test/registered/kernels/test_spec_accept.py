"""On-device speculative acceptance (`spec_accept`) vs its reference (exact), a plain-Python oracle of the
rule, and a chi-square check that the sampled rule's output is distributed as the target P.

The sampled rule's vocab scan runs in one program per row (``num_chunks=1``) or split over vocab
chunks in two launches; tests force chunk counts (several, more chunks than columns) and put the
sampling threshold exactly on chunk boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from sgl_dspark.kernels.sampling.reference import sample_inverse_cdf_ref
from sgl_dspark.kernels.spec.accept import _plan_vocab_chunks, spec_accept
from sgl_dspark.kernels.spec.reference import AcceptOutput, spec_accept_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FILL = -1


def _assert_same(got: AcceptOutput, want: AcceptOutput) -> None:
    for name, g, w in zip(AcceptOutput._fields, got, want):
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert torch.equal(g.cpu(), w.cpu()), (name, g, w)


# --------------------------------------------------------------------------- plain-Python oracle


def _fixed(x: np.float32) -> int:
    return int(np.float32(x) * np.float32(2.0**40))


def _draw(weights: list[int], uniform: float) -> int:
    total = sum(weights)
    if total == 0:
        return 0
    u24 = min(int(np.float32(uniform) * np.float32(2.0**24)), 2**24 - 1)
    threshold = total * u24 // 2**24  # exact big-int floor
    running = 0
    for k, w in enumerate(weights):
        running += w
        if running > threshold:
            return k
    raise AssertionError("threshold must be below the total")


def _oracle(ids, lens, seqs, target=None, p=None, q=None, ua=None, us=None, greedy=None):
    """Row-by-row loop over numpy/int data; returns the AcceptOutput fields as lists."""
    rows, width = ids.shape
    result = ([], [], [], [], [])
    for r in range(rows):
        length = min(max(int(lens[r]), 0), width)
        if length == 0:
            for field, value in zip(result, (0, 0, [FILL] * width, int(ids[r, 0]), int(seqs[r]))):
                field.append(value)
            continue
        use_greedy = greedy[r] if greedy is not None else target is not None
        n = 0
        if use_greedy:
            while n < length - 1 and ids[r, n + 1] == target[r, n]:
                n += 1
            bonus = int(target[r, n])
        else:
            vocab = p.shape[-1]
            while n < length - 1:
                d = int(ids[r, n + 1])
                pd, qd = (p[r, n, d], q[r, n, d]) if 0 <= d < vocab else (0.0, 0.0)
                if not np.float32(ua[r, n]) * np.float32(qd) < np.float32(pd):
                    break
                n += 1
            p_row = np.maximum(p[r, n], np.float32(0))
            p_fixed = [_fixed(x) for x in p_row]
            weights = p_fixed
            if n < length - 1:
                residual = [_fixed(max(a - b, np.float32(0))) for a, b in zip(p_row, q[r, n])]
                if sum(residual) > 2**16:
                    weights = residual
            bonus = _draw(weights, us[r])
        tokens = [int(ids[r, c + 1]) for c in range(n)] + [bonus] + [FILL] * (width - n - 1)
        for field, value in zip(result, (n, n + 1, tokens, bonus, int(seqs[r]) + n + 1)):
            field.append(value)
    return result


def _assert_oracle(want: AcceptOutput, oracle) -> None:
    for name, w, o in zip(AcceptOutput._fields, want, oracle):
        assert w.cpu().tolist() == o, (name, w, o)


# --------------------------------------------------------------------------- input builders


def _verify_batch(rows: int, width: int, vocab: int, gen: torch.Generator):
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    lens = torch.randint(1, width + 1, (rows,), generator=gen)
    lens[torch.rand(rows, generator=gen) < 0.2] = 0  # padding rows
    if rows > 2:
        lens[0], lens[1] = width + 3, -1  # clamped to W and to 0
    seqs = torch.randint(0, 5000, (rows,), generator=gen)
    return ids, lens, seqs


def _greedy_targets(ids: torch.Tensor, vocab: int, gen: torch.Generator) -> torch.Tensor:
    rows, width = ids.shape
    target = torch.randint(0, vocab, (rows, width), generator=gen)
    planted = torch.randint(0, width, (rows,), generator=gen)
    for r in range(rows):
        k = int(planted[r])
        target[r, :k] = ids[r, 1 : k + 1]  # the first k drafts match
    return target


def _sampling_inputs(rows: int, width: int, vocab: int, gen: torch.Generator):
    logits = torch.randn(rows, width, vocab, generator=gen) * 3
    logits[torch.rand(rows, width, vocab, generator=gen) < 0.3] = float("-inf")  # top-k-like zeros
    logits[..., 0] = logits[..., 0].clamp_min(0.0)  # keep every row normalisable
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(rows, max(width - 1, 0), vocab, generator=gen) * 2, -1)
    one_hot = torch.rand(rows, generator=gen) < 0.25  # greedy drafts: one-hot Q rows
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(rows, width - 1)
    if width > 1:
        q[one_hot] = torch.nn.functional.one_hot(drafts[one_hot], vocab).float()
    ids = torch.cat([torch.randint(0, vocab, (rows, 1), generator=gen), drafts], dim=1)
    # Some drafts copy P's mode so long accepted runs occur, a few are out of the vocab.
    copy = torch.rand(rows, max(width - 1, 0), generator=gen) < 0.4
    ids[:, 1:] = torch.where(copy, p[:, :-1].argmax(-1), ids[:, 1:])
    ids[:, 1:][torch.rand(rows, max(width - 1, 0), generator=gen) < 0.03] = vocab + 2
    ua = torch.rand(rows, max(width - 1, 0), generator=gen)
    us = torch.rand(rows, generator=gen)
    return ids, p, q, ua, us


def _to(device: str, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("rows", [0, 1, 4, 13])
@pytest.mark.parametrize("width", [1, 2, 3, 4, 6, 8])
def test_greedy_matches_reference_and_oracle(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + width)
    ids, lens, seqs = _verify_batch(rows, width, 50, gen)
    target = _greedy_targets(ids, 50, gen)
    seqs = seqs.to(torch.int32) if width % 2 else seqs
    want = spec_accept_ref(ids, lens, seqs, target_ids=target)
    _assert_oracle(want, _oracle(ids.numpy(), lens.numpy(), seqs.numpy(), target=target.numpy()))
    ids_d, lens_d, seqs_d, target_d = _to(DEVICE, ids, lens, seqs, target)
    _assert_same(spec_accept(ids_d, lens_d, seqs_d, target_ids=target_d), want)


@pytest.mark.parametrize("rows", [0, 1, 5, 13])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_forced_accept_matches_reference_and_rule(rows: int, width: int) -> None:
    """Simulated acceptance: n = min(max(forced, 0), L - 1) whatever the target says, bonus =
    the target id at row n; forced counts beyond the window and negative ones included."""
    gen = torch.Generator().manual_seed(7 * rows + width)
    ids, lens, seqs = _verify_batch(rows, width, 50, gen)
    target = _greedy_targets(ids, 50, gen)
    forced = torch.randint(-1, width + 2, (rows,), generator=gen)
    want = spec_accept_ref(ids, lens, seqs, target_ids=target, forced_accept=forced)
    n = torch.minimum(forced.clamp(min=0), (lens.clamp(0, width) - 1).clamp(min=0))
    real = lens > 0
    assert torch.equal(want.accept_lens.long(), torch.where(real, n, 0))
    bonus = target.long().gather(1, n[:, None]).squeeze(1) if rows else n
    assert torch.equal(want.next_anchors, torch.where(real, bonus, ids[:, 0]))
    ids_d, lens_d, seqs_d, target_d, forced_d = _to(DEVICE, ids, lens, seqs, target, forced)
    poisoned = AcceptOutput(*(torch.full_like(t, 12345).to(DEVICE) for t in want))
    got = spec_accept(
        ids_d, lens_d, seqs_d, target_ids=target_d, forced_accept=forced_d, out=poisoned
    )
    _assert_same(got, want)


def test_forced_accept_needs_the_greedy_rule_alone() -> None:
    ids = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
    lens = torch.full((2,), 3, device=DEVICE)
    probs = torch.full((2, 3, 4), 0.25, device=DEVICE)
    with pytest.raises(ValueError, match="forced_accept"):
        spec_accept(
            ids,
            lens,
            lens,
            target_probs=probs,
            draft_probs=probs[:, :2],
            accept_uniforms=probs[:, :2, 0].contiguous(),
            sample_uniforms=probs[:, 0, 0].contiguous(),
            forced_accept=lens,
        )


@pytest.mark.parametrize("num_chunks", [None, 1, 3, 64])
@pytest.mark.parametrize(
    "rows,width,vocab", [(0, 3, 8), (1, 1, 37), (5, 2, 37), (9, 4, 300), (7, 6, 5000), (3, 8, 129)]
)
def test_sampled_matches_reference_and_oracle(
    rows: int, width: int, vocab: int, num_chunks: int | None
) -> None:
    # num_chunks 64 > 37 columns: chunks past the vocab are empty.
    gen = torch.Generator().manual_seed(7 + rows * 1000 + width * 10 + vocab)
    _, lens, seqs = _verify_batch(rows, width, vocab, gen)
    ids, p, q, ua, us = _sampling_inputs(rows, width, vocab, gen)
    args = dict(target_probs=p, draft_probs=q, accept_uniforms=ua, sample_uniforms=us)
    want = spec_accept_ref(ids, lens, seqs, **args)
    oracle = _oracle(
        ids.numpy(),
        lens.numpy(),
        seqs.numpy(),
        p=p.numpy(),
        q=q.numpy(),
        ua=ua.numpy(),
        us=us.numpy(),
    )
    _assert_oracle(want, oracle)
    dev = dict(zip(args, _to(DEVICE, *args.values())))
    ids_d, lens_d, seqs_d = _to(DEVICE, ids, lens, seqs)
    _assert_same(spec_accept(ids_d, lens_d, seqs_d, num_chunks=num_chunks, **dev), want)


def test_mixed_batch_selects_rule_per_row() -> None:
    gen = torch.Generator().manual_seed(11)
    rows, width, vocab = 12, 4, 200
    _, lens, seqs = _verify_batch(rows, width, vocab, gen)
    ids, p, q, ua, us = _sampling_inputs(rows, width, vocab, gen)
    target = _greedy_targets(ids, vocab, gen)
    greedy = torch.rand(rows, generator=gen) < 0.5
    sampled = dict(target_probs=p, draft_probs=q, accept_uniforms=ua, sample_uniforms=us)
    want = spec_accept_ref(ids, lens, seqs, target_ids=target, greedy_mask=greedy, **sampled)
    only_g = spec_accept_ref(ids, lens, seqs, target_ids=target)
    only_s = spec_accept_ref(ids, lens, seqs, **sampled)
    for field, g_val, s_val in zip(want, only_g, only_s):
        sel = greedy if field.dim() == 1 else greedy[:, None]
        assert torch.equal(field, torch.where(sel, g_val, s_val))
    dev = dict(zip(sampled, _to(DEVICE, *sampled.values())))
    ids_d, lens_d, seqs_d, target_d, greedy_d = _to(DEVICE, ids, lens, seqs, target, greedy)
    # Poisoned preallocated outputs must be fully overwritten.
    out = AcceptOutput(
        torch.full((rows,), -99, dtype=torch.int32, device=DEVICE),
        torch.full((rows,), -99, dtype=torch.int32, device=DEVICE),
        torch.full((rows, width), -99, dtype=torch.int64, device=DEVICE),
        torch.full((rows,), -99, dtype=torch.int64, device=DEVICE),
        torch.full((rows,), -99, dtype=seqs.dtype, device=DEVICE),
    )
    for num_chunks in (None, 1, 5):  # 5 chunks: greedy and padding rows are written by chunk 0
        for buf in out:
            buf.fill_(-99)
        got = spec_accept(
            ids_d,
            lens_d,
            seqs_d,
            target_ids=target_d,
            greedy_mask=greedy_d,
            out=out,
            num_chunks=num_chunks,
            **dev,
        )
        assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out))
        _assert_same(got, want)


def test_hand_derived_cases() -> None:
    # Row 0: draft 3 has Q(3) = P(3) = 0 and P == Q elsewhere: rejected, empty residual -> fall
    #        back to P = [1/3, 1/3, 1/3, 0]; u = 0.5 -> threshold 1.5 thirds -> token 1.
    # Row 1: both drafts accepted (P(d) = 1 > u * 0.5), bonus from P row 2 = one-hot(3).
    # Row 2: draft rejected (0.9 * Q = 0.45 >= P = 0.4); residual max(P - Q, 0) = one-hot(2).
    # Row 3: padding (verify length 0): commits nothing, keeps its anchor and seq len.
    third = 1.0 / 3.0
    p = torch.zeros(4, 3, 4)
    q = torch.zeros(4, 2, 4)
    p[0, 0, :3] = q[0, 0, :3] = third
    p[1, 0, 1] = p[1, 1, 2] = p[1, 2, 3] = 1.0
    q[1, 0, 1] = q[1, 1, 2] = q[1, :, 0] = 0.5
    p[2, 0] = torch.tensor([0.1, 0.4, 0.5, 0.0])
    q[2, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    p[3] = 0.25
    ids = torch.tensor([[9, 3, 1], [9, 1, 2], [9, 1, 0], [7, 1, 1]])
    ua = torch.tensor([[0.5, 0.5], [0.99, 0.99], [0.9, 0.0], [0.0, 0.0]])
    us = torch.tensor([0.5, 0.7, 0.01, 0.5])
    lens = torch.tensor([2, 3, 3, 0])
    seqs = torch.tensor([10, 20, 30, 40])
    args = dict(target_probs=p, draft_probs=q, accept_uniforms=ua, sample_uniforms=us)
    want = spec_accept_ref(ids, lens, seqs, **args)
    assert want.accept_lens.tolist() == [0, 2, 0, 0]
    assert want.commit_lens.tolist() == [1, 3, 1, 0]
    assert want.out_tokens.tolist() == [[1, FILL, FILL], [1, 2, 3], [2, FILL, FILL], [FILL] * 3]
    assert want.next_anchors.tolist() == [1, 3, 2, 7]
    assert want.new_seq_lens.tolist() == [11, 23, 31, 40]
    dev = dict(zip(args, _to(DEVICE, *args.values())))
    _assert_same(spec_accept(*_to(DEVICE, ids, lens, seqs), **dev), want)


def test_inverse_cdf_boundaries() -> None:
    quarter = int(0.25 * 2**40)
    weights = torch.tensor([[quarter] * 4] * 5 + [[0, 0, 5, 0]] + [[0] * 4])
    u = torch.tensor([0.0, 0.25, 0.5, 0.7499999, 1.0, 0.999, 0.5])
    # Half-open intervals [k/4, (k+1)/4): exact boundaries go up; u = 1.0 is clamped below 1;
    # a single positive weight always wins; an all-zero row gives token 0.
    assert sample_inverse_cdf_ref(weights, u).tolist() == [0, 1, 2, 2, 3, 2, 0]


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 8, 16])
def test_split_scan_threshold_on_chunk_boundaries(num_chunks: int) -> None:
    """Hand-derived draws over V = 8 whose thresholds equal a CDF value at a chunk boundary (with
    4 chunks of 2 columns). Fixed point: 1/8 -> 2**37, 1/2 -> 2**39; the threshold is
    S * u exactly for these u, and the token is the count of CDF entries <= threshold."""
    eighth = torch.full((8,), 0.125)
    p_rows = [
        (eighth, 0.5, 4),  # t = 2**39 = CDF[3] (end of chunk 1) -> first column of chunk 2
        (eighth, 0.25, 2),  # t = CDF[1] -> 2
        (eighth, 0.75, 6),  # t = CDF[5] -> 6
        (eighth, 0.0, 0),  # t = 0 < CDF[0] -> 0
        (torch.tensor([0, 0, 0.5, 0, 0, 0, 0, 0.5]), 0.5, 7),  # zero-mass chunks before the owner
        (torch.tensor([0, 0, 0, 0, 0, 0, 0, 1.0]), 0.999, 7),
        (torch.zeros(8), 0.3, 0),  # no mass at all -> token 0
    ]
    p = torch.stack([row for row, _, _ in p_rows])[:, None, :]
    us = torch.tensor([u for _, u, _ in p_rows])
    rows = p.shape[0]
    ids = torch.full((rows, 1), 3)
    lens = torch.ones(rows, dtype=torch.long)
    seqs = torch.arange(rows)
    args = dict(
        target_probs=p,
        draft_probs=torch.zeros(rows, 0, 8),
        accept_uniforms=torch.zeros(rows, 0),
        sample_uniforms=us,
    )
    want = spec_accept_ref(ids, lens, seqs, **args)
    assert want.next_anchors.tolist() == [tok for _, _, tok in p_rows]
    dev = dict(zip(args, _to(DEVICE, *args.values())))
    got = spec_accept(*_to(DEVICE, ids, lens, seqs), num_chunks=num_chunks, **dev)
    _assert_same(got, want)

    # Residual draw: draft 0 is rejected (0.9 * Q(0) = 0.225 >= P(0) = 0.125); the residual
    # max(P - Q, 0) = 1/8 on columns 2..5 (mass 2**39), u = 0.5 -> t = 2**38 = its CDF[3] -> 4.
    q = torch.tensor([0.25, 0.25, 0, 0, 0, 0, 0.25, 0.25])
    args = dict(
        target_probs=torch.stack([eighth, eighth])[None],
        draft_probs=q[None, None],
        accept_uniforms=torch.tensor([[0.9]]),
        sample_uniforms=torch.tensor([0.5]),
    )
    ids, lens, seqs = torch.tensor([[5, 0]]), torch.tensor([2]), torch.tensor([10])
    want = spec_accept_ref(ids, lens, seqs, **args)
    assert want.accept_lens.tolist() == [0] and want.next_anchors.tolist() == [4]
    dev = dict(zip(args, _to(DEVICE, *args.values())))
    _assert_same(spec_accept(*_to(DEVICE, ids, lens, seqs), num_chunks=num_chunks, **dev), want)


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_plan_spreads_the_dsv4_vocab(rows: int) -> None:
    # V = 129280: bs 1 must launch more programs than a GPU of 132 SMs has SMs; each launch stays
    # near 1024 programs; chunks tile the vocab exactly once.
    chunks, chunk, block_v = _plan_vocab_chunks(rows, 129280, None)
    assert 132 <= rows * chunks <= 1100
    assert chunk * (chunks - 1) < 129280 <= chunk * chunks
    assert chunk % block_v == 0
    assert _plan_vocab_chunks(4096, 129280, None)[0] == 1  # large batches: one program per row
    with pytest.raises(ValueError, match="num_chunks"):
        _plan_vocab_chunks(1, 100, 0)


@pytest.mark.parametrize("draft_kind", ["adversarial", "one_hot"])
def test_sampled_rule_is_distributed_as_target(draft_kind: str) -> None:
    """Leviathan/Chen: the first committed token ~ P_1 and, when the first draft was accepted,
    the second ~ P_2, whatever Q is. Checked on the reference, then the kernel on a subsample."""
    gen = torch.Generator().manual_seed(2024)
    trials, vocab, width = 40000, 8, 3
    p1 = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.0])
    p2 = torch.tensor([0.05, 0.05, 0.0, 0.40, 0.10, 0.10, 0.10, 0.20])
    p3 = torch.full((vocab,), 1.0 / vocab)
    if draft_kind == "adversarial":  # mass where P is small or zero, little on P's mode
        q1 = torch.tensor([0.01, 0.04, 0.05, 0.10, 0.10, 0.20, 0.20, 0.30])
        q2 = torch.tensor([0.30, 0.30, 0.20, 0.02, 0.03, 0.05, 0.05, 0.05])
        q = torch.stack([q1, q2]).expand(trials, 2, vocab).contiguous()
        drafts = torch.stack(
            [
                torch.multinomial(q1, trials, True, generator=gen),
                torch.multinomial(q2, trials, True, generator=gen),
            ],
            1,
        )
    else:  # argmax-style drafts that always propose a fixed (wrong-mode) token
        drafts = torch.tensor([1, 2]).expand(trials, 2)
        q = torch.nn.functional.one_hot(drafts, vocab).float()
    p = torch.stack([p1, p2, p3]).expand(trials, width, vocab).contiguous()
    ids = torch.cat([torch.zeros(trials, 1, dtype=torch.long), drafts], 1)
    lens = torch.full((trials,), width)
    seqs = torch.zeros(trials, dtype=torch.long)
    ua = torch.rand(trials, 2, generator=gen)
    us = torch.rand(trials, generator=gen)
    args = dict(target_probs=p, draft_probs=q, accept_uniforms=ua, sample_uniforms=us)
    out = spec_accept_ref(ids, lens, seqs, **args)
    for column, target, rows in ((0, p1, slice(None)), (1, p2, out.commit_lens >= 2)):
        tokens = out.out_tokens[rows, column]
        counts = torch.bincount(tokens, minlength=vocab).double()
        support = target > 0
        assert counts[~support].sum() == 0, "sampled a token the target gives zero mass"
        expected = target[support].double()
        expected = expected / expected.sum() * tokens.numel()
        assert tokens.numel() > (20000 if column == 0 else 2000)
        assert stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue > 0.01
    sub = torch.randperm(trials, generator=gen)[:96]
    dev = {k: v[sub].contiguous().to(DEVICE) for k, v in args.items()}
    got = spec_accept(*_to(DEVICE, ids[sub], lens[sub], seqs[sub]), **dev)
    _assert_same(got, AcceptOutput(*(t[sub] for t in out)))


def test_bad_arguments_raise() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    lens = torch.ones(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="target_ids"):
        spec_accept(ids, lens, lens)
    with pytest.raises(ValueError, match="greedy_mask"):
        p = torch.rand(2, 3, 5, device=DEVICE)
        spec_accept(
            ids,
            lens,
            lens,
            target_ids=ids,
            target_probs=p,
            draft_probs=p[:, :2].contiguous(),
            accept_uniforms=p[:, :2, 0].contiguous(),
            sample_uniforms=p[:, 0, 0].contiguous(),
        )
    with pytest.raises(ValueError, match="verify_lens"):
        spec_accept(ids, lens[:1], lens, target_ids=ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, width, vocab = 16, 4, 1000
    _, lens, seqs = _verify_batch(rows, width, vocab, gen)
    ids, p, q, ua, us = _sampling_inputs(rows, width, vocab, gen)
    target = _greedy_targets(ids, vocab, gen)
    greedy = torch.rand(rows, generator=gen) < 0.5
    inputs = [t.cuda() for t in (ids, lens, seqs, target, greedy, p, q, ua, us)]

    def step(ids, lens, seqs, target, greedy, p, q, ua, us):
        return spec_accept(
            ids,
            lens,
            seqs,
            target_ids=target,
            greedy_mask=greedy,
            target_probs=p,
            draft_probs=q,
            accept_uniforms=ua,
            sample_uniforms=us,
        )

    eager = step(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, eager)
