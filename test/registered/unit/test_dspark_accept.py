"""Runtime acceptance: greedy, sampled, mixed, cap, finalisation, the fixed-point bonus draw,
equality of the torch and Triton ("spec" family) implementations on identical uniforms, and
distributional exactness (chi-square) -- including a detectably biased anticipating policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from sgl_dspark.srt.core.kernel_choice import KernelChoice
from sgl_dspark.srt.layers.sampler import SamplingBatchInfo
from sgl_dspark.srt.layers.sampler import sample_from_probs as sample_inverse_cdf
from sgl_dspark.srt.sampling import SamplingParams
from sgl_dspark.srt.speculative.dspark.accept import create_accept_fn
from sgl_dspark.srt.speculative.dspark.planner import plan_algorithm1
from sgl_dspark.srt.speculative.dspark.sampling import draft_probs, markov_sample
from sgl_dspark.srt.speculative.dspark.sampling import target_probs as _target_probs
from sgl_dspark.srt.speculative.dspark.sps import DiagonalSpsTable

TOP_K_ALL = 1 << 30  # a top-k larger than any vocabulary: no truncation

# The torch backend of acceptance (the reference rules, `spec_accept_ref`).
accept_step = create_accept_fn(KernelChoice("torch"))


def greedy_accept(
    verify_ids: torch.Tensor, verify_lens: torch.Tensor, chain: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, bonus) of all-greedy acceptance against the target argmax chain [B, W]."""
    vocab = int(max(int(chain.max()), int(verify_ids.max()))) + 1
    logits = torch.nn.functional.one_hot(chain, vocab).float()
    batch = verify_ids.shape[0]
    out = accept_step(
        verify_ids,
        verify_lens,
        torch.zeros(batch, dtype=torch.int64),
        logits,
        torch.ones(batch, dtype=torch.bool),
    )
    return out.accept_len, out.bonus


def sampled_accept(verify_ids, verify_lens, p, q, coins, bonus_u):
    """(n, bonus) of all-sampled acceptance with target P, draft Q and the given uniforms."""
    batch = verify_ids.shape[0]
    out = accept_step(
        verify_ids,
        verify_lens,
        torch.zeros(batch, dtype=torch.int64, device=verify_ids.device),
        p,
        torch.zeros(batch, dtype=torch.bool, device=verify_ids.device),
        p,
        q,
        coins,
        bonus_u,
    )
    return out.accept_len, out.bonus


def target_probs(logits, temperature, top_k, top_p):
    """The target distributions of verify logits [B, W, V] for per-row sampling parameters."""
    params = [
        SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p))
        for t, k, p in zip(temperature, top_k, top_p)
    ]
    info = SamplingBatchInfo.from_params(
        params, logits.shape[-1], logits.device, counters=[0] * len(params)
    )
    return _target_probs(logits, info)


