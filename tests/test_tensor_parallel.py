"""Tensor parallelism on CPU: TP=2 and TP=3 against the TP=1 reference.

SmolLM2 has 9 query heads and 3 KV heads, so TP=2 splits heads unevenly (one KV head and
its 3 query heads on rank 0, two and 6 on rank 1) and TP=3 gives each rank one KV head.
Engines are shared per module (one spawn per tensor-parallel size); everything runs with
prefix caching on and a 32-token step budget, so prompts are prefilled in chunks.

The weights are int4 and each rank quantises its own shard: column-parallel layers (qkv,
gate_up, LM head) split output rows, with the same groups as on one device; row-parallel
ones (o, down) split inputs, and int4's groups of 32 never straddle a shard (shards are
whole heads and 768-wide MLP halves), so every rank holds TP=1's weights exactly. The layers
run in fp32 on the dequantised weights (oneDNN), so only the sharding differs from TP=1:
the same tokens, logits to summation order. (fp32 weights shard in test_families.py, for
every family.)
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from conftest import TEXT_PROMPTS
from helpers import network_namespaces, prompt_logits, release, run_seqs
from servelm import LLM, SamplingParams
from servelm.config import EngineConfig
from servelm.distributed.executor import WorkerDiedError
from servelm.distributed.sharding import ShardPlan, split_range
from servelm.engine.executor import Executor
from servelm.models.config import ModelConfig
from servelm.quantization import kernels_available
from test_server import KEY, MODEL, ROOT, Server

@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    """Rank 0 runs in this process and sets torch's thread count to its share: give the
    tests after this module their threads back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# Tuning off: these tests are about sharding; every rank then runs the same default
# methods without measuring its own shard's shapes first.
ENGINE = dict(dtype="float32", kv_cache_memory=64 << 20, num_threads=2, max_num_seqs=16,
              max_num_batched_tokens=32, kernel_tuning="off", quantization="int4",
              linear_method="onednn")
FLAGS = ["--dtype", "float32", "--kernel-tuning", "off", "--quantization", "int4",
         "--linear-method", "onednn"]  # the same, for `servelm` processes
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = ("In the beginning of the project the team wrote down what the engine must do: serve "
        "many users at once, stream tokens as they are produced, keep keys and values in a "
        "paged pool, and never recompute what it already knows. Then they")
PROMPTS = TEXT_PROMPTS[:4] + [LONG]


def smol(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                head_dim=64, max_position_embeddings=8192)
    return ModelConfig(**{**base, **kw})


# ---- the plan: who holds which heads, rows and columns --------------------------------------

@pytest.mark.parametrize("heads,kv_heads,world", [
    (9, 3, 1), (9, 3, 2), (9, 3, 3), (9, 3, 4), (9, 3, 6), (9, 3, 9),
    (32, 8, 3), (32, 8, 8), (32, 8, 16), (8, 1, 3), (12, 12, 5)])
def test_plan_covers_every_head_once_with_its_kv_head(heads, kv_heads, world):
    cfg = smol(num_heads=heads, num_kv_heads=kv_heads)
    g = heads // kv_heads
    plans = [ShardPlan.of(cfg, r, world) for r in range(world)]
    covered = [h for p in plans for h in range(*p.q_heads)]
    assert covered == list(range(heads))
    for p in plans:
        assert p.num_heads >= 1 and p.num_heads % p.num_kv_heads == 0
        # Every local query head's KV head is local, and local groups stay uniform.
        for h in range(*p.q_heads):
            assert p.kv_heads[0] <= h // g < p.kv_heads[1]
        local = p.local_config(cfg)
        assert local.num_heads == p.num_heads and local.num_kv_heads == p.num_kv_heads
    assert [i for p in plans for i in range(*p.intermediate)] == list(range(1536))
    assert [v for p in plans for v in range(*p.vocab)] == list(range(49152))


