"""Speculative decoding (servelm.spec): config checks, the ngram proposer, KV rollback under
random accept/reject/abort (no model), the rejection sampler's distribution, and the engine
with and without speculation on a tiny random model and on the embedded SmolLM2 (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import EngineConfig, SpeculativeConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.request import Request, RequestStatus
from servelm.engine.scheduler import Scheduler
from servelm.config import SchedulerConfig
from servelm.sampling_params import SamplingParams
from servelm.spec.ngram import NgramIndex

# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 1.5}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"prompt_lookup_max": "3"}, "prompt_lookup_max"),
    ({"method": "ngram", "model": "x.gguf"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"num_speculative_token": 3}, "num_speculative_token"),
])
def test_bad_configs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


def test_lookup_bounds_default_as_vllm():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(prompt_lookup_max=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    assert EngineConfig(speculative=c).speculative is c


def test_cli_rejects_bad_speculative_config(capsys):
    from servelm.cli import make_parser

    with pytest.raises(SystemExit):
        make_parser().parse_args(["generate", "hi", "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert "num_speculative_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--speculative-config", "{not json"])
    assert "not JSON" in capsys.readouterr().err
    args = make_parser().parse_args(["serve", "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config.num_speculative_tokens == 3


# ---- the ngram proposer ----------------------------------------------------------------------


def test_ngram_copies_what_followed_the_longest_recurring_suffix():
    ix = NgramIndex(1, 3)  # one index, grown step by step as a sequence is
    t = [1, 2, 3, 4, 9, 2, 3]
    assert ix.propose(t, 2) == [4, 9]   # "2 3" recurs ("9 2 3" does not)
    t += [8]
    assert ix.propose(t, 2) == []       # "8" never occurred before
    t += [1, 2, 3]
    assert ix.propose(t, 3) == [4, 9, 2]  # "1 2 3" recurs: longer than "2 3"


def test_ngram_prefers_longest_match_then_latest_occurrence():
    t = [1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3]
    # 3-gram "1 2 3" occurred first at 0 and is followed by 4 9 2.
    assert NgramIndex(1, 3).propose(t, 3) == [4, 9, 2]
    # Only 2-grams allowed: "2 3" last occurred at 5..7, followed by 8 1 2.
    assert NgramIndex(1, 2).propose(t, 3) == [8, 1, 2]
    assert NgramIndex(4, 4).propose(t, 3) == []


def test_ngram_repeating_pattern_drafts_past_its_period():
    assert NgramIndex(1, 2).propose([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert NgramIndex(1, 1).propose([5, 5], 3) == [5, 5, 5]


# ---- rollback under random accept / reject / abort (no model) --------------------------------

REJECTED = 999_999  # a draft token no true sequence holds: must never reach the prefix cache


def _true_token(prompt: list[int], pos: int) -> int:
    return (sum(prompt[:4]) * 7 + pos * 13) % 50 + 100


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_accept_reject_abort_never_leaks_a_block(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    caching = data.draw(st.booleans())
    n = data.draw(st.integers(1, 5))
    specs = [(data.draw(st.integers(1, 12)), data.draw(st.integers(1, 10)),
              data.draw(st.one_of(st.none(), st.integers(0, 12)))) for _ in range(n)]
    shared = data.draw(st.booleans())  # identical prompts: the prefix cache shares blocks
    largest = max(-(-(p + m + 4) // block_size) for p, m, _ in specs)
    bm = BlockManager(largest + data.draw(st.integers(0, 6)), block_size, enable_caching=caching)
    budget = data.draw(st.integers(n, 24))
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget,
                                      admission_lookahead=0), bm)
    reqs = []
    for i, (p, m, _) in enumerate(specs):
        prompt = [10 + j for j in range(p)] if shared else [10 + 17 * i + j for j in range(p)]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=m), m, arrival_time=0.0)
        reqs.append(r)
        sched.add_request(r)
    for step in range(400):
        for i, (_, _, abort_at) in enumerate(specs):
            if abort_at == step and not reqs[i].is_finished:
                sched.finish_request(reqs[i], RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished():
            break
        plan = {}
        for r in sched.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                k = data.draw(st.integers(0, 4))
                good = data.draw(st.integers(0, k))
                true = [_true_token(r.prompt_token_ids, r.num_tokens + j) for j in range(good)]
                r.spec_token_ids = true + [REJECTED] * (k - good)
                plan[r.request_id] = good
        out = sched.schedule()
        assert out.num_tokens <= budget
        for s in out.scheduled:
            assert s.num_draft == len(s.request.spec_token_ids)
            if s.num_draft:
                s.num_rejected = s.num_draft - min(plan[s.request.request_id], s.num_draft)
        sched.update_after_step(out)
        for s in out.scheduled:
            r = s.request
            if not s.samples:
                continue
            accepted = s.num_draft - s.num_rejected
            for tok in r.spec_token_ids[:accepted] + [_true_token(r.prompt_token_ids, r.num_tokens + accepted)]:
                r.append_output_token(tok, 0.0)
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    break
            r.spec_token_ids = []
            if not r.is_finished:
                # Rolled back: computed = everything but the last token; no block is held
                # wholly past that token's position.
                assert r.num_computed_tokens == r.num_tokens - 1
                assert len(bm.block_table(r.request_id)) <= bm.num_blocks_for(r.num_tokens)
        owned = [b for t in bm.owners().values() for b in t]
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == owned.count(b)
        assert len(set(owned)) + bm.num_free_blocks == bm.num_blocks
        assert all(REJECTED not in key[1] for key in bm._cached), "a rejected draft was cached"
    assert not sched.has_unfinished()
    assert bm.owners() == {} and bm.num_free_blocks == bm.num_blocks
    for r in reqs:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens  # never overshoots


def test_metrics_and_bench_report_show_acceptance():
    from servelm.bench.report import server_utilization
    from servelm.engine.async_engine import EngineSnapshot
    from servelm.engine.engine import EngineStats
    from servelm.server.metrics import _EngineCollector

    stats = EngineStats()
    stats.record_spec(4, 3)
    stats.record_spec(4, 1)
    assert stats.spec_acceptance_rate == 0.5 and stats.spec_mean_accepted_length == 3.0

    class Eng:
        snapshot = EngineSnapshot(stats=stats)
        engine = None

    got = {m.name: m.samples[0].value for m in _EngineCollector(Eng()).collect()}
    assert got["servelm_spec_decode_acceptance_rate"] == 0.5
    assert got["servelm_spec_decode_mean_accepted_length"] == 3.0
    before = {"servelm_spec_decode_num_draft_tokens_total": 2.0}
    after = {"servelm_spec_decode_num_draft_tokens_total": 10.0,
             "servelm_spec_decode_num_accepted_tokens_total": 6.0,
             "servelm_spec_decode_num_drafts_total": 2.0}
    u = server_utilization(before, after)
    assert u["spec_acceptance_rate"] == 0.75 and u["spec_mean_accepted_length"] == 4.0


# ---- when to speculate: the roofline ---------------------------------------------------------


class _Running:
    """What the speculator reads from a request."""

    def __init__(self, tokens, computed=None, max_tokens=100, grammar=None):
        self.prompt_token_ids, self.output_token_ids = list(tokens), []
        self.num_computed_tokens = len(tokens) - 1 if computed is None else computed
        self.max_tokens, self.grammar = max_tokens, grammar
        self.spec_token_ids, self.draft_state = [], None

    num_tokens = property(lambda self: len(self.prompt_token_ids) + len(self.output_token_ids))
    num_output_tokens = property(lambda self: len(self.output_token_ids))

    def token_slice(self, a, b):
        return (self.prompt_token_ids + self.output_token_ids)[a:b]


def test_speculation_stops_where_the_batch_turns_compute_bound():
    from servelm.roofline import Hardware, ModelShape, ridge_tokens
    from servelm.spec.speculator import Speculator

    # fp32 weights: 4 bytes and 2 FLOPs per weight, so at a ridge of 2 FLOP/byte a step
    # computes 4 tokens per weight read before it is compute-bound.
    shape = ModelShape(num_params=10**8, weight_bits=32)
    ridge = ridge_tokens(shape, Hardware(bandwidth=1e10, flops=2e10))
    assert ridge == pytest.approx(4.0)
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                      prompt_lookup_max=2), ridge, budget=4096)
    one = [_Running([1, 2, 3, 1, 2, 3, 1, 2])]
    assert sp.propose(one, []) == 3  # 1 token + 3 drafts = 4 per weight read
    assert one[0].spec_token_ids == [3, 1, 2]
    sp.ridge_tokens = 100.0
    assert sp.propose(one, []) == 4  # capped at k
    many = [_Running([1, 2, 1, 2]) for _ in range(64)]
    sp.ridge_tokens = 8.0
    assert sp.propose(many, []) == 0  # 64 rows: compute-bound already
    assert all(r.spec_token_ids == [] for r in many)
    # Partly bound: 3 streams at a ridge of 8 take 1 draft each (6 rows), not 2 (9 rows)
    # at a low acceptance rate; at a high one, 2.
    three = [_Running([1, 2, 1, 2]) for _ in range(3)]
    for _ in range(300):
        sp.observe(4, 1)
    assert sp.propose(three, []) == 3
    for _ in range(300):
        sp.observe(4, 3)
    assert sp.propose(three, []) == 6
    # A prompt waiting to be prefilled, a grammar, a prefilling sequence, max_tokens reached.
    assert sp.propose(one, [_Running(range(50), computed=0)]) == 0
    assert sp.propose([_Running([1, 2, 1, 2], grammar=object())], []) == 0
    assert sp.propose([_Running([1, 2, 1, 2], computed=1)], []) == 0
    assert sp.propose([_Running([1, 2, 1, 2], max_tokens=1)], []) == 0
    capped = _Running([1, 2, 1, 2], max_tokens=3)
    assert sp.propose([capped], []) == 2  # at most max_tokens tokens come out of the step


# ---- the rejection sampler keeps the target distribution --------------------------------------


class _Row:
    def __init__(self, params, seed):
        self.sampling_params = params
        self.prompt_token_ids, self.output_token_ids = [1], []
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar = None


def _tv(counts: dict, p: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - p[t].item()) for t in range(p.shape[0]))


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_q):
    from servelm.engine.sampler import Sampler
    from servelm.spec.verify import verify

    V, k, N = 6, 2, 3000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=8)
    # The target, computed here independently of the sampler: temperature, then top-k.
    warped = logits / 0.8
    kth = warped.sort(dim=-1, descending=True).values[:, 4:5]
    p = warped.masked_fill(warped < kth, float("-inf")).softmax(dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g), dim=-1)
    sampler = Sampler(eos_token_ids={V + 10})
    firsts, seconds, thirds = {}, {}, {}
    fixed = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a likely, not certain, point mass
    for batch in range(N // 500):
        rows = [_Row(params, 1000 * batch + i) for i in range(500)]
        if with_q:
            drafts = [[int(torch.multinomial(q[j], 1, generator=r.generator)) for j in range(k)]
                      for r in rows]
        else:
            drafts = [list(fixed) for _ in rows]
        out = verify(sampler, logits.repeat(500, 1), rows, drafts,
                     [i * (k + 1) for i in range(500)],
                     [q] * 500 if with_q else None)
        for d, v in zip(drafts, out):
            t = v.token_ids
            assert 1 <= len(t) <= k + 1 and t[:v.num_accepted] == d[:v.num_accepted]
            firsts[t[0]] = firsts.get(t[0], 0) + 1
            if v.num_accepted >= 1:
                seconds.setdefault(t[0], {}).setdefault(t[1], 0)
                seconds[t[0]][t[1]] += 1
            if v.num_accepted == 2:
                thirds[t[2]] = thirds.get(t[2], 0) + 1
    # First token ~ p_0; the second, given the first was an accepted draft, ~ p_1; the bonus
    # token after two accepted drafts ~ p_2. A rule that accepts too often, or redraws from
    # p without removing the draft, is off by 0.1-0.5 in total variation.
    assert _tv(firsts, p[0]) < 0.04
    assert firsts.get(int(p[0].argsort()[0]), 0) == 0  # outside top-k: never
    for first, c in seconds.items():
        if sum(c.values()) > 400:
            assert _tv(c, p[1]) < 0.06, first
    if sum(thirds.values()) > 400:
        assert _tv(thirds, p[2]) < 0.06


# ---- the engine, with and without speculation ------------------------------------------------

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax_rate)
'''
EDIT = [{"role": "user", "content": "Rename subtotal to base in this function and output "
         "only the code.\n\n" + CODE}]
REPEAT = [{"role": "user", "content": "Repeat this text exactly: The quick brown fox jumps "
           "over the lazy dog. The quick brown fox jumps over the lazy dog."}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _spec_llm(**kw):
    from servelm import LLM

    llm = LLM(speculative_config=NGRAM, **kw)
    llm.engine.speculator.ridge_tokens = 1e9  # speculate whatever this machine measured
    return llm


def _run(llm, on: bool, prompts, params):
    """Outputs with speculation on or off (the same engine), and the drafts it accepted."""
    llm.engine.speculator.enabled = on
    before = llm.engine.stats.num_spec_accepted_tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.engine.stats.num_spec_accepted_tokens - before


@pytest.fixture(scope="module")
def smol(llm):
    """The session's fp32 engine on the embedded model, speculating for this module (the
    LLM(speculative_config=...) path itself is the tiny model's below)."""
    from servelm.spec.speculator import Speculator

    eng = llm.engine
    eng.speculator = Speculator(SpeculativeConfig(**NGRAM), 1e9,
                                eng.config.scheduler.max_num_batched_tokens)
    yield llm
    eng.speculator = None


