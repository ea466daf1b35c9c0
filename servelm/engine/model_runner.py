"""ModelRunner: a scheduled batch -> tensors -> one forward pass -> next-token logits."""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from servelm import hugepages as _hugepages
from servelm.attention import AttentionBackend, AttentionSpec, get_backend
from servelm.attention import select as select_attention
from servelm.attention.cpu import KV_DTYPES as CPU_KV_DTYPES
from servelm.attention.metadata import (ForwardBatch, decode_group_lists, decode_lists,
                                        group_views)
from servelm.config import KernelConfig
from servelm.kernels import load_ops
from servelm.models import kv_quant
from servelm.models.config import KVGroups, ModelConfig
from servelm.models.linear_attention import RecurrentBatch

if TYPE_CHECKING:
    from servelm.engine.state_cache import StateCache
    from servelm.models.decoder import CausalLM

logger = logging.getLogger(__name__)


@dataclass
class SeqInput:
    """One sequence's share of a step: the tokens to run and where their KV goes."""

    token_ids: list[int]    # tokens computed this step (a prefill chunk, or the one decode token)
    start_pos: int          # position of token_ids[0] == tokens already in the cache
    block_table: list[int]  # blocks holding positions [0, start_pos + len(token_ids))
    sample: bool = True     # whether next-token logits are wanted (last chunk of a prompt, decode)
    # Logits for every computed position, not only the last (prompt logprobs): the runner
    # returns one row per token, in position order, each listing this sequence's index.
    all_logits: bool = False
    # Logits rows wanted, for the last num_logits tokens (speculation: the last real token
    # and each draft token after it, k + 1; otherwise 1).
    num_logits: int = 1
    # A pooling request's chunk: its rows (the last position's with `sample`, every
    # position's with `all_logits`) come back as final hidden states, never logits
    # (execute_pooling).
    pooling: bool = False
    # The resident slot of its LoRA adapter (servelm.lora), -1: the base model alone.
    lora_slot: int = -1
    # Its recurrent-state slot (linear-attention layers: servelm.engine.state_cache), -1 none.
    state_slot: int = -1
    # (tokens into this step, state row): where the linear-attention layers copy the slot's
    # state into a prefix-cache snapshot (a StateCache row past the slots) on the way.
    state_snapshot: tuple[int, int] | None = None
    # A hybrid model's further block groups (BlockManager.group_tables): each group's table,
    # its layers' pages at the same positions as block_table's.
    group_tables: list[list[int]] = field(default_factory=list)