def test_plan_for_smollm2_and_what_cannot_be_split():
    cfg = smol()
    two = [ShardPlan.of(cfg, r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in two] == [((0, 3), (0, 1)), ((3, 9), (1, 3))]
    three = [ShardPlan.of(cfg, r, 3) for r in range(3)]
    assert [(p.q_heads, p.kv_heads, p.intermediate) for p in three] == [
        ((0, 3), (0, 1), (0, 512)), ((3, 6), (1, 2), (512, 1024)), ((6, 9), (2, 3), (1024, 1536))]
    p = two[1]
    assert p.slice_of("model.layers.3.self_attn.q_proj.weight") == [(0, 192, 576)]
    assert p.slice_of("model.layers.3.self_attn.k_proj.weight") == [(0, 64, 192)]
    assert p.slice_of("model.layers.3.self_attn.v_proj.bias") == [(0, 64, 192)]
    assert p.slice_of("model.layers.3.self_attn.o_proj.weight") == [(1, 192, 576)]
    assert p.slice_of("model.layers.3.mlp.up_proj.weight") == [(0, 768, 1536)]
    assert p.slice_of("model.layers.3.mlp.down_proj.weight") == [(1, 768, 1536)]
    assert p.slice_of("model.embed_tokens.weight") == [(0, 24576, 49152)]
    # Fused checkpoint tensors (Phi-3's): this rank's rows of each part, at its offset.
    assert p.slice_of("model.layers.3.self_attn.qkv_proj.weight") == [
        (0, 192, 576), (0, 576 + 64, 576 + 192), (0, 768 + 64, 768 + 192)]
    assert p.slice_of("model.layers.3.mlp.gate_up_proj.weight") == [
        (0, 768, 1536), (0, 1536 + 768, 3072)]
    assert p.slice_of("model.layers.3.input_layernorm.weight") is None
    assert p.slice_of("model.norm.weight") is None
    with pytest.raises(ValueError, match="more than the model's 9 attention heads"):
        ShardPlan.of(cfg, 0, 10)
    assert split_range(10, 3, 0) == (0, 3) and split_range(10, 3, 2) == (6, 10)


def test_bad_sizes_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="more than the model's 9 attention heads"):
        LLM(dtype="float32", kv_cache_memory=16 << 20, tensor_parallel_size=10)
    assert time.monotonic() - t0 < 30


# ---- TP=2 and TP=3 give TP=1's tokens --------------------------------------------------------

def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _run_all(llm: LLM) -> dict:
    tok = llm.get_tokenizer()
    batch = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    single = _tokens(llm.generate(PROMPTS[1], GREEDY, use_tqdm=False))
    bm = llm.engine.block_manager
    hits = bm.num_hit_tokens
    # The long prompt again, extended: its first blocks come from the prefix cache.
    prefix = _tokens(llm.generate(LONG + " said", GREEDY, use_tqdm=False))
    ids = [tok.encode(p) for p in PROMPTS]
    return dict(batch=batch, single=single, prefix=prefix, prefix_hits=bm.num_hit_tokens - hits,
                logits=prompt_logits(llm.engine, ids))


@pytest.fixture(scope="module")
def reference() -> dict:
    llm = LLM(**ENGINE)
    out = _run_all(llm)
    out["llm"] = llm
    return out


# TP=2 splits SmolLM2's 3 KV heads unevenly (1 + 2); TP=3's one-head-a-rank plan is
# covered by the ShardPlan tests above, without processes.
@pytest.fixture(scope="module", params=[2], ids=["tp2"])
def tp_results(request) -> dict:
    llm = LLM(**ENGINE, tensor_parallel_size=request.param)
    try:
        out = _run_all(llm)
        assert isinstance(llm.engine.executor, Executor)  # the engine's one interface
        assert llm.engine.executor.check_health() is None
        out["threads"] = torch.get_num_threads()
        out["tp"] = request.param
        out["llm"] = llm  # the last test to use it kills one of its workers
        yield out
    finally:
        llm.engine.shutdown()
        llm.engine.shutdown()  # idempotent


