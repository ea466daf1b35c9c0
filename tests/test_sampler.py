"""Sampler tests on small hand-built logits."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from servelm.engine.sampler import Sampler, SamplerOutput, TokenLogprobs
from servelm.sampling_params import SamplingParams

EOS = 7


@dataclass
class Row:
    """Minimal SamplerRow: what the engine's Request provides."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)


def row(prompt=(), output=(), **kw) -> Row:
    kw.setdefault("max_tokens", None)
    return Row(SamplingParams(**kw), list(prompt), list(output))


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def draw(sampler: Sampler, logits_1d: torch.Tensor, n: int, **kw) -> Counter:
    """Sample `n` times from one distribution by batching n identical rows."""
    out = sampler(logits_1d.expand(n, -1).contiguous(), [row(**kw) for _ in range(n)])
    return Counter(out.token_ids)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(eos_token_ids={EOS})


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(1234)


def test_greedy_is_argmax_and_uses_no_randomness(sampler):
    logits = torch.randn(6, 16)
    rng_before = torch.get_rng_state()
    out = sampler(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(torch.get_rng_state(), rng_before)


@pytest.mark.parametrize("kw,expected", [
    ({}, EOS), ({"logprobs": 0}, EOS), ({"repetition_penalty": 1.5}, 9),
    ({"frequency_penalty": 1.5}, 9), ({"presence_penalty": 1.5}, 9),
    ({"min_tokens": 3}, 3), ({"min_tokens": 2}, EOS)])  # two outputs: past min_tokens 2
def test_greedy_argmax_shortcut_only_where_nothing_else_applies(sampler, kw, expected):
    # Plain greedy rows take a one-op argmax; every option that changes the choice (or asks
    # for logprobs) must still go through the pipeline.
    logits = torch.zeros(3, 16)
    logits[:, EOS] = 5.0
    logits[:, 3] = 4.0
    logits[:, 9] = 3.9
    rows = [row(prompt=[3], output=[3, EOS], temperature=0.0, **kw) for _ in range(2)]
    out = sampler(logits[:2], rows)
    assert out.token_ids == [expected, expected]
    full = sampler(logits, rows + [row(temperature=1.0, top_k=1)])  # forces the pipeline
    assert out.token_ids == full.token_ids[:2] and out.logprobs == full.logprobs[:2]
    assert (out.logprobs[0] is not None) == ("logprobs" in kw)


def test_greedy_ignores_sampling_filters(sampler):
    logits = torch.randn(3, 16)
    out = sampler(logits, [row(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9, seed=5)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_input_logits_not_modified(sampler):
    logits = torch.randn(2, 16)
    before = logits.clone()
    sampler(logits, [row(output=[1, 2], min_tokens=5, repetition_penalty=2.0,
                         frequency_penalty=1.0, top_k=3, top_p=0.5, min_p=0.1, temperature=0.7),
                     row(temperature=0.0, presence_penalty=1.0, output=[3])])
    assert torch.equal(logits, before)


def test_empty_batch_and_shape_check(sampler):
    assert sampler(torch.empty(0, 16), []) == SamplerOutput([], [])
    with pytest.raises(ValueError):
        sampler(torch.randn(2, 16), [row()])


def test_mixed_greedy_and_sampled_batch(sampler):
    # Row 1 is near one-hot so its sample is certain; rows 0 and 2 are greedy.
    logits = torch.randn(3, 16)
    logits[1] = -50.0
    logits[1, 11] = 50.0
    out = sampler(logits, [row(temperature=0.0), row(temperature=1.0), row(temperature=0.0)])
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] == 11
    assert out.token_ids[2] == logits[2].argmax().item()


def test_top_k_only_samples_the_k_best(sampler):
    logits = torch.randn(32)
    counts = draw(sampler, logits, 3000, top_k=3)
    assert set(counts) == set(logits.topk(3).indices.tolist())


def test_top_k_disabled_values(sampler):
    # Near-uniform logits: with top_k off, many distinct tokens appear.
    logits = torch.zeros(16)
    for k in (0, -1, 16, 100):
        assert len(draw(sampler, logits, 2000, top_k=k)) == 16


@pytest.mark.parametrize("top_p, expected", [
    (0.65, {0, 1}),        # 0.4 + 0.3 = 0.7 >= 0.65
    (0.8, {0, 1, 2}),      # 0.7 < 0.8 <= 0.85
    (0.92, {0, 1, 2, 3}),  # 0.85 < 0.92 <= 0.95
    (0.3, {0}),            # the top token alone already reaches p
    (1.0, {0, 1, 2, 3, 4}),
])
def test_top_p_keeps_smallest_set_reaching_p(sampler, top_p, expected):
    logits = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05])
    assert set(draw(sampler, logits, 3000, top_p=top_p)) == expected


