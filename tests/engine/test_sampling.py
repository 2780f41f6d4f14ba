"""Sampler on synthetic logits: greedy, top-k/top-p/min-p, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import torch

from engine.sampler import Sampler, SamplingRow, inverse_cdf_draw, mix_seed
from engine.sampling_params import SamplingParams

V = 50


def row(params: SamplingParams, seed: int = 0, position: int = 0, output=(), prompt=(1, 2)) -> SamplingRow:
    return SamplingRow(params, seed, 0, position, list(prompt), list(output), frozenset([0]))


def logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits(3)
    tokens, _ = Sampler()(x, [row(SamplingParams(temperature=0))] * 3)
    assert tokens == x.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_and_a_nan_as_argmax_does():
    # bf16 logits tie often; the greedy token must be argmax's (the HF oracle's) on every one of them.
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-2, 3, (64, 4099), generator=gen).float()
    x[3] = 1.0  # every token tied
    x[5, 17] = x[5, 900] = float("inf")
    x[7, 40] = float("nan")
    tokens, _ = Sampler()(x, [row(SamplingParams(temperature=0))] * 64)
    assert tokens == x.argmax(-1).tolist()
    assert tokens[3] == 0 and tokens[5] == 17 and tokens[7] == 40


def test_top_k_and_top_p_restrict_support():
    x = logits()
    top5 = set(x[0].topk(5).indices.tolist())
    probs = torch.softmax(x[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    seen_k, seen_p = set(), set()
    for s in range(200):
        (tk,), _ = Sampler()(x, [row(SamplingParams(temperature=1.0, top_k=5), seed=s)])
        (tp,), _ = Sampler()(x, [row(SamplingParams(temperature=1.0, top_p=0.5), seed=s)])
        seen_k.add(tk)
        seen_p.add(tp)
    assert seen_k <= top5 and len(seen_k) > 1
    assert seen_p <= nucleus


def test_min_p():
    x = torch.full((1, V), -10.0)
    x[0, 3], x[0, 7] = 5.0, 4.0  # p(7)/p(3) = e^-1 = 0.37
    for s in range(50):
        (t,), _ = Sampler()(x, [row(SamplingParams(temperature=1.0, min_p=0.5), seed=s)])
        assert t == 3


def test_seeded_sampling_independent_of_batch():
    x = logits(4)
    p = SamplingParams(temperature=1.0, seed=42)
    alone, _ = Sampler()(x[2:3], [row(p, seed=42, position=5)])
    batch, _ = Sampler()(
        x,
        [row(SamplingParams(temperature=0.7), seed=i) for i in range(2)]
        + [row(p, seed=42, position=5), row(p, seed=1)],
    )
    assert batch[2] == alone[0]
    # With a greedy row in the batch (the sampler then takes the argmax and the drawn rows' subset).
    mixed, _ = Sampler()(x, [row(SamplingParams(temperature=0))] + [row(p, seed=42, position=5)] * 3)
    assert mixed == [int(x[0].argmax())] + [int(Sampler()(x[i : i + 1], [row(p, seed=42, position=5)])[0][0])
                                            for i in (1, 2, 3)]  # fmt: skip
    assert mixed[2] == alone[0]
    draws = {Sampler()(x[:1], [row(p, seed=42, position=t)])[0][0] for t in range(30)}
    assert len(draws) > 3  # the stream advances with the position


def test_inverse_cdf_draw_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]) * 7  # unnormalised, zeros inside and at the end
    n = 20000
    seeds = [mix_seed(s, 0, 0) for s in range(n)]
    picked = inverse_cdf_draw(probs.expand(n, -1), seeds)
    freq = torch.bincount(picked, minlength=5).double() / n
    assert freq[1] == 0 and freq[4] == 0, f"a zero-probability token was drawn: {freq.tolist()}"
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0], dtype=torch.float64), atol=0.015), freq


def test_inverse_cdf_draw_across_blocks_and_a_partial_last_block():
    """A vocabulary of 700 (2 full blocks of the two-level search and a padded one), 20 live tokens spread over
    all three blocks, zeros between them."""
    gen = torch.Generator().manual_seed(5)
    live = torch.arange(3, 700, 35)
    probs = torch.zeros(1, 700)
    probs[0, live] = torch.rand(len(live), generator=gen) + 0.5
    n = 20000
    picked = inverse_cdf_draw(probs.expand(n, -1), [mix_seed(s, 1, 2) for s in range(n)])
    freq = torch.bincount(picked, minlength=700).double() / n
    assert set(picked.unique().tolist()) <= set(live.tolist()), "only live tokens are drawn"
    want = probs[0].double() / probs.sum()
    assert torch.allclose(freq, want, atol=0.008), (freq[live], want[live])


def test_inverse_cdf_draw_extreme_uniforms_land_on_positive_tokens():
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0], [0.0, 0.0, 1e-30, 0.0]])
    lowest, highest = 0, (1 << 63) - 1
    assert inverse_cdf_draw(probs, [lowest, lowest]).tolist() == [1, 2]
    assert inverse_cdf_draw(probs, [highest, highest]).tolist() == [2, 2]


def test_penalties_and_min_tokens():
    x = torch.zeros(1, V)
    x[0, 5] = 2.0
    x[0, 6] = 1.9
    (t,), _ = Sampler()(x, [row(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=(5,))])
    assert t == 6
    (t,), _ = Sampler()(x, [row(SamplingParams(temperature=0, frequency_penalty=0.05), output=(5, 5, 5))])
    assert t == 6
    (t,), _ = Sampler()(x, [row(SamplingParams(temperature=0, presence_penalty=0.2), output=(5,))])
    assert t == 6
    x[0, 0] = 10.0  # EOS is the argmax, but min_tokens blocks it
    (t,), _ = Sampler()(x, [row(SamplingParams(temperature=0, min_tokens=2), output=(1,))])
    assert t == 5


def test_logprobs_sorted_with_sampled_token():
    x = logits()
    p = SamplingParams(temperature=1.0, logprobs=3, seed=3)
    (tok,), (lp,) = Sampler()(x, [row(p, seed=3)])
    ref = torch.log_softmax(x[0], -1)
    assert lp.token_ids[0] == tok
    assert abs(lp.logprobs[0] - float(ref[tok])) < 1e-5
    assert lp.ranks[0] == int((ref > ref[tok]).sum()) + 1
    top = list(lp.token_ids[1:])
    assert set(top) | {tok} >= set(ref.topk(3).indices.tolist())
    assert sorted(lp.ranks[1:]) == lp.ranks[1:]
