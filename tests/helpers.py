"""Test helpers that drive the model runner directly, below the scheduler."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from servelm.attention import get_backend
from servelm.engine.model_runner import KVCache, SeqInput


@functools.lru_cache(maxsize=1)
def network_namespaces() -> str | None:
    """None where this process can make network namespaces (tests/test_netns.py's hosts),
    else why not."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "no iproute2 (ip) or unshare"
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        return "this sandbox does not let a process make a network namespace"
    return None


def run_seqs(engine, seqs: list[tuple[list[int], int, str]]) -> torch.Tensor:
    """Run (token_ids, start_pos, owner_id) sequences in one forward; logits in input order.

    Blocks come from the engine's own block manager under owner_id, so a sequence can
    continue in a later call; release them with release().
    """
    bm = engine.block_manager
    inputs = []
    for ids, start, owner in seqs:
        bm.allocate(owner, start + len(ids))
        inputs.append(SeqInput(ids, start, bm.block_table(owner), True,
                               state_slot=bm.state_slot(owner),
                               group_tables=bm.group_tables(owner)))
    logits, rows = engine.executor.execute(inputs)
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    return logits[order]


@contextmanager
def runner_path(runner, kernels: bool = False, attention: str | None = None):
    """Within: the runner's steps on servelm's C++ kernels (fused ops, the cpu attention
    backend) or, kernels False, the eager reference (PyTorch ops, reference attention);
    `attention` names another backend. The path it had is restored after."""
    saved = runner.use_kernels, runner.attention
    runner.use_kernels = kernels
    runner.attention = get_backend(attention or ("cpu" if kernels else "reference"))
    try:
        yield runner
    finally:
        runner.use_kernels, runner.attention = saved


def method_targets(module: torch.nn.Module, names: tuple[str, ...], method: str = "tiles",
                   act: torch.dtype = torch.bfloat16) -> int:
    """Swap the loaded linear children called `names` (anywhere below module: an nn.Linear
    or a quantised layer) that `method` runs with activations of dtype `act` for the module
    it builds (linear_methods.build); returns how many were swapped."""
    from servelm.layers import linear_methods as lm
    from servelm.quantization import QuantLinear, TiledLinear

    swaps = [(parent, name, child) for parent in module.modules()
             for name, child in parent.named_children()
             if name in names and (type(child) is torch.nn.Linear
                                   or (isinstance(child, QuantLinear)
                                       and not isinstance(child, TiledLinear)))
             and lm.applies(method, child, act, True)]
    for parent, name, child in swaps:
        setattr(parent, name, lm.build(method, child, act))
    return len(swaps)


def release(engine, *owners: str) -> None:
    for o in owners:
        engine.block_manager.free(o)


def prompt_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits after each whole prompt, all prompts in one batch."""
    owners = [f"probe-{i}" for i in range(len(prompts))]
    try:
        return run_seqs(engine, [(p, 0, o) for p, o in zip(prompts, owners)])
    finally:
        release(engine, *owners)


def script_usage_error(script: str, *args: str, capsys) -> tuple[int, str]:
    """Run benchmarks/<script>'s main() in this process with argv `args` (a usage error is
    expected, raised before anything loads): (exit code, stderr). No subprocess, so no
    interpreter and torch start-up per call; an unexpected exception fails the test."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        module.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    else:
        code = 0
    finally:
        sys.argv = argv
    return code, capsys.readouterr().err


def assert_reference_greedy(ref, ids: list[int], got: list[int], banned=()) -> None:
    """`got` is the greedy continuation of `ids` by transformers' model `ref`: in one forward
    over ids + got, ref's argmax (tokens `banned`, e.g. EOS under min_tokens, excluded) at
    every position is our next token. The same test as comparing with its generate(), token
    for token, at a fraction of the cost. A divergence names the token and ref's top-2 gap."""
    import pytest

    with torch.no_grad():
        logits = ref(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1:]
    logits[:, list(banned)] = float("-inf")
    want = logits.argmax(-1).tolist()
    if got != want:
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = logits[k].topk(2).values
        pytest.fail(f"diverged at token {k} of {ids[:6]}...: ours {got[k]}, reference "
                    f"{want[k]}; reference top-2 logit gap there {float(top2[0] - top2[1]):.2e}")



