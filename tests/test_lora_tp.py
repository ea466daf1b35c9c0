"""LoRA under tensor parallelism: TP=2 gives the tokens TP=1 gives, with adapters made
resident on every rank (each its shard) and a batch that mixes adapters and the base."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_hf_checkpoint
from servelm import LLM, LoRARequest, SamplingParams
from test_lora import FAMILIES, make_adapter

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KW = dict(dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20, max_model_len=256,
          enable_lora=True, max_loras=1, max_lora_rank=8, num_threads=2)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"]


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("family", ["llama", "starcoder2"] + [
    f for f in ("gemma4", "qwen3_5", "qwen3_next") if f in FAMILIES])
def test_tp2_with_adapters_equals_tp1(tmp_path_factory, hf_tokenizer, family):
    """Llama; Starcoder2 (c_fc by rows, c_proj by columns); Gemma 4, whose layers each split by their own shape (the global layers' one
    K=V head on both ranks, the KV-shared layers' q alone, the double-wide MLPs); Qwen3.5
    and Qwen3-Next, whose q_proj adapter splits into the queries' and the output gate's
    rows and whose DeltaNet adapters split by key heads and their value heads."""
    d = tmp_path_factory.mktemp("tp-base")
    config_cls, model_cls, extra, targets = FAMILIES[family]
    base = tiny_hf_checkpoint(d, config_cls, model_cls, extra, hf_tokenizer, seed=3)
    loras = []
    for j in range(2):
        ad = tmp_path_factory.mktemp(f"tp-lora-{j}")
        make_adapter(base, ad, targets, seed=40 + j)
        loras.append(LoRARequest(f"t{j}", j + 1, str(ad)))
    # max_loras 1: the second adapter evicts the first, so ranks rewrite a slot mid-run.
    mixed = [loras[0], None, loras[1], loras[1], loras[0]]
    prompts = PROMPTS + PROMPTS[:2]
    got = {}
    for tp in (1, 2):
        llm = LLM(model=str(d), tensor_parallel_size=tp, **KW)
        try:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=mixed)
            got[tp] = [o.outputs[0].token_ids for o in outs]
            if tp == 1:
                base_out = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    assert got[2] == got[1]
    assert got[1][0] != base_out[0] and got[1][2] != base_out[2]  # the adapters did act
    assert got[1][1] == base_out[1]
