"""ModelRunner: a scheduled batch -> tensors -> one forward pass -> next-token logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from servelm import hugepages as _hugepages
from servelm.config import KernelConfig
from servelm.kernels import load_ops
from servelm.models import kv_quant
from servelm.models.config import ModelConfig
from servelm.models.layers import AttnGroup, ForwardBatch

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


class KVCache:
    """Preallocated paged pool: per layer, K and V of shape [num_blocks, block_size, KVH, D].

    With spare_block, one block more than num_blocks is allocated, `pad_block`, which the
    block manager never hands out: padding rows of captured CUDA-graph steps write there.
    A quantised pool (dtype int8 or float8_e4m3fn, servelm.models.kv_quant) also holds one
    fp32 scale per token and KV head, `scales` [layers, 2, blocks, block_size, KVH]; each
    layer's entry of `layers` is then (k, v, k_scale, v_scale), else (k, v)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, spare_block: bool = False,
                 hugepages: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pad_block = num_blocks if spare_block else None
        self.quantized = kv_quant.is_quantized(dtype)
        total = num_blocks + spare_block
        # One allocation; the cache holds only the KV heads (grouped-query attention). On
        # the CPU in 2 MB huge pages: attention reads it through scattered blocks.
        shape = (cfg.num_layers, 2, total, block_size, cfg.num_kv_heads, cfg.head_dim)
        if torch.device(device).type == "cpu":
            n = total * self.bytes_per_block(cfg, block_size, dtype)
            # Rows first, then the scales (fp32, 4-byte aligned: rows are a multiple of 4).
            buf = _hugepages.empty(n, hugepages).view(torch.uint8)
            rows = cfg.num_layers * 2 * total * block_size * cfg.num_kv_heads * cfg.head_dim
            rows *= torch.empty(0, dtype=dtype).element_size()
            self.data = buf[:rows].view(dtype).view(shape)
            self.data.view(torch.uint8).zero_()
            self.scales = (buf[rows:].view(torch.float32).view(shape[:-1]).zero_()
                           if self.quantized else None)
        else:
            # 1-byte rows zeroed as bytes (fp8 fills are not on every device build).
            self.data = (torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
                         if self.quantized else torch.zeros(shape, dtype=dtype, device=device))
            self.scales = (torch.zeros(shape[:-1], dtype=torch.float32, device=device)
                           if self.quantized else None)
        if self.quantized:
            self.layers = [(self.data[i, 0], self.data[i, 1], self.scales[i, 0], self.scales[i, 1])
                           for i in range(cfg.num_layers)]
        else:
            self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_layers)]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """K and V of one block in every layer, with the scales of a quantised pool."""
        elem = torch.empty(0, dtype=dtype).element_size()
        row = cfg.head_dim * elem + (4 if kv_quant.is_quantized(dtype) else 0)
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * row


