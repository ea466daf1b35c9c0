"""servelm.hugepages: tensors packed into one 2 MB-aligned region of transparent huge pages."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from servelm import hugepages
from servelm import quantization as Q
from servelm.engine.model_runner import KVCache
from servelm.models.config import ModelConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_allowed() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def _smaps_kb(ptr: int, field: str = "AnonHugePages") -> int:
    """A field (kB) of the mapping holding address ptr (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    return 0


_LIBC = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_kb(ptr: int, nbytes: int) -> int:
    """kB of [ptr, ptr + nbytes) resident in memory (mincore), counting only this range: a
    mapping's smaps Rss also counts whatever neighbouring anonymous memory the kernel merged
    into the same mapping."""
    start = ptr - ptr % _PAGE
    pages = -(-(ptr + nbytes - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * _PAGE // 1024


def test_empty_is_aligned_writable_and_sized():
    t = hugepages.empty(3 * hugepages.HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * hugepages.HUGE_PAGE + 5
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * t.numel()
    assert hugepages.empty(0).numel() == 0


@pytest.mark.skipif(not _thp_allowed(), reason="transparent huge pages disabled here")
def test_empty_gets_huge_pages_where_the_kernel_allows():
    t = hugepages.empty(8 * hugepages.HUGE_PAGE)
    t.fill_(1)  # fault the pages in
    assert _smaps_kb(t.data_ptr()) >= 2048
    p = hugepages.empty(8 * hugepages.HUGE_PAGE, huge=False)  # KernelConfig.hugepages off
    p.fill_(1)
    assert _smaps_kb(p.data_ptr()) == 0


def test_pack_keeps_values_in_one_region_in_order():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 255, (1000, 3), generator=g, dtype=torch.uint8),
          torch.randn(17, generator=g).half(), torch.randn(5, 7, generator=g),
          torch.empty(0), torch.randn(4, 4, generator=g).bfloat16().t()]  # non-contiguous
    packed = hugepages.pack(ts)
    for t, p in zip(ts, packed):
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert torch.equal(p, t)
    ptrs = [p.data_ptr() for p in packed if p.numel()]
    assert ptrs == sorted(ptrs) and all(x % 64 == 0 for x in ptrs)
    assert ptrs[-1] - ptrs[0] < 64 << 10  # one region, back to back
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1


def test_pack_weights_moves_quantised_layers_without_changing_results():
    torch.manual_seed(0)
    model = nn.ModuleDict({"qkv_proj": nn.Linear(64, 96), "o_proj": nn.Linear(96, 64, bias=False),
                           "down_proj": nn.Linear(64, 32)})
    Q.quantize_model(model, "int4", targets=("qkv_proj", "down_proj"))
    Q.quantize_model(model, "int8", targets=("o_proj",))
    x = torch.randn(3, 64)
    xo = torch.randn(2, 96)
    ref = [model["qkv_proj"](x), model["o_proj"](xo), model["down_proj"](x)]
    assert hugepages.pack_weights(model) > 0
    got = [model["qkv_proj"](x), model["o_proj"](xo), model["down_proj"](x)]
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    storages = {t.untyped_storage().data_ptr() for m in model.values()
                for t in (m.qweight, m.scales)}
    assert len(storages) == 1
    order = [model[k].qweight.data_ptr() for k in ("qkv_proj", "o_proj", "down_proj")]
    assert order == sorted(order)  # module order, the order a step reads them


def test_pack_weights_moves_panel_layers_too():
    from servelm.layers import panels

    if not panels.available():
        pytest.skip("panels kernel not built here (AVX2, FMA)")
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": panels.PanelLinear(nn.Linear(64, 40)),
                           "b": panels.PanelLinear(nn.Linear(40, 24, bias=False))})
    x = torch.randn(3, 64)
    ref = model["b"](model["a"](x))
    assert hugepages.pack_weights(model) > 0
    assert torch.equal(model["b"](model["a"](x)), ref)
    ts = (model["a"].panels, model["a"].bias, model["b"].panels)
    assert len({t.untyped_storage().data_ptr() for t in ts}) == 1
    assert model["a"].panels.data_ptr() < model["b"].panels.data_ptr()


def test_kv_cache_on_the_cpu_is_zeroed_and_shaped():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32,
                      intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    kv = KVCache(cfg, num_blocks=40, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv.data.shape == (3, 2, 40, 16, 2, 8) and kv.data.dtype == torch.bfloat16
    assert kv.data.is_contiguous() and not kv.data.any()
    k0, v0 = kv.layers[0]
    k0[1, 2] = 1.0
    assert kv.data[0, 0, 1, 2].eq(1).all() and kv.data.sum() == 2 * 8


def _populate_works() -> bool:
    t = hugepages.empty(hugepages.HUGE_PAGE)
    return hugepages.populate(t.data_ptr(), t.numel())


needs_populate = pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not _populate_works(),
                                    reason="MADV_POPULATE_WRITE needs Linux 5.14+")