def assert_last_logits_match(engine, ref, prompts: list[list[int]]) -> list[tuple]:
    """Each token-id prompt's last logits from `engine` within 1e-3 of transformers' model
    `ref`'s (relative to their largest); returns (ours, ref's) per prompt."""
    ours = prompt_logits(engine, prompts)
    pairs = []
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1].float()
        diff = (ours[i] - want).abs().max().item()
        assert diff <= 1e-3 * want.abs().max().item(), f"prompt {i}: max |diff| {diff}"
        pairs.append((ours[i], want))
    return pairs


def assert_matches_reference(llm, ref, prompts: list[list[int]], greedy) -> None:
    """An engine (`llm`) against transformers' model `ref` on token-id prompts: each prompt's
    last logits within 1e-3 of ref's (relative to their largest), then the greedy
    continuations (`greedy`: SamplingParams, temperature 0) ref's own (EOS banned)."""
    assert_last_logits_match(llm.engine, ref, prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == greedy.max_tokens
        assert_reference_greedy(ref, ids, out.outputs[0].token_ids,
                                banned=(ref.config.eos_token_id,))


def assert_chunks_cache_and_preemption_keep_tokens(path: str, prompts: list[str], greedy,
                                                   tight_memory=None, tight_rounds: int = 1,
                                                   **kw):
    """A model's greedy tokens (engine options kw) through a 16-token budget (every prompt
    prefilled in chunks), a second round from the prefix cache (16 tokens or more cached),
    then a pool that preempts: the eager path's (C++ ops off) each time. The tight pool
    holds 5 blocks, or tight_memory(the chunked engine's executor) bytes, for tight_rounds
    rounds. Returns the chunked and the tight engines (LLMs), for further checks."""
    from servelm import LLM

    eager = LLM(model=path, **{**kw, "cpu_kernels": False})
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
    fast = LLM(model=path, max_num_batched_tokens=16, max_num_seqs=4, **kw)
    for round_ in range(2):
        outs = fast.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, round_
    assert all(o.metrics.num_cached_tokens >= 16 for o in outs)
    ex = fast.engine.executor
    memory = tight_memory(ex) if tight_memory is not None else 5 * ex.block_bytes
    if ex.kv_groups is not None and tight_memory is None:
        # A hybrid model's pool in block groups holds these short prompts' windows without
        # preempting: the tight pool is one table of blocks (test_hybrid_kv preempts groups).
        memory = 5 * KVCache.bytes_per_block(ex.model.config, kw.get("block_size", 16),
                                             ex.kv_cache.dtype)
        kw = {**kw, "hybrid_kv_cache": False}
    tight = LLM(model=path, **{**kw, "kv_cache_memory": memory}, admission_lookahead=0)
    for round_ in range(tight_rounds):
        outs = tight.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, round_
    assert tight.engine.scheduler.num_preemptions > 0
    return fast, tight


def assert_prefix_travels_between_engines(kw: dict, prompt: str, greedy) -> None:
    """Disaggregated prefill between two engines of options kw (a pool in block groups):
    the sender's cached prefix of the prompt (its blocks and each windowed group's pages
    in reach of its end, fewer than a page of every group a block) imported by the
    receiver, whose request then computes only the tokens past it and gives the sender's
    greedy tokens."""
    from servelm import LLM

    send, recv = LLM(**kw), LLM(**kw)
    ids = send.get_tokenizer().encode(prompt)
    want = send.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
    assert send.engine.kv_layout() == recv.engine.kv_layout()
    bm, kv = recv.engine.block_manager, recv.engine.executor.kv_cache
    n, data = send.engine.export_prefix(ids)
    blocks = n // bm.block_size
    assert bm.groups and n >= len(ids) - 2 * bm.block_size
    assert blocks < bm.prefix_rows(blocks) < (1 + len(bm.groups)) * blocks
    assert data.numel() == bm.prefix_rows(blocks) * kv.block_bytes
    assert recv.engine.import_prefix(ids[:n], None, data) == n
    assert bm.owners() == {}
    before = recv.engine.stats.num_prefill_tokens
    got = recv.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
    assert got.metrics.num_cached_tokens == n
    assert recv.engine.stats.num_prefill_tokens - before == len(ids) - n
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def assert_tensor_parallel_matches(kw: dict, prompts: list[str], greedy=None) -> None:
    """An engine of options kw (num_threads 1: each rank gets one thread either way, and
    beside the suite's other worker a second one for the single-device engine only
    contends) under tensor_parallel_size=2 against one
    device: the prompts' last logits within 1e-4, and with `greedy` (SamplingParams) the same
    tokens. The ranks are shut down and the test process's threads restored after."""
    from servelm import LLM

    one = LLM(**kw)
    ids = [one.get_tokenizer().encode(p) for p in prompts]
    want = prompt_logits(one.engine, ids)
    tokens = ([o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
              if greedy is not None else None)
    threads = torch.get_num_threads()
    two = LLM(tensor_parallel_size=2, **kw)
    try:
        got = prompt_logits(two.engine, ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        if greedy is not None:
            outs = two.generate(prompts, greedy, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == tokens
    finally:
        two.engine.shutdown()
        torch.set_num_threads(threads)  # rank 0 took its share of the threads


def hf_from_gguf(path: str, tmp_dir):
    """transformers' model from a GGUF, dequantised to fp32: the numerical reference. Read
    from a copy with the same tensors and model metadata but no vocabulary arrays (the
    reference is fed token ids; gguf-py's parse of a 50k-150k-token vocabulary is most of
    transformers' load time, twice over)."""
    from pathlib import Path

    import gguf
    import numpy as np
    import transformers

    from servelm.models.gguf_file import GGUFReader

    reader = GGUFReader(path)
    arch = reader.metadata["general.architecture"]
    copy = Path(tmp_dir) / "weights-only.gguf"
    w = gguf.GGUFWriter(str(copy), arch)
    # Not the vocabulary arrays; general.architecture is the writer's own.
    add_gguf_metadata(w, {k: v for k, v in reader.metadata.items()
                          if k != "general.architecture" and not isinstance(v, list)})
    w.add_uint32(f"{arch}.vocab_size", len(reader.metadata["tokenizer.ggml.tokens"]))
    for t in reader.tensors:
        if t.data.dtype == np.uint8:  # quantised blocks, as they are
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=gguf.GGMLQuantizationType(t.qtype))
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # transformers maps, permutes and loads the tensors itself; only the block decoding is
    # servelm's torch dequantisation, which test_gguf_file.py proves bit for bit gguf-py's
    # (gguf-py's numpy K-quant decoding was 25 s of the 0.5B model's load here).
    from servelm.models import dequant

    real = gguf.dequantize

    def fast(data, qtype):
        qtype = gguf.GGMLQuantizationType(qtype)
        data = np.asarray(data)
        if data.dtype == np.uint8 and qtype in gguf.GGML_QUANT_SIZES:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            out = dequant.dequantize(data, qtype.name)
            if out is not None:
                return out.numpy().reshape(*data.shape[:-1], data.shape[-1] // size * block)
        return real(data, qtype)

    # transformers builds gguf-py's name map (thousands of formatted names) once per tensor:
    # 7 s of the 0.5B model's load; it is a pure function of (architecture, layers).
    real_map = gguf.get_tensor_name_map
    gguf.dequantize, gguf.get_tensor_name_map = fast, functools.lru_cache(None)(real_map)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(copy.parent), gguf_file=copy.name, dtype=torch.float32)
    finally:
        gguf.dequantize, gguf.get_tensor_name_map = real, real_map
    return model.eval()


def hf_tokenizer_from_gguf(path: str, cls: str = "TokenizersBackend"):
    """transformers' tokenizer for a GGUF, built by its own GGUF tokenizer conversion. Named
    by class (the one AutoTokenizer picks for the file): AutoTokenizer first reads the whole
    file through gguf-py to find the class, 10-40 s here, the conversion itself 1-6 s."""
    import os

    import transformers

    d, f = os.path.split(path)
    return getattr(transformers, cls).from_pretrained(d, gguf_file=f)


def gguf_tokenizer_metadata(path: str) -> dict:
    """A GGUF file's tokenizer keys (its chat template left out), as servelm's reader gives
    them: what a test's own GGUF (add_gguf_metadata) takes to carry the same tokenizer."""
    from servelm.models.gguf_file import GGUFReader

    return {k: v for k, v in GGUFReader(path).metadata.items()
            if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}


def add_gguf_metadata(writer, meta: dict) -> None:
    """Write GGUF key/values (as servelm's reader returns them) with a gguf.GGUFWriter."""
    for key, value in meta.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)


def real_model(name: str) -> str:
    """The path of a model scripts/fetch_models.py fetches (`make test` fetches what the
    suite needs); the test skips, saying how to fetch it, where it is absent."""
    import importlib.util
    from pathlib import Path

    import pytest

    spec = importlib.util.spec_from_file_location(
        "fetch_models", Path(__file__).parents[1] / "scripts" / "fetch_models.py")
    fetch_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_models)
    path = fetch_models.model_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not fetched: python scripts/fetch_models.py {name}")
    return str(path)


def generate_with_and_without_the_stack(llm, prompts: list[list[int]], sp):
    """The engine's outputs for `prompts` (token ids) with its DecodeStacks, counting the rows
    of each stack call, then op by op (fused_decode off): (fused, per_op, rows per call)."""
    model = llm.engine.executor.model
    real, calls = model._decode_stacks, []

    class Counting:  # a stack, counting its calls (run_tokens: whole steps from token ids)
        def __init__(self, stack):
            self.stack = stack

        def run(self, *a):
            calls.append(a[0].shape[0])
            return self.stack.run(*a)

        def run_rotary(self, *a):
            calls.append(a[0].shape[0])
            return self.stack.run_rotary(*a)

        def run_tokens(self, *a):
            calls.append(a[0].shape[0])
            return self.stack.run_tokens(*a)

        def run_lists(self, *a):
            calls.append(len(a[0]))
            return self.stack.run_lists(*a)

        def set_lora_rows(self, *a):
            return self.stack.set_lora_rows(*a)

        def set_state_rows(self, *a):
            return self.stack.set_state_rows(*a)

        def set_per_layer_inputs(self, *a):
            return self.stack.set_per_layer_inputs(*a)

    requests = [{"prompt_token_ids": p} for p in prompts]
    try:
        model._decode_stacks = [(lo, hi, Counting(st)) for lo, hi, st in real]
        fused = llm.generate(requests, sp, use_tqdm=False)
        model.fused_decode = False
        per_op = llm.generate(requests, sp, use_tqdm=False)
    finally:
        model._decode_stacks, model.fused_decode = real, True
    return fused, per_op, calls


def assert_stack_decodes_as_per_op(llm, prompts: list[list[int]], sp) -> None:
    """Every prompt's decode steps went through a DecodeStack, and its tokens and logprobs
    are the per-op path's exactly."""
    fused, per_op, calls = generate_with_and_without_the_stack(llm, prompts, sp)
    assert len(prompts) in calls  # decode steps of all of them went through the stack
    for a, b in zip(fused, per_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def decode_rows(cfg, lens: list[int], block_size: int = 16, seed: int = 1):
    """Decode rows whose contexts (after this token) have the given lengths, per-layer bf16
    KV pools of random keys / values in scattered blocks, and the batch the model runner
    would build for the cpu backend: (batch, the pools' one tensor, per-layer (k, v))."""
    from servelm.engine.model_runner import build_forward_batch

    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    if cfg.layer_head_dims or cfg.layer_kv_heads or cfg.kv_source_layers:
        # Layers of their own shapes, KV-shared ones their source's (the runner's KVCache).
        from servelm.engine.model_runner import KVCache

        kv = KVCache(cfg, num_blocks, block_size, torch.bfloat16, torch.device("cpu"))
        data, caches = kv.data, [tuple(entry[:2]) for entry in kv.layers]
        data.copy_(torch.randn(data.shape, generator=g))
    else:
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        data = torch.randn(shape, generator=g).bfloat16()
        caches = [(data[i, 0], data[i, 1]) for i in range(cfg.num_layers)]
    perm = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()
    seqs, at = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        seqs.append(SeqInput([7 + i], n - 1, perm[at:at + nb]))
        at += nb
    batch, _ = build_forward_batch(seqs, block_size, cfg.num_heads // cfg.num_kv_heads,
                                   torch.device("cpu"), "cpu")
    return batch, data, caches


def per_op_and_stack(model, batch, data, caches):
    """[(hidden, KV pool)] from the per-op kernel path, then from the DecodeStack, each from
    the same pools (the model's ops selected onto the C++ kernels first)."""
    model.select_ops(True)
    assert model.bind_decode_layers(caches)
    results = []
    for fused in (False, True):
        saved = data.clone()
        model.fused_decode = fused
        with torch.inference_mode():
            hidden = model(batch, caches)
        results.append((hidden, data.clone()))
        data.copy_(saved)
    return results


def random_bf16_model(cfg, seed: int = 0):
    """servelm's decoder for cfg with random weights (norms near 1, the rest ~0.2), in bf16."""
    from servelm.models.decoder import CausalLM

    torch.manual_seed(seed)
    model = CausalLM(cfg, max_positions=cfg.max_position_embeddings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    return model.to(torch.bfloat16)


# Gemma 4's layers as ModelConfig fields (with a 64-wide, 4-head base of 256 tokens): global
# layers of their own head size and KV heads (the third with values from its keys'
# projection, the last reading its KV cache), a window of 24, weightless v norms, per-layer
# inputs, layer scalars, the last two layers KV-shared with double-wide MLPs.
GEMMA4_LAYERS = dict(
    architecture="Gemma4ForCausalLM", family="gemma4", num_layers=6, qk_norm=True,
    sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=8.0, attn_scale=1.0,
    sliding_window=24, layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2,
    rope_theta=1e4, rope_local_theta=1e4,
    rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4},
    layer_head_dims=(16, 16, 32, 16, 16, 32), layer_kv_heads=(2, 2, 1, 2, 2, 1),
    kv_source_layers=(0, 1, 2, 3, 3, 2),
    extra=dict(v_norm=True, layer_scalar=True, k_eq_v_layers=(2, 5),
               intermediate_sizes=(96, 96, 96, 96, 192, 192), per_layer_input_size=16,
               per_layer_vocab_size=256))


def gemma4_scales_off_one(model) -> None:
    """A transformers Gemma 4's layer scalars (buffers) and its routers' scales moved off
    their init of 1, so that each shows."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.6, 1.4)
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.3)


# The shape of the tiny random HF checkpoints the family tests make.
TINY_HF_CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)


# The prompts and engine options the tiny families' checkpoints are tested with (fp32,
# untuned, a small pool): a long factual sentence, code and a number sequence.
TINY_PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the "
                "capital of Italy is",
                "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
                "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233,"]
TINY_KW = dict(dtype="float32", kernel_tuning="off", kv_cache_memory=16 << 20, max_model_len=256)


def tiny_hf_checkpoint(directory, config_cls: str, model_cls: str, extra: dict, tokenizer,
                       seed: int):
    """A tiny random transformers checkpoint of one family (its config and model class
    names, TINY_HF_CONFIG updated by extra) saved with the tokenizer in directory: norms
    perturbed off their init so a wrong norm convention shows, embeddings scaled to the
    usual magnitude. Returns the transformers model."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(vocab_size=tokenizer.vocab_size,
                                            **{**TINY_HF_CONFIG, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "embed" in name:
                p.mul_(0.5 / max(cfg.initializer_range, 1e-3) * 0.02)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def assert_multimodal_checkpoint_serves_its_text_model(src: str, dst, architecture: str,
                                                       model_type: str, rename, towers: list[str],
                                                       kw: dict, prompts: list[str]) -> None:
    """A multimodal checkpoint made from the text checkpoint `src` in directory `dst`: the
    text config under text_config (architectures [architecture]), each tensor under the name
    rename(name) gives, the `towers` tensors (vision, audio, MTP...) beside them. It loads as
    `architecture` and its prompts' logits equal the text checkpoint's bit for bit (engine
    options kw, C++ ops off)."""
    import json

    from safetensors.torch import load_file, save_file

    from servelm import LLM

    tensors = {rename(k): v for k, v in load_file(f"{src}/model.safetensors").items()}
    tensors.update({name: torch.zeros(8, 8) for name in towers})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads(open(f"{src}/config.json").read())
    (dst / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type,
        "text_config": text, "vision_config": {"hidden_size": 8}}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_text(open(f"{src}/{f}").read())
    kw = {**kw, "cpu_kernels": False}
    mm, plain = LLM(model=str(dst), **kw), LLM(model=src, **kw)
    assert mm.engine.model_config.architecture == architecture
    ids = [plain.get_tokenizer().encode(p) for p in prompts]
    assert torch.equal(prompt_logits(mm.engine, ids), prompt_logits(plain.engine, ids))


def random_lora_stacks(S, parts, K, R, dtype, ranks, g):
    """lora_a [S, J*R, K], lora_b [S, ceil(R/2), N, 2] of random adapters, slot s of rank
    ranks[s] (its later rows of A and ranks of B zero)."""
    J, N = len(parts), sum(parts)
    a = torch.randn(S, J * R, K, generator=g) * 0.2
    b = torch.randn(S, R + R % 2, N, generator=g) * 0.2  # rank-major, paired below
    for s, r in enumerate(ranks):
        for j in range(J):
            a[s, j * R + r:(j + 1) * R] = 0
        b[s, r:] = 0
    b = b.view(S, -1, 2, N).transpose(2, 3).contiguous()
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p)
    return a.to(dtype), b.to(dtype), bounds