def _logits_with_argmax(chain: torch.Tensor, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits [B, W, V] whose row argmax equals ``chain`` [B, W]."""
    logits = torch.randn((*chain.shape, vocab), generator=gen)
    return logits.scatter(-1, chain.unsqueeze(-1), 10.0)


# ---- greedy ---------------------------------------------------------------------------------
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def test_greedy_hand_cases():
    gen = torch.Generator().manual_seed(0)
    chain = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4], [9, 9, 9, 9]])
    verify_ids = torch.tensor(
        [
            [0, 5, 6, 9],  # two matches, third differs -> n = 2, bonus t_2 = 7
            [0, 5, 6, 7],  # all match -> n = 3, bonus t_3 = 8
            [0, 1, 2, 3],  # would match all, but verify length 2 -> n = 1, bonus t_1 = 2
            [0, 4, 2, 3],  # first mismatch -> n = 0, bonus t_0 = 1
            [3, 9, 9, 9],  # padding row (verify length 0)
        ]
    )
    verify_lens = torch.tensor([4, 4, 2, 4, 0])
    seq_lens = torch.tensor([10, 20, 30, 40, 50])
    logits = _logits_with_argmax(chain, 12, gen)
    out = accept_step(verify_ids, verify_lens, seq_lens, logits, torch.ones(5, dtype=torch.bool))
    assert out.accept_len.tolist() == [2, 3, 1, 0, 0]
    assert out.commit_len.tolist() == [3, 4, 2, 1, 0]
    assert out.bonus.tolist()[:4] == [7, 8, 2, 1]
    assert out.out_tokens.tolist() == [
        [5, 6, 7, -1],
        [5, 6, 7, 8],
        [1, 2, -1, -1],
        [1, -1, -1, -1],
        [-1, -1, -1, -1],
    ]
    assert out.next_anchor.tolist() == [7, 8, 2, 1, 3]
    assert out.new_seq_lens.tolist() == [13, 24, 32, 41, 50]
    assert out.cap_trim.tolist() == [0] * 5


def _greedy_ref(verify_ids, verify_lens, chain):
    lens, bonus = [], []
    for ids, vlen, t in zip(verify_ids.tolist(), verify_lens.tolist(), chain.tolist()):
        n = 0
        while n + 1 < vlen and ids[n + 1] == t[n]:
            n += 1
        lens.append(n)
        bonus.append(t[n])
    return lens, bonus


@pytest.mark.parametrize("batch, width, vocab", [(1, 1, 5), (8, 2, 4), (33, 6, 3), (64, 8, 5)])
def test_greedy_random_ragged(batch, width, vocab):
    gen = torch.Generator().manual_seed(batch * width)
    chain = torch.randint(0, vocab, (batch, width), generator=gen)
    verify_ids = torch.randint(0, vocab, (batch, width), generator=gen)
    follow = torch.rand((batch, width), generator=gen) < 0.7  # make long matches common
    verify_ids[:, 1:] = torch.where(follow[:, 1:], chain[:, :-1], verify_ids[:, 1:])
    verify_lens = torch.randint(1, width + 1, (batch,), generator=gen)
    n, bonus = greedy_accept(verify_ids, verify_lens, chain)
    want_n, want_b = _greedy_ref(verify_ids, verify_lens, chain)
    assert n.tolist() == want_n and bonus.tolist() == want_b


# ---- sampled, against a per-row reference -------------------------------------------------------
def _fixed(masses: list[float]) -> list[int]:
    """trunc(m * 2**40) of fp32 masses, in Python integers (the module doc's step 1)."""
    return [int(np.float32(max(m, 0.0)) * np.float32(2.0**40)) for m in masses]


def _inverse_cdf_ref(weights: list[int], u: float) -> int:
    """First index whose integer CDF exceeds floor(S * u24 / 2**24); 0 for a massless row."""
    total = sum(weights)
    if total == 0:
        return 0
    u24 = min(int(np.float32(u) * np.float32(2.0**24)), 2**24 - 1)
    threshold = total * u24 >> 24
    acc = 0
    for i, w in enumerate(weights):
        acc += w
        if acc > threshold:
            return i
    raise AssertionError("threshold < total always")


def test_inverse_cdf_hand_cases():
    probs = torch.tensor(
        [
            [0.0, 0.25, 0.0, 0.75],
            [0.5, 0.5, 0.0, 0.0],
            [0.0, 0.0, 0.0, 2.0],
            [0.0, 0.0, 0.0, 0.0],
            [-1.0, 0.5, -0.5, 0.5],
        ]
    )
    cases = {  # u -> expected token per row (hand-derived: intervals [C[k-1], C[k]) of u * S)
        0.0: [1, 0, 3, 0, 1],
        0.2499999: [1, 0, 3, 0, 1],
        0.25: [3, 0, 3, 0, 1],  # on the boundary 0.25 * S: the upper token
        0.5: [3, 1, 3, 0, 3],
        0.9999999: [3, 1, 3, 0, 3],
    }
    for u, want in cases.items():
        assert sample_inverse_cdf(probs, torch.full((5,), u)).tolist() == want, u


def test_inverse_cdf_random_rows_match_integer_reference():
    gen = torch.Generator().manual_seed(11)
    for vocab in (1, 3, 17, 200):
        probs = torch.softmax(torch.randn((64, vocab), generator=gen) * 3, -1)
        probs[::3, : vocab // 2] = 0.0  # zero-mass runs
        u = torch.rand(64, generator=gen)
        got = sample_inverse_cdf(probs, u).tolist()
        want = [_inverse_cdf_ref(_fixed(row), float(x)) for row, x in zip(probs.tolist(), u)]
        assert got == want
        assert all(probs[i, t] > 0 for i, t in enumerate(got))


def _sampled_ref(verify_ids, verify_lens, p, q, coins, bonus_u):
    lens, bonus = [], []
    for b in range(verify_ids.shape[0]):
        vlen, n = int(verify_lens[b]), 0
        rejected = False
        while n + 1 < vlen:
            d = int(verify_ids[b, n + 1])
            if float(coins[b, n]) * float(q[b, n, d]) < float(p[b, n, d]):
                n += 1
            else:
                rejected = True
                break
        weights = _fixed(p[b, n].tolist())
        if rejected:
            resid = [
                max(np.float32(max(x, 0.0)) - np.float32(y), np.float32(0.0))
                for x, y in zip(p[b, n].tolist(), q[b, n].tolist())
            ]
            resid_w = _fixed([float(r) for r in resid])
            weights = resid_w if sum(resid_w) > 2**16 else weights
        lens.append(n)
        bonus.append(_inverse_cdf_ref(weights, float(bonus_u[b])))
    return lens, bonus


@pytest.mark.parametrize("batch, width, vocab", [(16, 1, 5), (40, 3, 6), (40, 6, 9)])
def test_sampled_matches_reference(batch, width, vocab):
    gen = torch.Generator().manual_seed(width)
    p = torch.softmax(torch.randn((batch, width, vocab), generator=gen) * 2, -1)
    q = torch.softmax(torch.randn((batch, max(width - 1, 1), vocab), generator=gen) * 2, -1)
    verify_ids = torch.randint(0, vocab, (batch, width), generator=gen)
    verify_lens = torch.randint(0, width + 1, (batch,), generator=gen)
    coins = torch.rand((batch, max(width - 1, 1)), generator=gen)
    bonus_u = torch.rand(batch, generator=gen)
    n, bonus = sampled_accept(verify_ids, verify_lens, p, q, coins, bonus_u)
    want_n, want_b = _sampled_ref(verify_ids, verify_lens, p, q, coins, bonus_u)
    real = verify_lens > 0
    assert n[real].tolist() == [x for x, r in zip(want_n, real.tolist()) if r]
    assert bonus[real].tolist() == [x for x, r in zip(want_b, real.tolist()) if r]


def test_out_of_vocab_draft_is_rejected():
    p = torch.full((2, 3, 4), 0.25)
    q = torch.full((2, 2, 4), 0.25)
    verify_ids = torch.tensor([[1, 2, -1], [1, 7, 2]])  # -1 / 7 are not tokens
    n, _ = sampled_accept(verify_ids, torch.tensor([3, 3]), p, q, torch.zeros(2, 2), torch.zeros(2))
    assert n.tolist() == [1, 0]


def test_mixed_batch_and_cap():
    gen = torch.Generator().manual_seed(3)
    batch, width, vocab = 24, 4, 5
    logits = torch.randn((batch, width, vocab), generator=gen)
    chain = torch.argmax(logits, -1)
    verify_ids = torch.cat(
        [torch.randint(0, vocab, (batch, 1), generator=gen), chain[:, :-1]], dim=1
    )
    verify_ids[::5, 2] = (verify_ids[::5, 2] + 1) % vocab  # some partial matches
    greedy = torch.rand(batch, generator=gen) < 0.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn((batch, width - 1, vocab), generator=gen), -1)
    coins, bonus_u = torch.rand((batch, width - 1), generator=gen), torch.rand(batch, generator=gen)
    verify_lens, seq_lens = (
        torch.full((batch,), width),
        torch.randint(5, 50, (batch,), generator=gen),
    )
    cap = torch.randint(0, width, (batch,), generator=gen)
    out = accept_step(
        verify_ids, verify_lens, seq_lens, logits, greedy, p, q, coins, bonus_u, cap_lens=cap
    )
    g_n, g_b = greedy_accept(verify_ids, verify_lens, chain)
    s_n, s_b = sampled_accept(verify_ids, verify_lens, p, q, coins, bonus_u)
    raw_n = torch.where(greedy, g_n, s_n)
    raw_b = torch.where(greedy, g_b, s_b)
    assert out.accept_len.tolist() == torch.minimum(raw_n, cap).tolist()
    assert out.cap_trim.tolist() == (raw_n - torch.minimum(raw_n, cap)).tolist()
    for b in range(batch):
        n = int(out.accept_len[b])
        if raw_n[b] > cap[b]:  # trimmed: bonus is the accepted draft at the cap row
            assert int(out.bonus[b]) == int(verify_ids[b, n + 1])
            if greedy[b]:
                assert int(out.bonus[b]) == int(chain[b, n])
        else:
            assert int(out.bonus[b]) == int(raw_b[b])
        assert out.out_tokens[b, :n].tolist() == verify_ids[b, 1 : n + 1].tolist()
        assert int(out.out_tokens[b, n]) == int(out.bonus[b])
        assert (out.out_tokens[b, n + 1 :] == -1).all()
    assert torch.equal(out.new_seq_lens, seq_lens + out.accept_len + 1)
    assert trimmed_somewhere(raw_n, cap)


def trimmed_somewhere(raw_n: torch.Tensor, cap: torch.Tensor) -> bool:
    return bool((raw_n > cap).any())


def test_no_host_sync_on_meta_tensors():
    # Meta tensors have no data: any .item()/.tolist()/branch on values would raise.
    m, batch, width, vocab = "meta", 3, 4, 7
    ids = torch.empty((batch, width), dtype=torch.int64, device=m)
    lens = torch.empty(batch, dtype=torch.int64, device=m)
    probs = torch.empty((batch, width, vocab), device=m)
    out = accept_step(
        ids,
        lens,
        lens,
        probs,
        torch.empty(batch, dtype=torch.bool, device=m),
        probs,
        probs[:, 1:],
        torch.empty((batch, width - 1), device=m),
        torch.empty(batch, device=m),
        cap_lens=lens,
    )
    assert out.out_tokens.shape == (batch, width) and out.out_tokens.device.type == "meta"


# ---- torch vs Triton ("spec" family) on identical uniforms ------------------------------------
def _random_step(batch: int, width: int, vocab: int, seed: int, coarse: bool):
    """A mixed greedy/sampled verify step; `coarse` puts probabilities and uniforms on a 1/8 grid
    so uniforms land exactly on CDF boundaries and accept tests tie (u * q == p)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((batch, width, vocab), generator=gen)
    chain = torch.argmax(logits, -1)
    verify_ids = torch.cat([torch.randint(0, vocab, (batch, 1), generator=gen), chain[:, :-1]], 1)
    noise = torch.rand((batch, width), generator=gen) < 0.3
    verify_ids = torch.where(
        noise, torch.randint(0, vocab, (batch, width), generator=gen), verify_ids
    )
    p = torch.softmax(logits * 2, -1)
    q = torch.softmax(torch.randn((batch, max(width - 1, 0), vocab), generator=gen) * 2, -1)
    coins = torch.rand((batch, max(width - 1, 0)), generator=gen)
    bonus_u = torch.rand(batch, generator=gen)
    if coarse:
        p = torch.floor(p * 8) / 8
        p[:, :, 0] += 1 - p.sum(-1)  # rows of multiples of 1/8 summing to 1
        q = torch.floor(q * 8) / 8
        q[:, :, 0] += 1 - q.sum(-1)
        coins = torch.floor(coins * 8) / 8
        bonus_u = torch.floor(bonus_u * 8) / 8
    verify_lens = torch.randint(0, width + 1, (batch,), generator=gen)  # 0 = padding row
    seq_lens = torch.randint(3, 90, (batch,), generator=gen)
    greedy = torch.rand(batch, generator=gen) < 0.3
    return verify_ids, verify_lens, seq_lens, logits, greedy, p, q, coins, bonus_u


@pytest.mark.parametrize(
    "batch, width, vocab, coarse",
    [
        (12, 1, 7, False),
        (24, 3, 5, True),
        (40, 4, 33, False),
        (16, 6, 9, True),
    ],
)
@pytest.mark.parametrize("mode", ["greedy", "sampled", "capped", "forced"])
def test_triton_accept_equals_torch(batch, width, vocab, coarse, mode):
    """Both acceptance backends on the same inputs (CPU interpreter in CI; compiled on a GPU,
    where the Triton launches need device tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = _random_step(batch, width, vocab, seed=batch * width + vocab, coarse=coarse)
    ids, lens, seq, logits, greedy, p, q, coins, bonus_u = (t.to(device) for t in args)
    kw = {}
    if mode == "forced":  # simulated acceptance: counts given, bonus = argmax at that row
        kw["forced_accept"] = torch.randint(
            0, width + 1, (batch,), generator=torch.Generator().manual_seed(3)
        ).to(device)
        want = accept_step(ids, lens, seq, logits, greedy, **kw)
        n = torch.minimum(kw["forced_accept"], (lens - 1).clamp(min=0))
        assert torch.equal(want.accept_len, torch.where(lens > 0, n, 0))
        real = lens > 0  # a padding row's bonus is its anchor, which nothing reads
        bonus = logits.argmax(-1).gather(1, n[:, None]).squeeze(1)
        assert torch.equal(want.bonus[real], bonus[real])
    elif mode != "greedy":
        kw = dict(target_probs=p, draft_probs=q, coins=coins, bonus_uniforms=bonus_u)
    if mode == "capped":
        cap_gen = torch.Generator().manual_seed(5)
        kw["cap_lens"] = torch.randint(0, width, (batch,), generator=cap_gen).to(device)
    elif mode == "greedy":
        greedy = torch.ones_like(greedy)
    want = accept_step(ids, lens, seq, logits, greedy, **kw)
    triton_accept = create_accept_fn(KernelChoice("triton"))
    assert triton_accept is not accept_step
    got = triton_accept(ids, lens, seq, logits, greedy, **kw)
    real = lens > 0
    for name in (
        "accept_len",
        "commit_len",
        "out_tokens",
        "next_anchor",
        "new_seq_lens",
        "cap_trim",
    ):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.bonus[real], want.bonus[real])
    if mode in ("sampled", "capped"):  # the sampled rule ran: some accepted, some rejected
        drafts = (lens - 1).clamp(min=0)
        assert bool(((got.accept_len > 0) & real).any()) or width == 1
        assert bool((got.accept_len < drafts).any()) or width == 1


# ---- distributional exactness -----------------------------------------------------------------
VOCAB = 6


class ToyModels:
    """Target: Markov chain with next-token logits L[prev]; draft: a Markov head that disagrees."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.target_logits = torch.randn((VOCAB, VOCAB), generator=gen) * 0.9
        # Full-rank Markov head (W1 = I): the draft's next-token logits after p are
        # M[p] = 0.5 L[p] + noise -- related to the target but often disagreeing with it.
        draft_logits = 0.5 * self.target_logits + torch.randn((VOCAB, VOCAB), generator=gen) * 0.8
        self.base = torch.randn((1, 2, VOCAB), generator=gen) * 0.2
        self.w1 = torch.eye(VOCAB)
        self.w2 = draft_logits.t().contiguous()
        self.gen = gen
        # The draft's uniforms come from their own stream, as the engine's do.
        self.draft_gen = torch.Generator().manual_seed(seed + 1)

    def target_dist(self, temp, top_k, top_p):
        n = VOCAB
        return target_probs(
            self.target_logits.view(n, 1, n),
            torch.full((n,), temp),
            torch.full((n,), top_k),
            torch.full((n,), top_p),
        )[:, 0].double()

    def step(self, anchors, temp, top_k, top_p, verify_lens_fn=None, cap=None):
        """One speculative step (gamma = 2) from per-row anchors."""
        n = anchors.shape[0]
        temps = torch.full((n,), temp)
        greedy = torch.zeros(n, dtype=torch.bool)
        draft = markov_sample(
            self.base.expand(n, 2, VOCAB),
            self.w1,
            self.w2,
            anchors,
            temps,
            greedy,
            uniforms=torch.rand((n, 2), generator=self.draft_gen),
        )
        verify_ids = torch.cat([anchors.view(-1, 1), draft.drafts], dim=1)
        logits = self.target_logits[verify_ids]  # row j scores the token after verify_ids[:, j]
        p = target_probs(logits, temps, torch.full((n,), top_k), torch.full((n,), top_p))
        q = draft_probs(draft.step_logits, temps, greedy, draft.drafts)
        verify_lens = (
            torch.full((n,), 3) if verify_lens_fn is None else verify_lens_fn(draft.drafts)
        )
        coins, bonus_u = torch.rand((n, 2), generator=self.gen), torch.rand(n, generator=self.gen)
        return accept_step(
            verify_ids,
            verify_lens,
            torch.zeros(n, dtype=torch.int64),
            logits,
            greedy,
            p,
            q,
            coins,
            bonus_u,
            cap_lens=cap,
        )


def _chisquare_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    total = float(observed.sum())
    expected = expected_probs.reshape(-1) * total
    observed = observed.reshape(-1).double()
    zero = expected < 1e-9
    assert float(observed[zero].sum()) == 0, "a token with target probability 0 was committed"
    assert float(expected[~zero].min()) >= 5, "chi-square needs >= 5 expected per cell"
    obs, exp = observed[~zero].numpy(), expected[~zero].numpy()
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize(
    "temp, top_k, top_p, ragged",
    [
        (1.0, TOP_K_ALL, 1.0, False),
        (0.7, TOP_K_ALL, 1.0, True),
        (1.0, 4, 0.85, False),
        (0.8, 3, 1.0, True),
    ],
)
def test_committed_tokens_follow_target(temp, top_k, top_p, ragged):
    n, anchor = 24_000, 2
    models = ToyModels(seed=int(temp * 10) + top_k % 7)
    anchors = torch.full((n,), anchor)
    lens_fn = cap = None
    if ragged:  # verify lengths / caps drawn independently of the drafts: non-anticipating
        lens = torch.randint(1, 4, (n,), generator=models.gen)
        lens_fn = lambda drafts: lens  # noqa: E731
        cap = torch.randint(0, 3, (n,), generator=models.gen)
    first = models.step(anchors, temp, top_k, top_p, lens_fn, cap)
    t1 = first.out_tokens[:, 0]
    second = models.step(t1, temp, top_k, top_p, lens_fn, cap)
    t2 = torch.where(first.commit_len >= 2, first.out_tokens[:, 1], second.out_tokens[:, 0])
    dist = models.target_dist(temp, top_k, top_p)
    joint = dist[anchor].view(-1, 1) * dist  # p(t1) p(t2 | t1)
    observed = torch.bincount(t1 * VOCAB + t2, minlength=VOCAB * VOCAB)
    assert float((first.accept_len > 0).double().mean()) > 0.1  # drafts do get accepted...
    assert float((first.accept_len < 2).double().mean()) > 0.2  # ...and rejected
    assert _chisquare_p(observed, joint) > 0.01


def test_anticipating_length_policy_is_biased():
    # App. A: c1 = 0.8 from the context, c2 high only if x1 is in a favoured set. The global argmax
    # without early stop verifies x1 only when x1 is favoured, which biases the committed token.
    n, anchor, temp = 40_000, 2, 1.0
    models = ToyModels(seed=99)
    dist = models.target_dist(temp, TOP_K_ALL, 1.0)[anchor]
    favoured = torch.zeros(VOCAB, dtype=torch.bool)
    q1 = torch.softmax(models.base[0, 0] + models.w2 @ models.w1[anchor], -1)
    favoured[torch.argmax(q1 - dist.float())] = True  # the draft over-proposes this token
    c2 = torch.where(favoured, 0.9, 0.1)

    def theta(table_vals, ell, c2_value):
        tau = 1 + (0.8 if ell >= 1 else 0) + (0.8 * c2_value if ell >= 2 else 0)
        return tau * table_vals[ell]

    app_a = (1.0, 0.5, 0.45)

    def biased_lens(drafts):
        best = [max(range(3), key=lambda ell: theta(app_a, ell, float(c))) for c in (0.1, 0.9)]
        return 1 + torch.where(c2[drafts[:, 0]] > 0.5, best[1], best[0])

    table = DiagonalSpsTable((1, 2, 3), (1.0, 0.6, 0.45), 3)
    alg1 = {c: plan_algorithm1([[0.8, c]], table).verify_lens[0] for c in (0.1, 0.9)}
    assert alg1[0.1] != alg1[0.9] and min(alg1.values()) >= 2  # varied, but x1 always verified

    def alg1_lens(drafts):
        return torch.where(c2[drafts[:, 0]] > 0.5, alg1[0.9], alg1[0.1])

    anchors = torch.full((n,), anchor)
    biased = models.step(anchors, temp, TOP_K_ALL, 1.0, biased_lens)
    fair = models.step(anchors, temp, TOP_K_ALL, 1.0, alg1_lens)
    assert set(biased.commit_len.tolist()) >= {1, 3}
    p_biased = _chisquare_p(torch.bincount(biased.out_tokens[:, 0], minlength=VOCAB), dist)
    p_fair = _chisquare_p(torch.bincount(fair.out_tokens[:, 0], minlength=VOCAB), dist)
    assert p_biased < 1e-6
    assert p_fair > 0.01


# ---- totality -------------------------------------------------------------------------------
EXTREME_PARAMS = [
    {"top_p": 1e-46},  # rounds to 0 in fp32: the target keeps its most probable token
    {"top_k": 2**64, "temperature": 1e300},  # past the vocabulary and past fp32's range
    {"top_k": 10**30, "top_p": 1e-46},
    {"temperature": 1.0000001e-6},  # just above the greedy threshold
    {"min_p": 1.0},
    {"temperature": 1e-5, "top_p": 5e-324},
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_acceptance_total_over_extreme_sampling_values(backend):
    """Sampled acceptance over the edges of every accepted range: target distributions with
    mass, committed tokens inside the vocabulary, and rows whose filters keep one token commit
    exactly the target's argmax chain."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, width, vocab = len(EXTREME_PARAMS), 4, 17
    gen = torch.Generator().manual_seed(11)
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(EXTREME_PARAMS)]
    info = SamplingBatchInfo.from_params(params, vocab, device, counters=[0] * batch)
    logits = (torch.randn((batch, width, vocab), generator=gen) * 3).to(device)
    p = _target_probs(logits, info)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(batch, width, device=device))
    chain = logits.argmax(-1)
    # Drafts: the target's argmax chain with one wrong token in some rows.
    drafts = chain[:, : width - 1].clone()
    drafts[::2, 1] = (drafts[::2, 1] + 1) % vocab
    verify_ids = torch.cat([torch.zeros((batch, 1), dtype=torch.int64, device=device), drafts], 1)
    q = torch.softmax(torch.randn((batch, width - 1, vocab), generator=gen), -1).to(device)
    coins = torch.rand((batch, width - 1), generator=gen).to(device)
    bonus_u = torch.rand(batch, generator=gen).to(device)
    lens = torch.full((batch,), width, dtype=torch.int64, device=device)
    seq = torch.full((batch,), 5, dtype=torch.int64, device=device)
    out = create_accept_fn(KernelChoice(backend))(
        verify_ids, lens, seq, logits, info.is_greedy, p, q, coins, bonus_u
    )
    commit = out.commit_len.tolist()
    for row, kw in enumerate(EXTREME_PARAMS):
        committed = out.out_tokens[row, : commit[row]]
        assert 1 <= commit[row] <= width
        assert ((committed >= 0) & (committed < vocab)).all(), kw
        if kw.get("top_p", 1.0) < 1e-29 or kw.get("min_p") == 1.0:
            assert committed.tolist() == chain[row, : commit[row]].tolist(), kw