@needs_populate
def test_populate_commits_pages_and_keeps_what_they_hold():
    t = hugepages.empty(8 * hugepages.HUGE_PAGE, huge=False)
    t[5] = 7
    t[-1] = 9
    assert _resident_kb(t.data_ptr(), t.numel()) < 1024  # two pages touched, not 16 MB
    assert hugepages.populate(t.data_ptr() + 3, t.numel() - 3)  # unaligned: whole pages
    assert _resident_kb(t.data_ptr(), t.numel()) >= 16 * 1024
    assert t[5] == 7 and t[-1] == 9 and int(t.sum()) == 16
    assert not hugepages.populate(t.data_ptr(), 0)


@needs_populate
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])  # int8: scales too
def test_kv_cache_commits_its_pool_in_block_order_keeping_contents(dtype):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64,
                      intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=32, max_position_embeddings=64)
    # A block of a layer's K is 16 x 2 x 32 bytes or twice that: 1 KB / 2 KB, so the pool
    # spans several 2 MB windows of blocks.
    kv = KVCache(cfg, num_blocks=5000, block_size=16, dtype=dtype, device=torch.device("cpu"))
    pool = kv.data.numel() * kv.data.element_size()
    scales = 0 if kv.scales is None else kv.scales.numel() * 4
    assert kv.uncommitted_bytes == pool + scales  # every byte once
    # Blocks are handed out from block 0 up: the first units are block 0 onwards of every
    # region (each layer's K and V, and their scales), before any region's later blocks.
    regions = [t.data_ptr() for layer in kv.layers for t in layer]
    order = kv._uncommitted[::-1]
    assert {p for p, _ in order[:len(regions)]} == set(regions)
    assert order[len(regions)][0] not in regions
    k0 = kv.layers[1][0]
    k0[4999, 3] = 1
    assert _resident_kb(kv.data.data_ptr(), pool) < pool // 1024 // 4
    steps = 0
    while kv.commit_next():
        steps += 1
    assert kv.uncommitted_bytes == 0 and not kv.commit_next()
    assert steps >= 6 * 2  # two windows or more, each of 6 regions (12 with scales)
    assert _resident_kb(kv.data.data_ptr(), pool) >= pool // 1024  # all of it resident
    if kv.scales is not None:
        assert _resident_kb(kv.scales.data_ptr(), scales) >= scales // 1024
    assert int(k0[4999, 3].eq(1).sum()) == k0[4999, 3].numel()
    assert int(kv.data.ne(0).sum()) == k0[4999, 3].numel()


def test_the_server_commits_the_pool_at_start_within_its_budget(monkeypatch):
    """LLMEngine.commit_pool: the pool's units until none is left, or until the time is up
    (the rest for the idle loop); nothing where commit_while_idle is off."""
    from types import SimpleNamespace

    from servelm.engine import engine as engine_mod
    from servelm.engine.engine import LLMEngine

    class Pool:
        def __init__(self, units):
            self.units = units

        def commit_next(self):
            self.units -= 1
            return self.units > 0

    def fake(units, on=True):
        cache = SimpleNamespace(commit_while_idle=on)
        return SimpleNamespace(config=SimpleNamespace(cache=cache),
                               executor=SimpleNamespace(kv_cache=Pool(units)))
    e = fake(40)
    assert LLMEngine.commit_pool(e, 60.0) is False and e.executor.kv_cache.units == 0
    e = fake(40, on=False)
    assert LLMEngine.commit_pool(e, 60.0) is False and e.executor.kv_cache.units == 40
    clock = iter(range(1000))  # one second a call: the budget runs out after 3 units
    monkeypatch.setattr(engine_mod.time, "monotonic", lambda: next(clock))
    e = fake(40)
    assert LLMEngine.commit_pool(e, 3.0) is True and e.executor.kv_cache.units == 37


def test_lora_slots_lie_in_one_region_in_step_order():
    """apply_lora puts every adapted layer's slots (A, then B, layer by layer) in one huge-page
    region, empty; an adapter copied into a slot reads back from there."""
    from helpers import random_bf16_model

    from servelm.lora.wrap import apply_lora

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    model = random_bf16_model(cfg, seed=0)
    wrapped = apply_lora(model, max_loras=2, max_rank=4)
    ts = [t for m in wrapped.values() for t in (m.lora_a, m.lora_b)]
    assert len(ts) == 16 and all(t.is_contiguous() and not t.any() for t in ts)  # 2 x (qkv, o, gate_up, down)
    assert len({t.untyped_storage().data_ptr() for t in ts}) == 1
    ptrs = [t.data_ptr() for t in ts]
    assert ptrs == sorted(ptrs)
    assert ts[0].untyped_storage().data_ptr() % hugepages.HUGE_PAGE == 0
    o = wrapped["layers.0.self_attn.o_proj"]
    a, b = torch.randn(3, 32), torch.randn(32, 3)
    o.set_slot(1, [(a, b)])
    assert torch.equal(o.lora_a[1, :3], a.bfloat16()) and not o.lora_a[0].any()
    plain = apply_lora(random_bf16_model(cfg, seed=0), max_loras=2, max_rank=4, huge=False)
    if _thp_allowed():
        ts[0].fill_(0)  # fault the region in
        assert _smaps_kb(ts[0].data_ptr()) >= 2048
        p = next(iter(plain.values())).lora_a
        p.fill_(0)
        assert _smaps_kb(p.data_ptr()) == 0