def test_top_p_applies_to_distribution_renormalised_after_top_k(sampler):
    # After top_k=2: [0.571, 0.429]; top_p=0.5 then keeps token 0 only.
    # Without renormalisation, 0.4 < 0.5 would also keep token 1.
    logits = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05])
    assert set(draw(sampler, logits, 2000, top_k=2, top_p=0.5)) == {0}


def test_top_p_sampled_frequencies_match_renormalised_probs(sampler):
    logits = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 20000
    counts = draw(sampler, logits, n, top_p=0.8)
    for tok, p in zip((0, 1, 2), (0.4, 0.3, 0.15)):
        assert counts[tok] / n == pytest.approx(p / 0.85, abs=0.02)


def test_min_p_drops_tokens_below_fraction_of_max(sampler):
    # Threshold 0.15 * 0.5 = 0.075: tokens 3 (0.06) and 4 (0.04) go.
    logits = logits_from_probs([0.5, 0.3, 0.1, 0.06, 0.04])
    assert set(draw(sampler, logits, 3000, min_p=0.15)) == {0, 1, 2}
    assert set(draw(sampler, logits, 3000, min_p=0.0)) == {0, 1, 2, 3, 4}


def test_min_p_is_relative_to_tempered_distribution(sampler):
    # At temperature 0.5 the probs become ~[.66, .24, .03, .01, .005]/sum:
    # min_p = 0.1 keeps only tokens 0 and 1.
    logits = logits_from_probs([0.5, 0.3, 0.1, 0.06, 0.04])
    assert set(draw(sampler, logits, 3000, min_p=0.1, temperature=0.5)) == {0, 1}


def test_temperature_changes_spread(sampler):
    logits = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 5000
    shares = []
    for t in (0.3, 1.0, 3.0):
        share = draw(sampler, logits, n, temperature=t)[0] / n
        assert share == pytest.approx((logits / t).softmax(-1)[0].item(), abs=0.03)
        shares.append(share)
    assert shares[0] > shares[1] + 0.2 and shares[1] > shares[2] + 0.1


def test_repetition_penalty_divides_positive_logits(sampler):
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    # Token 0 in the prompt: 2.0 / 1.5 = 1.33 < 1.5, so token 1 wins.
    assert sampler(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.5)]).token_ids == [1]
    # Penalty 1.25: 2.0 / 1.25 = 1.6 > 1.5, token 0 still wins.
    assert sampler(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.25)]).token_ids == [0]
    # Occurrence counts do not matter, only presence.
    assert sampler(logits, [row(prompt=[0], output=[0, 0, 0], temperature=0.0,
                                repetition_penalty=1.25)]).token_ids == [0]


def test_repetition_penalty_multiplies_negative_logits(sampler):
    logits = torch.tensor([[-1.0, -1.2, -5.0, -6.0]])
    # Token 0 in the output: -1.0 * 1.5 = -1.5 < -1.2, so token 1 wins.
    assert sampler(logits, [row(output=[0], temperature=0.0, repetition_penalty=1.5)]).token_ids == [1]
    # A penalty < 1 rewards repeats: token 1 seen, -1.2 * 0.5 = -0.6 beats -1.0.
    assert sampler(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=0.5)]).token_ids == [1]


def test_frequency_penalty_scales_with_count_over_output_only(sampler):
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    # Two occurrences: 3.0 - 2 * 0.6 = 1.8 < 2.0.
    assert sampler(logits, [row(output=[0, 0], temperature=0.0, frequency_penalty=0.6)]).token_ids == [1]
    # 3.0 - 2 * 0.4 = 2.2 > 2.0.
    assert sampler(logits, [row(output=[0, 0], temperature=0.0, frequency_penalty=0.4)]).token_ids == [0]
    # Prompt tokens are not counted.
    assert sampler(logits, [row(prompt=[0] * 5, temperature=0.0, frequency_penalty=2.0)]).token_ids == [0]


