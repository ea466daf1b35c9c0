"""Speculative decoding with a draft model (servelm.spec.draft_model): the embedded SmolLM2
drafting for itself (every draft accepted), a tiny random draft with its vocabulary (almost
none accepted), both giving plain greedy decoding's tokens; a mixed batch with plain and
sampled requests, stop strings, logprobs, aborts and preemptions, after which both KV pools
are free; the errors for a draft that cannot serve (vocabulary, tokenizer, path)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import SpeculativeConfig
from servelm.models.loader import default_model_path
from servelm.sampling_params import SamplingParams

K = 4


@pytest.fixture(scope="module")
def self_draft():
    """LLM(speculative_config=draft_model) on the embedded model, drafting for itself; a
    small KV pool (8 blocks, 128 tokens, per model) and a 64-token budget: long prompts are
    prefilled in chunks and growing requests preempt each other."""
    from servelm import LLM

    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32
    llm = LLM(dtype="float32", kernel_tuning="off", kv_cache_memory=8 * 2 * block_bytes,
              max_num_batched_tokens=64, max_num_seqs=8, admission_lookahead=0,
              speculative_config={"method": "draft_model", "model": default_model_path(),
                                  "num_speculative_tokens": K})
    assert llm.engine.block_manager.num_blocks == 8  # target and draft share the budget
    assert llm.engine.speculator.proposer.block_manager.num_blocks == 8
    # The executor sized one budget for both pools and handed the speculator its draft.
    assert llm.engine.executor.block_bytes == 2 * block_bytes
    assert llm.engine.executor.draft is llm.engine.speculator.proposer
    sp = llm.engine.speculator
    # Whatever this machine measured: speculate every step (a self-draft costs as much as
    # the target, so the roofline alone would never speculate with it).
    sp.ridge_tokens, sp.draft_cost = 1e9, 0.0
    return llm


def _write_tiny_draft(d, tokenizer, vocab_size: int) -> str:
    """A random 2-layer Llama (hidden 64, tied embeddings) as a Hugging Face directory, with
    the embedded model's tokenizer."""
    from safetensors.torch import save_file

    h, inter, layers = 64, 96, 2
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "vocab_size": vocab_size, "hidden_size": h, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.5

    state = {"model.embed_tokens.weight": w(vocab_size, h), "model.norm.weight": torch.ones(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(h),
                      p + "post_attention_layernorm.weight": torch.ones(h),
                      p + "self_attn.q_proj.weight": w(h, h),
                      p + "self_attn.k_proj.weight": w(h // 2, h),
                      p + "self_attn.v_proj.weight": w(h // 2, h),
                      p + "self_attn.o_proj.weight": w(h, h),
                      p + "mlp.gate_proj.weight": w(inter, h),
                      p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter)})
    d.mkdir(parents=True, exist_ok=True)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    tokenizer._backend.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(scope="module")
def tiny_draft(self_draft, tmp_path_factory):
    """A DraftModelProposer on a tiny random model with the target's vocabulary, its pool
    allocated as the engine allocates the self-draft's."""
    from servelm.spec.draft_model import DraftModelProposer

    eng = self_draft.engine
    path = _write_tiny_draft(tmp_path_factory.mktemp("tiny-draft"), eng.tokenizer,
                             eng.model_config.vocab_size)
    p = DraftModelProposer(SpeculativeConfig(method="draft_model", model=path,
                                             num_speculative_tokens=K),
                           eng.model_config, eng.tokenizer, eng.dtype, eng.device,
                           eng.max_model_len, kernels=eng.config.kernels)
    p.allocate(eng.block_manager.num_blocks, eng.block_manager.block_size, eng.kv_dtype,
               enable_caching=True)
    return p


def _chat_ids(llm, text: str) -> dict:
    tok = llm.get_tokenizer()
    return {"prompt_token_ids": tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
        add_special_tokens=False)}


