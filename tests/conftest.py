"""Shared fixtures: the embedded model, loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from servelm.models.loader import default_model_path

# Two threads, as on CI; tests compare results, never timings. Under pytest-xdist (`make
# test` runs one worker per CPU) each worker and every process it starts (servers,
# tensor-parallel ranks) keep to one CPU of their own: engines size their thread pools by
# the CPUs they may run on, so two workers never fight over one core's OpenMP threads.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKER and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    if len(_cpus) >= _WORKERS > 1:
        _share = len(_cpus) // _WORKERS
        _index = int(_WORKER.removeprefix("gw"))
        os.sched_setaffinity(0, _cpus[_index * _share:(_index + 1) * _share])
torch.set_num_threads(min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count() or 1))

# Without a GPU the Triton kernels (servelm/kernels/triton_attention.py) run in Triton's
# interpreter, on CPU tensors; this must be set before they are defined (imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines built by the tests measure their linear methods into a cache of this run's own
# (servelm.tuning), never reading a table another run left in the user's cache. The run's
# pytest-xdist workers inherit the controller's directory, so a shape measured by one worker
# is not measured again by the other (the cache file is replaced atomically).
if "SERVELM_TEST_KEEP_CACHE" not in os.environ:
    import tempfile

    if "SERVELM_TEST_CACHE_HOME" not in os.environ:
        os.environ["SERVELM_TEST_CACHE_HOME"] = tempfile.mkdtemp(prefix="servelm-test-cache-")
    os.environ["XDG_CACHE_HOME"] = os.environ["SERVELM_TEST_CACHE_HOME"]

@pytest.fixture(scope="session", autouse=True)
def _steady_kernel_timings():
    """The engines the tests build cache their linear-method tables as measured: the
    stability checks (servelm.tuning: timed again, then served uncached where the rounds
    disagree, or where other processes kept the CPUs busy: the other test worker always
    does) would make a table timed under the suite's own load provisional, measured
    again at every engine build and never "cached", by chance. test_tuning_stability.py
    puts the real checks back for its own tests (every timing there is faked). The servers
    the tests fork (server_zygote) leave the busy check out too."""
    from servelm import tuning

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "_unstable_rounds", lambda *a, **k: {})
        mp.setattr(tuning, "_non_monotone", lambda *a, **k: [])
        mp.setattr(tuning, "_slow_shapes", lambda *a, **k: {})
        mp.setattr(tuning, "_busy_reason", lambda window: None)
        yield


CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Explain the KV cache in one sentence."}],
    [{"role": "user", "content": "List three prime numbers."},
     {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Three more, please."}],
    [{"role": "user", "content": "def fib(n): -- finish this Python function."}],
]

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 5, 8, 13,",
    "The KV cache stores",
]


@pytest.fixture(autouse=True)
def _keep_threads():
    """A test's engines may set torch's thread count for the whole process (LLM(num_threads=2)
    in test_families, a tensor-parallel rank 0's share): the next test gets the worker's own
    back, rather than two OpenMP threads on the worker's one CPU."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def llm():
    """The fp32 reference engine on the embedded model, with a modest KV pool."""
    from servelm import LLM

    return LLM(dtype="float32", kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def hf_model(gguf_path, tmp_path_factory):
    """transformers' own load of the same GGUF, dequantised to fp32: the numerical reference."""
    pytest.importorskip("transformers")
    from helpers import hf_from_gguf

    return hf_from_gguf(gguf_path, tmp_path_factory.mktemp("hf-reference"))


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    pytest.importorskip("transformers")
    from helpers import hf_tokenizer_from_gguf

    return hf_tokenizer_from_gguf(gguf_path)  # AutoTokenizer's choice for it, named


# Modules whose processes need every CPU, or which time a client against a fake server to
# tens of milliseconds: tensor-parallel ranks (two ranks and their server sharing one
# worker's CPU crawl) and test_bench.py. `make test` runs them on their own after the
# rest, which runs on two pytest-xdist workers, a CPU each. The servers' tests run there
# too: each worker has a CPU of its own, and their timing checks bound what a blocked
# event loop or a lost request would take, with room for a noisy CPU.
# The console's browser tests watch an answer stream and the dashboard follow a load: a
# browser starved of CPU by the other worker reads a whole answer at once (each failed so,
# now and then, in full runs; never alone).
SERIAL = {"test_tensor_parallel.py", "test_lora_tp.py", "test_bench.py", "test_console.py"}
# The slowest first, so that neither worker is left with a long module at the end while
# the other idles (--dist loadfile hands out whole modules in this order): the modules
# with the most seconds in a full run (`--durations=0`, summed by module), the rest after.
SLOW_FIRST = ["test_families.py", "test_server.py", "test_quantization.py", "test_engine.py",
              "test_real_models.py", "test_tools_real.py", "test_anthropic.py",
              "test_router_e2e.py", "test_netns.py", "test_disaggregation_e2e.py",
              "test_responses.py", "test_decode_layer.py",
              "test_server_fixes.py", "test_triton_attention.py", "test_prefix_caching.py",
              "test_spec_draft.py", "test_tuning.py", "test_reasoning.py", "test_ollama.py",
              "test_formats.py", "test_structured_outputs.py", "test_weight_format.py",
              "test_prepack.py", "test_kernels.py", "test_lora.py", "test_server_api.py",
              "test_decode_benchmarks.py", "test_llama4.py", "test_deepseek.py",
              "test_gemma4.py", "test_qwen3_next.py", "test_server_first_hour.py",
              "test_spec_decode.py", "test_embeddings.py", "test_server_async_engine.py",
              "test_kv_quant.py", "test_server_lora.py", "test_disaggregation.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