def test_presence_penalty_is_count_independent(sampler):
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    # 3.0 - 0.6 = 2.4 < 2.5 whatever the count.
    assert sampler(logits, [row(output=[0], temperature=0.0, presence_penalty=0.6)]).token_ids == [1]
    assert sampler(logits, [row(output=[0] * 9, temperature=0.0, presence_penalty=0.4)]).token_ids == [0]
    assert sampler(logits, [row(prompt=[0], temperature=0.0, presence_penalty=2.0)]).token_ids == [0]
    # A negative presence penalty encourages repeats: 2.5 + 0.6 = 3.1 > 3.0.
    assert sampler(logits, [row(output=[1], temperature=0.0, presence_penalty=-0.6)]).token_ids == [1]


def test_penalties_per_row_in_one_batch(sampler):
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, -1.0, -1.1, 0.0, 0.0])
    logits = base.expand(5, -1).contiguous()
    rows = [
        row(output=[0], temperature=0.0, presence_penalty=0.6),            # 2.4 -> token 1
        row(output=[0, 1], temperature=0.0, presence_penalty=1.2),         # 1.8, 1.3 -> token 2
        row(prompt=[0, 1], temperature=0.0, repetition_penalty=2.0),       # 1.5, 1.25 -> token 2
        row(output=[0, 0, 1], temperature=0.0, frequency_penalty=0.3,
            presence_penalty=0.1),                                         # 2.3, 2.2 -> token 0
        row(temperature=0.0),                                              # token 0
    ]
    assert sampler(logits, rows).token_ids == [1, 2, 2, 0, 0]


def test_combined_penalties_hand_computed(sampler):
    # Repetition first, then frequency/presence: token 0 -> 4.0 / 2 - (2 * 0.5 + 0.3) = 0.7.
    logits = torch.tensor([[4.0, 0.8, 0.5, -2.0]])
    r = row(prompt=[0], output=[0, 0], temperature=0.0, repetition_penalty=2.0,
            frequency_penalty=0.5, presence_penalty=0.3)
    assert sampler(logits, [r]).token_ids == [1]
    logits[0, 1] = 0.6
    assert sampler(logits, [r]).token_ids == [0]


def test_min_tokens_bans_eos_and_stop_tokens(sampler):
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 10.0
    logits[:, 3] = 9.0
    logits[:, 5] = 8.0
    rows = [
        row(output=[1], min_tokens=3, stop_token_ids=[3], temperature=0.0),   # both banned -> 5
        row(output=[1, 1, 1], min_tokens=3, stop_token_ids=[3], temperature=0.0),  # reached -> eos
        row(output=[], min_tokens=1, ignore_eos=True, temperature=0.0),       # banned regardless
        row(output=[], temperature=0.0),                                      # no min_tokens
    ]
    assert sampler(logits, rows).token_ids == [5, EOS, 3, EOS]


def test_min_tokens_bans_eos_when_sampling(sampler):
    logits = torch.zeros(16)
    logits[EOS] = 5.0
    assert EOS not in draw(sampler, logits, 2000, min_tokens=1)
    assert EOS in draw(sampler, logits, 200, min_tokens=0)


def test_multiple_eos_ids_all_banned():
    sampler = Sampler(eos_token_ids=frozenset({2, 4, 99}))  # 99 is beyond the vocab
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 4.0, 0.0]])
    assert sampler(logits, [row(min_tokens=1, temperature=0.0)]).token_ids == [1]


def _run_seeded(sampler: Sampler, logits: torch.Tensor, rows: list[Row], target: int,
                steps: int) -> list[int]:
    """Sample `steps` times; return the tokens of rows[target]."""
    tokens = []
    for step in range(steps):
        out = sampler(logits[step], rows)
        tokens.append(out.token_ids[target])
    return tokens


def test_seed_reproducible_across_calls_and_batches(sampler):
    steps, vocab = 12, 32
    base = torch.randn(steps, vocab)  # the seeded row's logits at each step

    def seeded():
        return row(seed=42, top_p=0.95)

    alone = _run_seeded(sampler, base.unsqueeze(1), [seeded()], 0, steps)
    again = _run_seeded(sampler, base.unsqueeze(1), [seeded()], 0, steps)
    assert alone == again
    assert len(set(alone)) > 1  # really random, not stuck on the argmax

    # Same row at a different position among other seeded, unseeded and greedy
    # rows, with the default RNG reseeded differently.
    torch.manual_seed(999)
    neighbours = [row(), row(seed=7), row(temperature=0.0), row(seed=42, top_k=5)]
    batch = neighbours[:2] + [seeded()] + neighbours[2:]
    logits = torch.randn(steps, len(batch), vocab)
    logits[:, 2] = base
    assert _run_seeded(sampler, logits, batch, 2, steps) == alone

    batch = [seeded()] + neighbours[::-1]
    logits = torch.randn(steps, len(batch), vocab)
    logits[:, 0] = base
    assert _run_seeded(sampler, logits, batch, 0, steps) == alone