def _chat_ids(llm, conv):
    tok = llm.get_tokenizer()
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True),
                                           add_special_tokens=False)}


def test_greedy_is_unchanged_by_speculation_embedded(smol):
    prompts = [_chat_ids(smol, EDIT), _chat_ids(smol, REPEAT)]
    plain, _ = _run(smol, False, prompts, GREEDY)
    spec, accepted = _run(smol, True, prompts, GREEDY)
    assert accepted > 0  # drafts were accepted, several tokens a step
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text


def test_stops_and_max_tokens_cut_inside_an_accepted_run(smol):
    prompt = [_chat_ids(smol, REPEAT)]
    (full,), _ = _run(smol, False, prompt, SamplingParams(temperature=0, max_tokens=20))
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    assert len(ids) == 20
    stop = text[len(text) // 2:len(text) // 2 + 4]
    first = ids.index(ids[13])
    cases = [(SamplingParams(temperature=0, max_tokens=9), ids[:9], "length", None),
             (SamplingParams(temperature=0, max_tokens=20, stop=[stop]), None, "stop", stop),
             (SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[13]]),
              ids[:first + 1], "stop", ids[13])]
    for params, want_ids, reason, stop_reason in cases:
        (b,), accepted = _run(smol, True, prompt, params)
        assert accepted > 0
        o = b.outputs[0]
        assert (o.finish_reason, o.stop_reason) == (reason, stop_reason)
        if want_ids is None:  # a stop string: the text cut just before it, exactly
            assert o.text == text[:text.index(stop)]
            assert o.token_ids == ids[:len(o.token_ids)]
        else:
            assert o.token_ids == want_ids