class KVCache:
    """Preallocated paged pool: per layer, K and V of shape [num_blocks, block_size, KVH, D]
    (KVH and D: ModelConfig.cache_layout; where it has one plane, V is K's tensor itself:
    DeepSeek's latent rows).

    With spare_block, one block more than num_blocks is allocated, `pad_block`, which the
    block manager never hands out: padding rows of captured CUDA-graph steps write there.
    A quantised pool (dtype int8 or float8_e4m3fn, servelm.models.kv_quant) also holds one
    fp32 scale per token and KV head, `scales` [layers, 2, blocks, block_size, KVH]; each
    layer's entry of `layers` is then (k, v, k_scale, v_scale), else (k, v).

    Layers may differ in KV heads and head size (Gemma 4's global layers: ModelConfig's
    head_dim_of / kv_heads_of), and a KV-shared layer holds no cache of its own: its entry
    of `layers` is its source layer's (kv_source). The pool is still one allocation, each
    layer's K, V (then their scales) a region of it in layer order; `data` and `scales`
    are then flat views of the rows and the scales, and bytes_per_block the sum over the
    layers that hold a cache. Uniform models keep the shapes above.

    With `groups` (a hybrid model's KVGroups: windowed and full-attention layers), the
    pool is num_blocks pages of one size (page_layout), not a region per layer: a block id
    names a page of one group, which holds K and V (then their scales) of block_size tokens
    in each of that group's layers, so each layer's K and V are views whose block stride is
    the page (the kernels read any block stride), and `data` / `scales` are the page buffer
    [pages, page bytes] as rows and as scales. The block manager hands each group's pages
    out of one free queue."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, spare_block: bool = False,
                 hugepages: bool = True, groups: KVGroups | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.groups = groups
        self.pad_block = num_blocks if spare_block else None
        self.quantized = kv_quant.is_quantized(dtype)
        self.dtype = dtype
        total = num_blocks + spare_block
        # One allocation; the cache holds only the KV heads (grouped-query attention). On
        # the CPU in 2 MB huge pages: attention reads it through scattered blocks.
        cpu = torch.device(device).type == "cpu"
        size = total * self.bytes_per_block(cfg, block_size, dtype, groups)
        if cpu:
            buf = _hugepages.empty(size, hugepages).view(torch.uint8)
            # Fresh anonymous memory reads as zeros (the kernel's zero page until written):
            # nothing to clear, and a page is only committed once a token's KV lands in it.
        else:
            # 1-byte rows zeroed as bytes (fp8 fills are not on every device build).
            buf = torch.zeros(size, dtype=torch.uint8, device=device)
        if groups is not None:
            mine = self._pages(cfg, buf, total, block_size, groups)
        else:
            mine = self._regions_per_layer(cfg, buf, total, block_size)
        # (None: a linear-attention layer, whose recurrent state is a StateCache's.)
        self.layers = [None if cfg.is_linear_layer(i) else mine[cfg.kv_source(i)]
                       for i in range(cfg.num_layers)]
        self._uncommitted = self._commit_units() if cpu else []

    def _regions_per_layer(self, cfg: ModelConfig, buf: torch.Tensor, total: int,
                           block_size: int) -> dict[int, tuple[torch.Tensor, ...]]:
        """Each layer's K, V (then their scales) a region of buf in layer order, each
        [total, block_size, KVH, D] (scales [total, block_size, KVH]): layer -> entry."""
        dtype, own = self.dtype, cfg.kv_layers  # not KV-shared layers, not linear attention's
        # Each layer's K and V (one plane where V is read from K's rows: cache_planes).
        planes = cfg.cache_planes
        shapes = [(total, block_size, *cfg.cache_shape_of(i)) for i in own]
        numels = [planes * math.prod(sh) for sh in shapes]
        elem = torch.empty(0, dtype=dtype).element_size()
        rows = sum(numels) * elem
        # Rows first, then the scales (fp32, 4-byte aligned: rows are a multiple of 4).
        nscales = sum(n // sh[-1] for n, sh in zip(numels, shapes)) if self.quantized else 0
        flat = buf[:rows].view(dtype)
        flat_scales = buf[rows:rows + 4 * nscales].view(torch.float32) if self.quantized else None
        regions, scale_regions, at, sat = [], [], 0, 0
        for sh, n in zip(shapes, numels):
            regions.append(flat[at:at + n].view(planes, *sh))
            at += n
            if self.quantized:
                scale_regions.append(flat_scales[sat:sat + n // sh[-1]].view(planes, *sh[:-1]))
                sat += n // sh[-1]
        if len(set(shapes)) == 1:  # [layers, planes, total, block_size, KVH, D], as always
            self.data = flat.view(len(own), planes, *shapes[0])
            self.scales = (flat_scales.view(len(own), planes, *shapes[0][:-1])
                           if self.quantized else None)
        else:
            self.data, self.scales = flat, flat_scales
        self._regions = [t for r in regions for t in r] + [t for r in scale_regions for t in r]
        v = planes - 1  # V's plane: K's own with one plane
        if self.quantized:
            return {i: (r[0], r[v], s[0], s[v]) for i, r, s in zip(own, regions, scale_regions)}
        return {i: (r[0], r[v]) for i, r in zip(own, regions)}

    def _pages(self, cfg: ModelConfig, buf: torch.Tensor, total: int, block_size: int,
               groups: KVGroups) -> dict[int, tuple[torch.Tensor, ...]]:
        """Each group layer's K and V (then their scales) as views of buf's pages
        (page_layout): layer -> entry."""
        page, offsets = self.page_layout(cfg, block_size, self.dtype, groups)
        elem = torch.empty(0, dtype=self.dtype).element_size()
        pages = buf.view(total, page)
        rows = pages.view(self.dtype)
        self.data = rows
        self.scales = pages.view(torch.float32) if self.quantized else None
        self._regions = [pages]
        mine = {}
        for i, offs in offsets.items():
            kvh, d = cfg.cache_shape_of(i)
            views = [rows.as_strided((total, block_size, kvh, d), (page // elem, kvh * d, d, 1),
                                     rows.storage_offset() + off // elem) for off in offs[:2]]
            if self.quantized:
                views += [self.scales.as_strided((total, block_size, kvh), (page // 4, kvh, 1),
                                                 self.scales.storage_offset() + off // 4)
                          for off in offs[2:]]
            mine[i] = tuple(views)
        return mine

    @staticmethod
    def page_layout(cfg: ModelConfig, block_size: int, dtype: torch.dtype, groups: KVGroups
                    ) -> tuple[int, dict[int, tuple[int, ...]]]:
        """A pool in block groups: the bytes of a page (the largest group's) and, for each
        group layer, the byte offsets in a page of its K and V rows (the same offset twice
        where V is read from K's rows), then of their scales in a quantised pool. A group's
        layers' rows come first, then their scales, each region 64-byte aligned."""
        elem = torch.empty(0, dtype=dtype).element_size()
        quant = kv_quant.is_quantized(dtype)
        planes = cfg.cache_planes
        page, offsets = 0, {}
        for members in groups.layers:
            at = 0
            for scales in ((False, True) if quant else (False,)):
                for i in members:
                    kvh, d = cfg.cache_shape_of(i)
                    n = -(-block_size * kvh * (4 if scales else d * elem) // 64) * 64
                    offsets.setdefault(i, [])
                    offsets[i] += [at, at + (planes - 1) * n]
                    at += planes * n
            page = max(page, at)
        return page, {i: tuple(o) for i, o in offsets.items()}

    def _commit_units(self) -> list[tuple[int, int]]:
        """The pool's memory as (address, bytes) units in the order blocks are handed out:
        block ids rise (BlockManager), and a block's rows lie one in each region (a layer's
        K or V, and their scales), so the units go a window of blocks at a time (a huge
        page of the largest region), each window's slice of every region."""
        regions = self._regions  # [total, bs, KVH, D] each, then the scales [total, bs, KVH]
        total = regions[0].shape[0]
        spans = [(t.data_ptr(), t[0].numel() * t.element_size()) for t in regions]
        window = max(1, _hugepages.HUGE_PAGE // max(b for _, b in spans))  # blocks
        units = [(ptr + lo * b, (min(total, lo + window) - lo) * b)
                 for lo in range(0, total, window) for ptr, b in spans]
        units.reverse()  # popped from the end
        return units

    @property
    def uncommitted_bytes(self) -> int:
        """Bytes of the pool commit_next has not reached (0 for a device pool)."""
        return sum(n for _, n in self._uncommitted)

    def commit_next(self) -> bool:
        """Fault in the next unit (at most 2 MB) of the pool's untouched memory, keeping what
        it holds; returns whether any is left. A CPU pool is fresh anonymous memory whose
        pages are committed where a token's K/V first lands: with prefix caching every new
        prompt lands in blocks never used before (freed blocks stay cached), so until the
        pool is committed each prompt pays first-touch faults inside its step, 20-40 ms of
        a 512-token prompt on a VM. The server calls this while it is idle."""
        if not self._uncommitted:
            return False
        if not _hugepages.populate(*self._uncommitted.pop()):
            self._uncommitted.clear()  # the kernel cannot: pages come at first touch
        return bool(self._uncommitted)

    # ---- blocks as bytes: a prefix's KV sent to another engine (disaggregated serving) ----

    def layout(self) -> dict:
        """What a block holds, for checking that another engine's blocks fit this pool: the
        block size, the storage dtype and each region's shape past its block index (every
        layer's K, V, then their scales, in pool order; in block groups, the page and the
        groups)."""
        out = {"block_size": self.block_size, "dtype": str(self.dtype).removeprefix("torch."),
               "regions": [[str(r.dtype).removeprefix("torch."), list(r.shape[1:])]
                           for r in self._regions]}
        if self.groups is not None:  # pages of block groups: the same groups' pages
            out["groups"] = [[list(g) for g in self.groups.layers], list(self.groups.reaches)]
        return out

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds over every region (read_blocks' size per block)."""
        return sum(r[0].numel() * r.element_size() for r in self._regions)

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Every region's rows of `blocks`, in order, as one flat uint8 tensor on the CPU
        (region after region, each [len(blocks), ...] in block order)."""
        if not blocks:
            return torch.empty(0, dtype=torch.uint8)
        idx = torch.tensor(blocks, dtype=torch.long, device=self._regions[0].device)
        parts = [_bytes(r).index_select(0, idx).reshape(-1) for r in self._regions]
        return torch.cat(parts).cpu()

    def write_blocks(self, blocks: list[int], data: torch.Tensor,
                     rows: list[int] | None = None) -> None:
        """Write read_blocks' bytes of some n blocks into `blocks`: block i receives entry
        rows[i] of the n (default: entry i, the n being the blocks)."""
        n = len(blocks) if rows is None else data.numel() // max(self.block_bytes, 1)
        rows = list(range(n)) if rows is None else rows
        if data.dtype != torch.uint8 or data.numel() != n * self.block_bytes or (
                len(rows) != len(blocks) or any(not 0 <= r < n for r in rows)):
            raise ValueError(f"{data.numel()} bytes of {data.dtype} do not hold {n} blocks "
                             f"of {self.block_bytes} bytes")
        if not blocks:
            return
        device = self._regions[0].device
        idx = torch.tensor(blocks, dtype=torch.long, device=device)
        src = torch.tensor(rows, dtype=torch.long)
        at = 0
        for r in self._regions:
            dst = _bytes(r)
            size = n * dst[0].numel()
            part = data[at:at + size].view(n, *dst.shape[1:]).index_select(0, src)
            dst.index_copy_(0, idx, part.to(device))
            at += size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                        groups: KVGroups | None = None) -> int:
        """K and V of one block in every layer that holds a cache (each its own shape; K
        alone where V is read from it), with the scales of a quantised pool; with block
        groups, one page (page_layout)."""
        if groups is not None:
            return KVCache.page_layout(cfg, block_size, dtype, groups)[0]
        elem = torch.empty(0, dtype=dtype).element_size()
        scale = 4 if kv_quant.is_quantized(dtype) else 0
        return sum(cfg.cache_planes * block_size * kvh * (d * elem + scale)
                   for kvh, d in map(cfg.cache_shape_of, cfg.kv_layers))


def _bytes(region: torch.Tensor) -> torch.Tensor:
    """A pool region [blocks, ...] as bytes (its last dim times its element size)."""
    return region if region.dtype == torch.uint8 else region.view(torch.uint8)


def build_forward_batch(seqs: list[SeqInput], block_size: int, num_queries_per_kv: int,
                        device: torch.device, attention: AttentionBackend | str = "reference"
                        ) -> tuple[ForwardBatch, list[int]]:
    """Flatten sequences into one batch, in the order and with the metadata of the
    `attention` backend (an AttentionBackend or its name; see servelm.attention): the
    reference groups decodes apart from prompt chunks by context length, triton forms one
    group of each, cpu puts the decodes first as ragged rows. Returns the batch and, for each
    sampled row of the logits, the index of its sequence in `seqs`."""
    if isinstance(attention, str):
        attention = get_backend(attention)
    flat, meta = attention.build(seqs, block_size, num_queries_per_kv, device)
    recurrent = None
    if any(s.state_slot >= 0 for s in seqs):  # linear attention: each sequence's segment
        lengths = [len(seqs[i].token_ids) for i in flat.order]
        starts = [0, *accumulate(lengths)][:-1]
        recurrent = RecurrentBatch.build(starts, lengths, [seqs[i].state_slot for i in flat.order],
                                         [seqs[i].start_pos == 0 for i in flat.order], device,
                                         [seqs[i].state_snapshot for i in flat.order])
    lora = None
    if any(s.lora_slot >= 0 for s in seqs):
        tokens = [seqs[i].lora_slot for i in flat.order for _ in seqs[i].token_ids]
        rows = [seqs[i].lora_slot for i in flat.sampled]
        lora = (torch.tensor(tokens, dtype=torch.int32, device=device),
                torch.tensor(rows, dtype=torch.int32, device=device))
    batch = ForwardBatch(**flat.tensors(device), attn=meta, lora_slots=lora,
                         recurrent=recurrent)
    if seqs and seqs[0].group_tables:  # a hybrid model's block groups: their own pages
        batch.kv_views = group_views(batch, flat.order, seqs, block_size)
    return batch, flat.sampled


def pin_module_attributes(model: torch.nn.Module) -> None:
    """Copy every module's parameters, buffers and submodules into its instance __dict__.

    nn.Module keeps them in side dictionaries reached through __getattr__, a Python-level
    fallback that a decode step hits ~800 times (~0.4 ms of a 5 ms one-stream step).
    Call it once the weights are final (loaded, quantised, sharded): moving the model or
    reassigning a buffer afterwards would leave the pinned entry pointing at the old
    tensor (replacing a parameter or submodule drops the pin, nn.Module.__setattr__ does).
    """
    for m in model.modules():
        for table in (m._parameters, m._buffers, m._modules):
            for name, value in table.items():
                if value is not None:
                    m.__dict__[name] = value


class ModelRunner:
    """Owns the model and the KV cache; runs one step's forward and returns logits."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device,
                 cuda_graphs: bool = False, max_graph_batch: int = 256,
                 kernels: KernelConfig | None = None, state_cache: StateCache | None = None):
        """cuda_graphs: decode steps of up to max_graph_batch rows replay captured CUDA
        graphs (servelm.engine.cuda_graphs); needs a KVCache with a spare block. kernels:
        which of the C++ / Triton paths may run (all, by default) and the attention backend.
        state_cache: the linear-attention layers' recurrent states (a model with them)."""
        kernels = kernels or KernelConfig()
        self.model = model
        self.kv_cache = kv_cache
        self.state_cache = state_cache
        self.device = device
        cfg: ModelConfig = model.config
        # What each layer reads and writes, in layer order: its K/V (kv_cache.layers, the
        # same list where no layer keeps a recurrent state) or its recurrent state.
        self.layer_caches = kv_cache.layers
        # A hybrid model's block groups: each layer reads its group's pages.
        model.set_kv_groups(kv_cache.groups)
        if cfg.has_recurrent_state:
            if state_cache is None:
                raise ValueError("a model with linear-attention layers needs a StateCache")
            self.layer_caches = [state_cache.layers[i] if cfg.is_linear_layer(i)
                                 else kv_cache.layers[i] for i in range(cfg.num_layers)]
        _, cache_heads, cache_head_dim = cfg.cache_layout
        self.num_queries_per_kv = cfg.num_heads // cache_heads
        # The path is decided once: fused C++ kernels (norms, rotary + KV write, SiLU) on
        # CPU when they build, else the eager PyTorch reference (CUDA, no compiler,
        # kernels.cpu_kernels off), each op module bound to its choice (select_ops); and
        # the attention backend (servelm.attention.select: C++ kernels in place over the
        # block tables on the CPU, Triton on CUDA, else gather + SDPA). Tests may flip both
        # (use_kernels, which selects the ops again, and attention).
        cpu = torch.device(device).type == "cpu"
        kv_dtype = kv_cache.data.dtype
        # The activations' dtype (a quantised pool's storage dtype is not it).
        dtype = model.norm.weight.dtype
        if (kernels.cpu_kernels and cpu and kv_dtype == torch.float8_e4m3fn
                and load_ops("ops")):
            raise ValueError("kv_cache_dtype 'fp8' cannot be read by servelm's C++ CPU "
                             "kernels: use kv_cache_dtype 'int8' there, or turn the kernels "
                             "off (cpu_kernels=False, --no-cpu-kernels) to run fp8 on the "
                             "PyTorch reference")
        use_kernels = bool(kernels.cpu_kernels and cpu and kv_dtype in CPU_KV_DTYPES
                           and load_ops("ops"))
        self._use_kernels = use_kernels
        model.select_ops(use_kernels)
        self.attention: AttentionBackend = select_attention(kernels, AttentionSpec(
            torch.device(device), dtype, kv_dtype, cfg.num_heads, cache_heads,
            cache_head_dim, kv_cache.block_size, logit_softcap=cfg.attn_logit_softcap,
            sinks=bool(cfg.extra.get("attention_sinks")),
            attention_chunk=cfg.extra.get("attention_chunk_size"),
            layer_shapes=tuple(dict.fromkeys(
                cfg.cache_shape_of(i) for i in cfg.kv_layers
                if cfg.cache_shape_of(i) != (cache_heads, cache_head_dim)))))
        logger.info("attention backend: %s", self.attention.name)
        # The DecodeStack reads the cpu backends' ragged decode rows (and its own C++ ops).
        if use_kernels and self.attention.ragged_decodes and kernels.fused_decode:
            model.bind_decode_layers(self.layer_caches)  # decode-only steps: one C++ call
        # LoRA adapters' slots of each step's rows (servelm.lora.wrap), None without them.
        self.lora_step = getattr(model, "lora_step", None)
        # The ops are chosen: the weights are final (loaded, quantised or sharded) too.
        pin_module_attributes(model)
        self.graphs = None
        # A sliding-window layer picks its attention path by the step's context lengths
        # (host data), which a captured graph would freeze: such models decode eagerly.
        windowed = any(layer.window for layer in model.layers)
        if cuda_graphs and cfg.has_recurrent_state:
            # (Each step's state slots and segments are host data too.)
            logger.info("CUDA graphs off: the model has linear-attention layers")
            cuda_graphs = False
        if cuda_graphs and windowed:
            logger.info("CUDA graphs off: the model has sliding-window layers")
        elif cuda_graphs and self.lora_step is not None:
            # (Each step's slots are host data a captured graph would freeze.)
            logger.info("CUDA graphs off: LoRA adapters are enabled")
        if cuda_graphs and not windowed and self.lora_step is None:
            from servelm.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv_cache, device, max_batch=max_graph_batch,
                                       attention=self.attention)

    @property
    def use_kernels(self) -> bool:
        """Whether the model's op modules run servelm's C++ ops (else the PyTorch
        references), as chosen at construction."""
        return self._use_kernels

    @use_kernels.setter
    def use_kernels(self, kernels: bool) -> None:
        """Tests and benchmarks compare the paths on one runner: every op module is selected
        again (the DecodeStacks run only beside the C++ ops)."""
        self._use_kernels = bool(kernels)
        self.model.select_ops(self._use_kernels)

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        """Returns fp32 logits [S, vocab] and, per row, the index in `seqs` it belongs to
        (a sequence with num_logits m has m consecutive rows, its last m positions'; one
        with all_logits a row per token)."""
        if any(s.pooling for s in seqs):
            raise ValueError("a step with pooling sequences runs through execute_pooling")
        if self.graphs is not None and not any(s.all_logits for s in seqs):
            out = self.graphs.execute(seqs)
            if out is not None:
                return out
        adapted = self.lora_step is not None and any(s.lora_slot >= 0 for s in seqs)
        if (self.attention.ragged_decodes
                and self.model.decode_stack_takes(self.layer_caches, len(seqs))
                and (not adapted or getattr(self.model, "stack_runs_lora", False))
                and all(len(s.token_ids) == 1 and s.sample for s in seqs)):
            # Decodes only, on the DecodeStack: its input as plain lists, no ForwardBatch (a
            # one-stream step's small ops and tensors cost 3-5x their time alone there, run
            # on caches the weight stream has just gone through).
            ids, pos, slots, tables, lens, _ = decode_lists(seqs, self.kv_cache.block_size)
            if seqs[0].group_tables:  # a hybrid model's block groups: theirs after
                more_slots, more_tables = decode_group_lists(
                    seqs, self.kv_cache.block_size, len(tables) // len(seqs))
                slots += more_slots
                tables += more_tables
            states = None
            if self.state_cache is not None:  # linear attention: each row's state slot
                states = ([s.state_slot for s in seqs], [s.start_pos == 0 for s in seqs],
                          [s.state_snapshot[1] if s.state_snapshot else -1 for s in seqs])
            lora = None
            if adapted:  # decode rows are the sequences in order, one token each
                t = torch.tensor([s.lora_slot for s in seqs], dtype=torch.int32)
                lora = (t, t)
            with self._lora(lora):
                hidden = self.model.decode_step(ids, pos, slots, tables, lens, states)
            return self.model.compute_logits(hidden), list(range(len(seqs)))
        batch, sampled = build_forward_batch(seqs, self.kv_cache.block_size,
                                             self.num_queries_per_kv, self.device,
                                             self.attention)
        # Only the rows that sample go through the last layer's o_proj and MLP and the LM
        # head: no logits (or final hidden states) for prompt positions.
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden)
        return logits, sampled

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model over a ForwardBatch (sampled rows only), its LoRA slots set for the
        adapted layers while it runs."""
        with self._lora(batch.lora_slots):
            return self.model(batch, self.layer_caches, sampled_only=True)

    def _lora(self, slots: tuple[torch.Tensor, torch.Tensor] | None):
        """The adapted layers' slots (tokens, rows) for a forward; nothing without LoRA."""
        return self.lora_step.applied(slots) if self.lora_step is not None else nullcontext()

    @torch.inference_mode()
    def execute_pooling(self, seqs: list[SeqInput]
                        ) -> tuple[torch.Tensor, list[int], torch.Tensor, list[int]]:
        """A step with pooling sequences (SeqInput.pooling), possibly beside generating
        ones: execute()'s (logits, rows) for the others, and the pooling sequences' rows
        as fp32 final hidden states (after the final norm, as transformers'
        last_hidden_state) [P, hidden] with, per row, its sequence's index (a sequence's
        rows in position order). Always the eager forward: captured graphs and the
        DecodeStack return no hidden states per sequence kind."""
        batch, sampled = build_forward_batch(seqs, self.kv_cache.block_size,
                                             self.num_queries_per_kv, self.device,
                                             self.attention)
        hidden = self._forward(batch)
        pool = [r for r, i in enumerate(sampled) if seqs[i].pooling]
        keep = [r for r, i in enumerate(sampled) if not seqs[i].pooling]
        def rows(idx: list[int]) -> torch.Tensor:
            return hidden[torch.tensor(idx, dtype=torch.long, device=hidden.device)]

        pooled = rows(pool).float()  # none: a chunk whose rows its pooling does not read
        if keep:
            logits = self.model.compute_logits(rows(keep))
        else:
            logits = torch.empty(0, self.model.config.vocab_size, device=hidden.device)
        return logits, [sampled[r] for r in keep], pooled, [sampled[r] for r in pool]