def test_different_seeds_differ(sampler):
    logits = torch.zeros(1, 1000)
    a = sampler(logits, [row(seed=1)]).token_ids
    b = sampler(logits, [row(seed=2)]).token_ids
    assert a != b


def test_seeded_rows_leave_default_rng_alone(sampler):
    logits = torch.randn(2, 16)
    rng_before = torch.get_rng_state()
    sampler(logits, [row(seed=1), row(seed=2)])
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_logprobs_are_raw_with_rank_and_sorted_top(sampler):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0, 2.5, 0.0, 0.1]] * 3)
    raw = torch.log_softmax(logits[0], -1)
    rows = [
        # Greedy with a repetition penalty on token 1: picks token 5 (rank 2).
        row(prompt=[1], temperature=0.0, repetition_penalty=3.0, logprobs=4),
        row(temperature=0.0, logprobs=0),
        row(temperature=0.0),
    ]
    out = sampler(logits, rows)
    assert out.token_ids == [5, 1, 1]

    lp = out.logprobs[0]
    assert isinstance(lp, TokenLogprobs)
    assert lp.token_id == 5
    assert lp.logprob == pytest.approx(raw[5].item(), abs=1e-6)  # raw, not penalised
    assert lp.rank == 2
    assert [t for t, _ in lp.top] == [1, 5, 2, 0]
    assert [v for _, v in lp.top] == pytest.approx(raw[[1, 5, 2, 0]].tolist(), abs=1e-6)

    assert out.logprobs[1] == TokenLogprobs(token_id=1, logprob=pytest.approx(raw[1].item()),
                                            rank=1, top=[])
    assert out.logprobs[2] is None


def test_logprobs_match_sampled_tokens_under_temperature(sampler):
    logits = torch.randn(64, 16)
    raw = torch.log_softmax(logits, -1)
    out = sampler(logits, [row(temperature=1.7, logprobs=5) for _ in range(64)])
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert lp.rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == raw[i].argmax().item()
        if lp.rank <= 5:
            assert lp.top[lp.rank - 1][0] == tok


def test_logprobs_more_than_vocab():
    out = Sampler(set())(torch.randn(1, 4), [row(temperature=0.0, logprobs=20)])
    assert len(out.logprobs[0].top) == 4


def _chi_square(counts: Counter, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    observed = torch.tensor([counts[i] for i in range(len(probs))], dtype=torch.float32)
    return float(((observed - expected) ** 2 / expected).sum())


def test_empirical_distribution_matches_softmax(sampler):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    probs = logits.softmax(-1)
    n = 20000
    # 7 degrees of freedom: the 99.9th percentile of chi-square is 24.3.
    assert _chi_square(draw(sampler, logits, n), probs, n) < 24.3


def test_empirical_distribution_with_per_row_generators(sampler):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    probs = logits.softmax(-1)
    n = 4000
    rows = [row(seed=s) for s in range(n)]
    counts = Counter(sampler(logits.expand(n, -1).contiguous(), rows).token_ids)
    assert _chi_square(counts, probs, n) < 24.3


def test_token_ids_out_of_vocab_do_not_crash(sampler):
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    r = row(prompt=[0, 50], output=[0, 70], temperature=0.0, repetition_penalty=2.0,
            frequency_penalty=0.1)
    assert sampler(logits, [r]).token_ids == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_paths():
    sampler = Sampler({EOS})
    logits = torch.randn(4, 32, device="cuda")
    rows = [row(temperature=0.0, output=[1], presence_penalty=1.0, logprobs=3),
            row(top_k=4, top_p=0.9, min_p=0.05, temperature=0.8, output=[2], min_tokens=4),
            Row(SamplingParams(seed=3, max_tokens=None), [], [],
                torch.Generator(device="cuda").manual_seed(3)),
            row(seed=3)]  # CPU generator with CUDA logits
    out = sampler(logits, rows)
    assert len(out.token_ids) == 4
    assert out.token_ids[1] in logits[1].topk(4).indices.tolist()
    cpu = sampler(logits[:1].cpu(), [row(temperature=0.0, output=[1], presence_penalty=1.0)])
    assert out.token_ids[0] == cpu.token_ids[0]
    assert math.isfinite(out.logprobs[0].logprob)