def test_logprobs_are_the_targets_and_streaming_deltas_add_up(smol):
    prompt = _chat_ids(smol, REPEAT)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    (a,), _ = _run(smol, False, [prompt], params)
    smol.engine.speculator.enabled = True
    eng = smol.engine
    rid = eng.add_request(None, None, params, prompt_token_ids=prompt["prompt_token_ids"])
    deltas, sizes = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid:
                deltas.append(out.outputs[0].delta_text)
                sizes.append(len(out.outputs[0].delta_token_ids))
                b = out
    assert max(sizes) > 1  # several tokens in one delta
    assert "".join(deltas) == b.outputs[0].text == a.outputs[0].text
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert y.token_id == x.token_id and y.rank == x.rank
        assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
        assert [t for t, _ in y.top] == [t for t, _ in x.top]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, hf_tokenizer):
    """A tiny random Llama (2 layers, hidden 64, tied embeddings) with the embedded model's
    tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=hf_tokenizer.vocab_size, hidden_size=64,
                                   intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Tied embeddings favour repeating the last token; stronger layer outputs break the
    # runs now and then: drafts get accepted and rejected both.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(100.0)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    hf_tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """LLM(speculative_config=...) on the tiny model: the C++ kernel path and the eager one;
    a 64-token budget, so a long prompt is prefilled in chunks while others speculate."""
    kw = dict(model=tiny_dir, dtype="float32", kernel_tuning="off", kv_cache_memory=8 << 20,
              max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8)
    return {True: _spec_llm(**kw), False: _spec_llm(cpu_kernels=False, **kw)}


TINY_PROMPTS = [{"prompt_token_ids": [5 + (i * 7) % 23 for i in range(40)]},
                {"prompt_token_ids": list(range(300, 340)) * 2},
                {"prompt_token_ids": [9, 9, 9, 9, 9, 9]}]


# A greedy token may differ between a one-row decode and a (k + 1)-row verification chunk
# only where the two most likely tokens were this close (fp32 rounding in attention and
# matmuls differs with the row count; the tiny model's x100 output layers make its logits
# large, so its rounding differences are too).
NEAR_TIE = 2e-3


def _assert_greedy_equal(plain, spec):
    """spec's greedy tokens equal plain's (asked with logprobs=2), up to a float near-tie:
    at the first difference both tokens are plain's top two, their logprobs within
    NEAR_TIE; the sequences may part from there."""
    a, b = plain.outputs[0], spec.outputs[0]
    assert len(a.token_ids) == len(b.token_ids)
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            top = dict(a.logprobs[i].top)
            assert x in top and y in top and abs(top[x] - top[y]) < NEAR_TIE, (
                f"token {i}: {y} instead of {x}, plain's top two {a.logprobs[i].top}")
            return


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_greedy_is_unchanged_by_speculation_tiny(tiny, cpu_kernels):
    llm = tiny[cpu_kernels]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    plain, _ = _run(llm, False, TINY_PROMPTS, params)
    before = llm.engine.stats.num_spec_draft_tokens
    spec, accepted = _run(llm, True, TINY_PROMPTS, params)
    assert llm.engine.stats.num_spec_draft_tokens > before
    assert accepted > 0
    for a, b in zip(plain, spec):
        _assert_greedy_equal(a, b)


def test_mixed_batch_chunked_prefill_n_and_seeds(tiny):
    """Speculating greedy requests next to sampling ones (n = 2, seeded), a long prompt
    prefilled in chunks, and prefix-cache hits (the same prompts as the plain run)."""
    llm = tiny[True]
    prompts = TINY_PROMPTS + [{"prompt_token_ids": list(range(1000, 1200))}, TINY_PROMPTS[1]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=1.0, top_k=50, n=2, seed=7, max_tokens=16,
                             ignore_eos=True)
    params = [greedy, greedy, greedy, SamplingParams(temperature=0, max_tokens=6, logprobs=2),
              sampled]
    plain, _ = _run(llm, False, prompts, params)
    spec, accepted = _run(llm, True, prompts, params)
    assert accepted > 0
    for a, b in zip(plain[:4], spec[:4]):
        _assert_greedy_equal(a, b)
    again, _ = _run(llm, True, prompts, params)  # seeded sampling: reproducible
    assert [o.token_ids for o in again[4].outputs] == [o.token_ids for o in spec[4].outputs]
    assert spec[4].outputs[0].token_ids != spec[4].outputs[1].token_ids
    assert all(len(o.token_ids) == 16 for o in spec[4].outputs)
    bm = llm.engine.block_manager
    assert bm.owners() == {} and bm.num_free_blocks == bm.num_blocks