def _bucket(s: SeqInput, block_size: int, ragged: bool = False) -> tuple[bool, int]:
    """Attention group of a sequence: decodes apart from prompt chunks, and within each,
    contexts of similar length (same power-of-two block count) together, so padding every
    member to the longest context costs at most 2x the keys actually attended to. With
    `ragged` (attention that reads only each row's own keys), one group of each."""
    if ragged:
        return len(s.token_ids) > 1, 0
    num_blocks = -(-(s.start_pos + len(s.token_ids)) // block_size)
    return len(s.token_ids) > 1, num_blocks.bit_length()


def build_forward_batch(seqs: list[SeqInput], block_size: int, num_queries_per_kv: int,
                        device: torch.device, kernels: bool = False,
                        triton_attention: bool = False) -> tuple[ForwardBatch, list[int]]:
    """Flatten sequences into one batch, grouped for attention (see _bucket). Returns the
    batch and, for each sampled row of the logits, the index of its sequence in `seqs`.
    With `triton_attention` (CUDA), the one-token rows form one group and the prompt chunks
    another, each attended in place by a Triton kernel.

    With `kernels`, every single-token row (decode) comes first, in input order, and is
    described by one padded int32 block table and its context lengths for the C++ decode
    kernel (ragged lengths, so no grouping); only prompt chunks form padded groups."""
    if kernels:
        return _build_kernel_batch(seqs, block_size, num_queries_per_kv, device)
    keys = [_bucket(s, block_size, triton_attention) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: keys[i])
    flat = _FlatTokens()
    groups = flat.add_grouped(seqs, order, [keys[i] for i in order], 0, block_size,
                              num_queries_per_kv, device)
    return (ForwardBatch(**flat.tensors(device), groups=groups, triton_attention=triton_attention),
            flat.sampled)


def decode_lists(dec: list[SeqInput], block_size: int, width: int | None = None,
                 pad_block: int = 0
                 ) -> tuple[list[int], list[int], list[int], list[int], list[int], int]:
    """One-token rows as the decode paths take them: token ids, positions, KV slots, block
    tables padded with pad_block into one flat row-major list `width` blocks a row (default:
    the longest row's), context lengths, and the blocks the longest row needs (plain lists:
    a one-stream step builds these in a few microseconds)."""
    lens = [s.start_pos + 1 for s in dec]
    input_ids = [s.token_ids[0] for s in dec]
    positions = [s.start_pos for s in dec]
    max_blocks = (max(lens) + block_size - 1) // block_size if dec else 0
    width = max_blocks if width is None else width
    tables: list[int] = []
    slots = []
    for s in dec:
        nb = (s.start_pos + block_size) // block_size
        tables += s.block_table[:nb]
        tables += [pad_block] * (width - nb)
        slots.append(s.block_table[s.start_pos // block_size] * block_size
                     + s.start_pos % block_size)
    return input_ids, positions, slots, tables, lens, max_blocks


def _build_kernel_batch(seqs: list[SeqInput], block_size: int, num_queries_per_kv: int,
                        device: torch.device) -> tuple[ForwardBatch, list[int]]:
    decodes = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    nd = len(decodes)
    if nd == len(seqs):
        prompts, keys = [], []
    else:
        prompts = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
        keys = [_bucket(seqs[i], block_size) for i in prompts]
        prompts = [prompts[j] for j in sorted(range(len(prompts)), key=keys.__getitem__)]
        keys.sort()
    input_ids, positions, slots, tables, lens, max_blocks = decode_lists(
        [seqs[i] for i in decodes], block_size)
    logits_indices = [r for r, i in enumerate(decodes) if seqs[i].sample or seqs[i].all_logits]
    sampled = [i for i in decodes if seqs[i].sample or seqs[i].all_logits]
    flat = _FlatTokens(input_ids, positions, slots, logits_indices, sampled)
    groups = flat.add_grouped(seqs, prompts, keys, nd, block_size, num_queries_per_kv, device)

    batch = ForwardBatch(
        **flat.tensors(device), groups=groups, kernels=True, num_decodes=nd,
        decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=device).view(nd, max_blocks),
        decode_context_lens=torch.tensor(lens, dtype=torch.int32, device=device))
    return batch, sampled


class _FlatTokens:
    """The flat per-token lists of a batch, filled sequence by sequence."""

    def __init__(self, input_ids=None, positions=None, slots=None, logits_indices=None,
                 sampled=None):
        self.input_ids: list[int] = input_ids if input_ids is not None else []
        self.positions: list[int] = positions if positions is not None else []
        self.slots: list[int] = slots if slots is not None else []
        self.logits_indices: list[int] = logits_indices if logits_indices is not None else []
        self.sampled: list[int] = sampled if sampled is not None else []

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """ForwardBatch's per-token fields: views of one tensor (one copy to the device)."""
        n = len(self.input_ids)
        t = torch.tensor(self.input_ids + self.positions + self.slots + self.logits_indices,
                         dtype=torch.long, device=device)
        return {"input_ids": t[:n], "positions": t[n:2 * n], "slot_mapping": t[2 * n:3 * n],
                "logits_indices": t[3 * n:]}

    def add_grouped(self, seqs: list[SeqInput], order: list[int], keys: list, start: int,
                    block_size: int, g: int, device: torch.device) -> list[AttnGroup]:
        """Append seqs[order[j]] in turn (flat tokens from `start`); consecutive ones with
        the same key (keys[j]) form one attention group."""
        groups: list[AttnGroup] = []
        members: list[SeqInput] = []
        for j, i in enumerate(order):
            s = seqs[i]
            n = len(s.token_ids)
            self.input_ids += s.token_ids
            pos = range(s.start_pos, s.start_pos + n)
            self.positions += pos
            self.slots += [s.block_table[p // block_size] * block_size + p % block_size
                           for p in pos]
            # Rows for the last m positions: every one (prompt logprobs), the token and its
            # drafts (speculation), the last (sampling), or none (a prompt chunk).
            m = n if s.all_logits else s.num_logits if s.sample else 0
            end = len(self.input_ids)
            self.logits_indices += range(end - m, end)
            self.sampled += [i] * m
            members.append(s)
            if j + 1 == len(order) or keys[j + 1] != keys[j]:
                grp = _build_group(members, start, block_size, g, device)
                groups.append(grp)
                start, members = grp.end, []
        return groups


def _build_group(seqs: list[SeqInput], start: int, block_size: int, g: int,
                 device: torch.device) -> AttnGroup:
    q_lens = [len(s.token_ids) for s in seqs]
    Q = max(q_lens)
    num_blocks = [-(-(s.start_pos + n) // block_size) for s, n in zip(seqs, q_lens)]
    max_blocks = max(num_blocks)
    tables = [s.block_table[:nb] + [0] * (max_blocks - nb) for s, nb in zip(seqs, num_blocks)]
    pad_index, query_pos, unpad_index = [], [], []
    offset = 0
    for b, (s, n) in enumerate(zip(seqs, q_lens)):
        pad_index.append([offset + q if q < n else 0 for q in range(Q)])
        # A padding query sees key 0 only, so no attention row is empty (which gives NaN).
        query_pos.append([s.start_pos + q if q < n else 0 for q in range(Q)])
        unpad_index += range(b * Q, b * Q + n)
        offset += n
    return AttnGroup(
        start=start, end=start + offset,
        pad_index=torch.tensor(pad_index, dtype=torch.long, device=device),
        unpad_index=torch.tensor(unpad_index, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        query_pos=torch.tensor(query_pos, dtype=torch.long, device=device),
        start_pos=[s.start_pos for s in seqs],
        block_size=block_size, num_queries_per_kv=g,
    )


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


def _triton_works(device: torch.device, dtype: torch.dtype, cfg: ModelConfig,
                  block_size: int, kv_dtype: torch.dtype) -> bool:
    from servelm.kernels.triton_attention import works

    return works(device, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
                 kv_dtype)


class ModelRunner:
    """Owns the model and the KV cache; runs one step's forward and returns logits."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 cuda_graphs: bool = False, max_graph_batch: int = 256,
                 kernels: KernelConfig | None = None):
        """cuda_graphs: decode steps of up to max_graph_batch rows replay captured CUDA
        graphs (servelm.engine.cuda_graphs); needs a KVCache with a spare block. kernels:
        which of the C++ / Triton paths may run (all, by default)."""
        kernels = kernels or KernelConfig()
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        pin_module_attributes(model)  # weights are final: loaded, quantised or sharded
        cfg: ModelConfig = model.config
        self.num_queries_per_kv = cfg.num_heads // cfg.num_kv_heads
        # The path is decided once: fused C++ kernels (decode attention in place over the
        # block tables, fused norms/rotary/SiLU) on CPU when they build, else the eager
        # PyTorch reference (CUDA, no compiler, kernels.cpu_kernels off). Tests may flip it.
        cpu = torch.device(device).type == "cpu"
        kv_dtype = kv_cache.data.dtype
        # The activations' dtype (a quantised pool's storage dtype is not it).
        dtype = model.norm.weight.dtype if hasattr(model, "norm") else kv_dtype
        if (kernels.cpu_kernels and cpu and kv_dtype == torch.float8_e4m3fn
                and load_ops("ops")):
            raise ValueError("kv_cache_dtype 'fp8' cannot be read by servelm's C++ CPU "
                             "kernels: use kv_cache_dtype 'int8' there, or turn the kernels "
                             "off (cpu_kernels=False, --no-cpu-kernels) to run fp8 on the "
                             "PyTorch reference")
        self.use_kernels = (kernels.cpu_kernels and cpu
                            and kv_dtype in (torch.float32, torch.bfloat16, torch.float16,
                                             torch.int8)
                            and load_ops("ops"))
        if self.use_kernels and kernels.fused_decode and hasattr(model, "bind_decode_layers"):
            model.bind_decode_layers(kv_cache.layers)  # decode-only steps: one C++ call
        # On CUDA, attention reads K/V in place (Triton kernels) when Triton is there and
        # its kernels pass a probe on this shape (and this KV storage dtype).
        self.triton_attention = (kernels.triton_attention and torch.device(device).type == "cuda"
                                 and _triton_works(torch.device(device), dtype, cfg,
                                                   kv_cache.block_size, kv_dtype))
        self.graphs = None
        # A sliding-window layer picks its attention path by the step's context lengths
        # (host data), which a captured graph would freeze: such models decode eagerly.
        windowed = any(getattr(layer.self_attn, "window", None)
                       for layer in getattr(model, "layers", ()))
        if cuda_graphs and windowed:
            logger.info("CUDA graphs off: the model has sliding-window layers")
        if cuda_graphs and not windowed:
            from servelm.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv_cache, device, max_batch=max_graph_batch,
                                       triton_attention=self.triton_attention)

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        """Returns fp32 logits [S, vocab] and, per row, the index in `seqs` it belongs to
        (a sequence with num_logits m has m consecutive rows, its last m positions'; one
        with all_logits a row per token)."""
        if self.graphs is not None and not any(s.all_logits for s in seqs):
            out = self.graphs.execute(seqs)
            if out is not None:
                return out
        if (self.use_kernels and hasattr(self.model, "decode_stack_takes")
                and self.model.decode_stack_takes(self.kv_cache.layers, len(seqs))
                and all(len(s.token_ids) == 1 and s.sample for s in seqs)):
            # Decodes only, on the DecodeStack: its input as plain lists, no ForwardBatch (a
            # one-stream step's small ops and tensors cost 3-5x their time alone there, run
            # on caches the weight stream has just gone through).
            ids, pos, slots, tables, lens, _ = decode_lists(seqs, self.kv_cache.block_size)
            hidden = self.model.decode_step(ids, pos, slots, tables, lens)
            return self.model.compute_logits(hidden), list(range(len(seqs)))
        batch, sampled = build_forward_batch(seqs, self.kv_cache.block_size,
                                             self.num_queries_per_kv, self.device,
                                             kernels=self.use_kernels,
                                             triton_attention=self.triton_attention)
        # Only the rows that sample go through the last layer's o_proj and MLP and the LM
        # head: no logits (or final hidden states) for prompt positions.
        hidden = self.model(batch, self.kv_cache.layers, sampled_only=True)
        logits = self.model.compute_logits(hidden)
        return logits, sampled