def test_greedy_tokens_identical_to_tp1(reference, tp_results):
    assert len(reference["llm"].get_tokenizer().encode(LONG)) > ENGINE["max_num_batched_tokens"]
    assert tp_results["batch"] == reference["batch"]
    assert tp_results["single"] == reference["single"]
    assert tp_results["prefix"] == reference["prefix"]
    assert tp_results["prefix_hits"] >= 32 and reference["prefix_hits"] >= 32
    assert tp_results["threads"] == max(1, ENGINE["num_threads"] // tp_results["tp"])


def test_logits_within_tolerance_of_tp1(reference, tp_results):
    ref, got = reference["logits"], tp_results["logits"]
    assert got.shape == ref.shape == (len(PROMPTS), 49152)
    err = (got - ref).abs().max().item()
    assert err <= 1e-3 * ref.abs().max().item(), err


# ---- quantised weights: each rank quantises its own shard -------------------------------------

@pytest.mark.skipif(not kernels_available(),
                    reason="needs the C++ kernels (AVX-512 BF16): no DecodeStack here")
@pytest.mark.parametrize("quantization", ["int4", None])  # None: bf16 weights in tiles
def test_bf16_tp2_runs_its_all_reduces_not_the_decode_stack(quantization):
    # With bf16 activations and int4 (or tiled bf16) weights one device runs decode steps
    # through the DecodeStack; sharded layers all-reduce their outputs, which the stack
    # would skip.
    engine = {**ENGINE, "dtype": "bfloat16", "quantization": quantization,
              "linear_method": "tiles"}

    def decode_logits(llm):  # a prompt, then one decode-only step: its logits
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        try:
            run_seqs(llm.engine, [(ids, 0, "d")])
            return run_seqs(llm.engine, [([ids[-1]], len(ids), "d")]).float()
        finally:
            release(llm.engine, "d")

    one = LLM(**engine)
    assert one.engine.executor.model.fused_decode
    want = decode_logits(one)
    del one
    two = LLM(**engine, tensor_parallel_size=2)
    try:
        assert not two.engine.executor.model.fused_decode
        got = decode_logits(two)
    finally:
        two.engine.shutdown()
    # bf16 partial sums round differently when split; a missing all-reduce would be far off.
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 0.03 and got.argmax(-1).tolist() == want.argmax(-1).tolist(), err


# ---- the server ------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as c:
        return c.read()


def _worker_pids(pid: int) -> list[int]:
    """A process's tensor-parallel workers: spawned children, or the children of its
    forkserver (not the forkserver itself, nor the resource tracker)."""
    out = []
    for child in _children(pid):
        cmd = _cmdline(child)
        if b"spawn_main" in cmd:
            out.append(child)
        elif b"forkserver" in cmd:
            out += _children(child)
    return sorted(out)


@pytest.fixture(scope="module")
def tp_server() -> Server:
    """One TP=2 server for the module: the smoke test first, then a worker is killed."""
    server = Server("--api-key", KEY, "--tensor-parallel-size", "2", *FLAGS)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(tp_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_server_tp2_openai_smoke(tp_server, client, reference):
    llm = reference["llm"]
    assert len(_worker_pids(tp_server.proc.pid)) == 1
    assert httpx.get(f"{tp_server.url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="wrong", max_retries=0) \
            .models.list()
    # Chat, greedy: the TP=1 engine's text.
    messages = [{"role": "user", "content": "Name a colour."}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=12)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # Completion, streamed: same text as the TP=1 engine.
    prompt = "The capital of France is"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                            max_tokens=10, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Seeded sampling (rank 0 samples) is reproducible, n=2.
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2,
                seed=1234, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # Concurrent streams are batched together.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=TEXT_PROMPTS[i % 5], temperature=0, max_tokens=8,
            extra_body={"ignore_eos": True}).choices[0].text, range(8)))
    assert texts[:5] == [llm.generate(p, SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text
                         for p in TEXT_PROMPTS]
    assert texts[5:] == texts[:3]


def test_killed_worker_fails_requests_and_health(tp_server, client):
    # Runs after the smoke test (file order), on the same server: it leaves it unhealthy.
    server, url = tp_server, tp_server.url
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 1
    stream = iter(client.completions.create(model=MODEL, prompt="Once upon a time",
                                            max_tokens=500, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    for _ in range(3):
        next(stream)  # generating
    os.kill(workers[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 30
    assert "tensor-parallel worker 1" in str(err.value) and "SIGKILL" in str(err.value)
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and "tensor-parallel worker 1" in r.text
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert err.value.status_code == 503
    assert server.proc.poll() is None  # the server itself still answers


def test_worker_dying_while_idle_is_reported_not_hung(tp_results):
    # The module's TP=2 engine (one spawn fewer); no test after this one uses it.
    llm = tp_results["llm"]
    try:
        assert llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        (pid,) = llm.engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(WorkerDiedError, match=r"worker 1 \(pid \d+\) was killed by signal 9"):
            llm.engine.check_health()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="cannot continue"):
            llm.generate("Hi", GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 5
    finally:
        llm.engine.shutdown()


# ---- two "hosts" under torchrun ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(network_namespaces() is None,
                    reason="test_netns runs it across two network-namespace hosts")
def test_two_hosts_with_torchrun_rendezvous(reference):
    """Two torchrun agents (one process each) meet at a c10d rendezvous on loopback, as two
    hosts would; whichever gets rank 0 prints the generation, the other serves as worker.
    (Where network namespaces can be made, test_netns runs the same across two of them.)"""
    prompt = TEXT_PROMPTS[0]
    ref = reference["llm"].generate(prompt, SamplingParams(temperature=0, max_tokens=12),
                                    use_tqdm=False)[0].outputs[0].text
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"servelm-{port}",
         "--node-rank", str(i), "-m", "servelm.cli", "generate", prompt,
         "--tensor-parallel-size", "2", *FLAGS, "--temperature", "0",
         "--max-tokens", "12", "--kv-cache-memory", "32MiB", "--num-threads", "1",
         "--no-shm-collectives"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    printed = [o.strip() for o, _ in outs if o.strip()]
    assert printed == [ref.strip()]