PROMPTS = ["Repeat this text exactly: The quick brown fox jumps over the lazy dog.",
           "What is the capital of France?"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _run(llm, on: bool, prompts, params):
    """Outputs with speculation on or off (the same engine); drafts and accepted drafts."""
    st = llm.engine.stats
    llm.engine.speculator.enabled = on
    d0, a0 = st.num_spec_draft_tokens, st.num_spec_accepted_tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, st.num_spec_draft_tokens - d0, st.num_spec_accepted_tokens - a0


def _assert_pools_free(eng, draft=None):
    draft = draft or eng.speculator.proposer
    for bm in (eng.block_manager, draft.block_manager):
        assert bm.owners() == {} and bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def plain(self_draft):
    """PROMPTS' greedy outputs without speculation (the reference of both drafts)."""
    prompts = [_chat_ids(self_draft, p) for p in PROMPTS]
    return prompts, _run(self_draft, False, prompts, GREEDY)[0]


def test_self_draft_gives_plain_greedy_and_accepts_everything(self_draft, plain):
    eng = self_draft.engine
    assert eng.speculator.proposer.kv_cache is not eng.executor.kv_cache  # a pool of its own
    prompts, plain = plain
    spec, drafted, accepted = _run(self_draft, True, prompts, GREEDY)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
    assert drafted >= 8 and accepted / drafted > 0.9  # the same model: ~100% (float ties)
    # The same counters /metrics and `servelm bench` read.
    assert eng.stats.spec_acceptance_rate > 0.9
    _assert_pools_free(eng)


def test_random_draft_rejected_yet_greedy_unchanged(self_draft, tiny_draft, plain):
    eng = self_draft.engine
    own = eng.speculator.proposer
    eng.speculator.proposer = tiny_draft
    prompts, plain = plain
    try:
        spec, drafted, accepted = _run(self_draft, True, prompts, GREEDY)
        for a, b in zip(plain, spec):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert drafted > 0 and accepted / drafted < 0.5  # low acceptance: rolled back often
        _assert_pools_free(eng, tiny_draft)
    finally:
        eng.speculator.proposer = own


def test_mixed_batch_stops_logprobs_preemption_abort_no_leak(self_draft):
    """Speculating greedy requests beside sampled ones (n = 2), a stop string, logprobs and
    prompts prefilled in chunks, in a pool too small for them: the two 40-token prompts
    growing by 30 tokens each need 10 of the 8 blocks, so one is preempted. Then an abort
    mid-run. Afterwards every block of both pools is free."""
    llm, eng = self_draft, self_draft.engine
    prompts = [{"prompt_token_ids": list(range(1000, 1040))},  # chunked (budget 64)
               {"prompt_token_ids": list(range(2000, 2040))},
               _chat_ids(llm, PROMPTS[1]), _chat_ids(llm, PROMPTS[0])]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1), greedy,
              SamplingParams(temperature=0, max_tokens=16, stop=[" France"]),
              SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=8, ignore_eos=True)]
    plain, _, _ = _run(llm, False, prompts, params)
    pre0 = eng.scheduler.num_preemptions
    spec, drafted, accepted = _run(llm, True, prompts, params)
    assert drafted > 0 and accepted > 0
    assert eng.scheduler.num_preemptions > pre0
    for a, b in zip(plain[:3], spec[:3]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    assert spec[2].outputs[0].finish_reason == "stop"  # cut at " France"
    for x, y in zip(plain[0].outputs[0].logprobs, spec[0].outputs[0].logprobs, strict=True):
        assert y.token_id == x.token_id
        assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
    assert all(len(o.token_ids) == 8 for o in spec[3].outputs)
    _assert_pools_free(eng)

    # An abort while both pools hold the request's blocks.
    eng.speculator.enabled = True
    rid = eng.add_request(None, None, SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True),
                          prompt_token_ids=prompts[0]["prompt_token_ids"])
    for _ in range(3):
        eng.step()
    assert eng.speculator.proposer.block_manager.owners()  # drafting: the draft holds blocks
    assert eng.abort_request(rid)
    _assert_pools_free(eng)


def test_draft_cost_keeps_the_roofline_honest():
    """A draft as costly as the target never pays; a cheap one with good acceptance does."""
    from servelm.spec.speculator import Speculator

    class _Never:
        def propose(self, reqs, ks):
            raise AssertionError("not asked")

        def release(self, req):
            pass

    spec = SpeculativeConfig(method="draft_model", model="x.gguf", num_speculative_tokens=4)
    sp = Speculator(spec, 100.0, budget=4096, proposer=_Never(), draft_cost=1.0)
    for _ in range(300):
        sp.observe(4, 3)  # 75% acceptance
    assert sp.num_drafts(1, 0) == 0
    sp.draft_cost = 0.3
    assert 1 <= sp.num_drafts(1, 0) < 4  # each draft costs: fewer than k
    sp.draft_cost = 0.0
    assert sp.num_drafts(1, 0) == 4
    with pytest.raises(ValueError, match="proposer"):
        Speculator(spec, 100.0, budget=4096)


def _proposer(eng, path):
    from servelm.spec.draft_model import DraftModelProposer

    return DraftModelProposer(SpeculativeConfig(method="draft_model", model=str(path)),
                              eng.model_config, eng.tokenizer, eng.dtype, eng.device,
                              eng.max_model_len)


def test_a_draft_that_cannot_serve_is_a_clear_error(self_draft, tmp_path):
    eng = self_draft.engine
    other = _write_tiny_draft(tmp_path / "other-vocab", eng.tokenizer, 1000)
    with pytest.raises(ValueError, match="speculative_config model .*vocabulary of 1000"):
        _proposer(eng, other)
    renamed = _write_tiny_draft(tmp_path / "other-tokenizer", eng.tokenizer,
                                eng.model_config.vocab_size)
    tj = json.loads((tmp_path / "other-tokenizer" / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == j) for j in (500, 501))
    vocab[a], vocab[b] = 501, 500  # two tokens swap ids
    (tmp_path / "other-tokenizer" / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="speculative_config model .*another tokenizer.*500"):
        _proposer(eng, renamed)
    with pytest.raises(ValueError, match="speculative_config model: .*no such file"):
        _proposer(eng, tmp_path / "missing.gguf")


def test_draft_config_through_the_cli_and_tensor_parallel_refused(capsys):
    from servelm.cli import make_parser
    from servelm.config import EngineConfig

    args = make_parser().parse_args(["serve", "--speculative-config", json.dumps(
        {"method": "draft_model", "model": "/models/draft.gguf", "num_speculative_tokens": 3})])
    sc = args.speculative_config
    assert (sc.method, sc.model, sc.num_speculative_tokens) == ("draft_model",
                                                                "/models/draft.gguf", 3)
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": 5})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative=sc, tensor_parallel_size=2)


# ---- the draft pool's bookkeeping, on a fake draft model (no torch model) --------------------

V = 5  # a small vocabulary: drafts often equal the true tokens, often not


def _next(ctx) -> int:
    """The fake draft model's greedy token after a context."""
    return hash(tuple(ctx)) % V


class _FakeRunner:
    """Writes each token into its slot, then 'predicts' from what the slots hold for the whole
    context: a draft equals _next(true context) only if every slot read is valid."""

    def __init__(self, block_size: int):
        self.bs, self.slots = block_size, {}

    def execute(self, seqs):
        out = []
        for s in seqs:
            for j, t in enumerate(s.token_ids):
                p = s.start_pos + j
                self.slots[s.block_table[p // self.bs] * self.bs + p % self.bs] = t
            end = s.start_pos + len(s.token_ids)
            ctx = [self.slots[s.block_table[p // self.bs] * self.bs + p % self.bs]
                   for p in range(end)]
            out.append(_next(ctx))
        logits = torch.nn.functional.one_hot(torch.tensor(out), V).float()
        return logits, list(range(len(seqs)))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_draft_pool_rolls_back_and_frees(data):
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.request import Request
    from servelm.spec.draft_model import DraftModelProposer

    bs = data.draw(st.sampled_from([1, 2, 4]))
    caching = data.draw(st.booleans())
    p = DraftModelProposer.__new__(DraftModelProposer)  # the bookkeeping, without a model
    p.block_manager = BlockManager(1024, bs, enable_caching=caching)  # never full
    p.runner, p.max_len = _FakeRunner(bs), 10_000
    shared = [1, 2, 3, 4, 0, 1]  # prompts with a common start: prefix-cache hits
    reqs = [Request(f"r{i}", shared + [i % V] * data.draw(st.integers(0, 5)),
                    SamplingParams(), 100, 0.0) for i in range(data.draw(st.integers(1, 4)))]
    for _ in range(data.draw(st.integers(1, 8))):
        live = [r for r in reqs if r.request_id != "gone"]
        if not live:
            break
        ks = [data.draw(st.integers(0, 4)) for _ in live]
        drafts = p.propose(live, ks)
        for r, k, d in zip(live, ks, drafts):
            ctx = r.token_slice(0, r.num_tokens)
            want = []
            for _ in range(k):
                want.append(_next(ctx + want))
            assert d == want  # every KV slot the fake model read was valid
            # The target accepts a prefix, then emits one token of its own.
            a = data.draw(st.integers(0, len(d)))
            for t in d[:a] + [data.draw(st.integers(0, V - 1))]:
                r.append_output_token(t, 0.0)
        if data.draw(st.booleans()):  # finished, aborted or preempted
            r = data.draw(st.sampled_from(live))
            p.release(r)
            if data.draw(st.booleans()):
                r.request_id = "gone"
                r.draft_state = None
    for r in reqs:
        p.release(r)
    bm = p.block_manager
    assert bm.owners() == {} and bm.num_free_blocks == bm.num_blocks


def test_spec_ab_takes_a_draft_model_not_lookup(capsys):
    from helpers import script_usage_error

    code, err = script_usage_error("spec_ab.py", "--draft-model", "x.gguf", "--lookup", "1,3",
                                   capsys=capsys)
    assert code == 2 and "--lookup" in err
