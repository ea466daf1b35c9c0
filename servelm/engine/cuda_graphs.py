"""Captured decode steps: one CUDA graph replay per decode step instead of a launch per kernel.

A decode step of a small model is bound on a GPU by launching kernels, not by the GPU: the
eager step of a 30-layer model launches several dozen kernels a layer (the reference norms,
rotary and attention gathers are a few small ops each), each of which takes the
host several microseconds to launch and the GPU about one to run. A CUDA graph records one
step's kernels once and replays them all with one launch. Graphs have fixed shapes and fixed
addresses, so here:

- a step's inputs go into one static device buffer with one host-to-device copy: token ids,
  positions, KV slots and block tables, laid out for the graph's batch size and table width;
- the batch is padded up to a captured size (`graph_batch_sizes`, at most 1.5x); a padding
  row computes a token at position 0 of the KV pool's spare block (`KVCache.pad_block`),
  which no sequence owns, so it writes nothing anyone reads;
- every row's block table is padded to the batch's longest, rounded up to one of four
  widths per power of two (`table_width`: at most 1.25x); the Triton decode attention
  reads each row's keys only (its grid depends on batch and width alone), the gather +
  SDPA path (no Triton) reads the padded tables and masks past each row's position;
- so there is one graph per (batch size, table width), captured the first time a step needs
  it (a warm-up forward, then the capture; both recompute the same K/V into the same slots,
  so capturing in the middle of serving is harmless), all sharing one memory pool.

Steps where every row computes one token (decodes, and one-token prompt chunks) of at most
`max_batch` rows replay a graph; other steps (prompt chunks, larger batches, and batches
whose padded tables would hold more than MAX_KEY_PADDING times the keys their rows attend
to, such as one long context among many short ones, unless attention is Triton's) run
the eager model, which groups rows of similar lengths. A capture that fails (out of memory,
an op that cannot be captured) is logged and its shape runs eagerly from then on. `capture=False` runs the same
padded static-buffer forward without capturing: the CPU tests check everything but the
capture itself that way.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from servelm.attention import AttentionBackend, AttentionMetadata, AttnGroup, get_backend
from servelm.attention.metadata import ForwardBatch, decode_lists

logger = logging.getLogger(__name__)

# Without the Triton attention, a step replays a graph only if its padded block tables hold
# at most this many times the keys its rows attend to (plus a few blocks): the gather +
# SDPA attention reads every padded key.
MAX_KEY_PADDING = 4


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes up to max_batch: 1, 2, 4, 8, then steps of at most 1.5x
    (12, 16, 24, 32, 48, 64, ...), and max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b * 3 // 2 if b & (b - 1) == 0 else 1 << b.bit_length()
    return sizes + [max_batch]


def table_width(blocks: int) -> int:
    """Captured block-table width for a batch whose longest row needs `blocks` blocks:
    rounded up to a multiple of a quarter of the power of two below it (1..8 exactly, then
    10, 12, 14, 16, 20, 24, ...), so a graph's attention reads at most 1.25x the blocks the
    longest row needs while contexts grow through only four widths per doubling."""
    step = 1 << max(0, blocks.bit_length() - 3)
    return -(-blocks // step) * step


class DecodeGraphs:
    """Runs one-token-per-row steps through captured (or, with capture=False, static-buffer)
    forwards of `model` over `kv_cache`; see the module docstring."""

    def __init__(self, model: torch.nn.Module, kv_cache, device: torch.device,
                 max_batch: int = 256, capture: bool = True,
                 attention: AttentionBackend | None = None):
        """attention: the runner's backend (default the reference); one that reads each
        row's own keys in place (Triton) makes padded tables cost nothing, so any batch of
        decodes may replay a graph."""
        if kv_cache.pad_block is None:
            raise ValueError("CUDA graphs need a KV cache with a spare block (spare_block=True)")
        if capture and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_cache, self.device = model, kv_cache, torch.device(device)
        self.capture = capture
        self.attention = attention or get_backend("reference")
        if self.attention.ragged_decodes:  # its decodes are ragged rows, not one padded group
            raise ValueError("CUDA graphs take the reference or triton attention backend")
        self.block_size = bs = kv_cache.block_size
        self.pad_block = kv_cache.pad_block
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.max_batch = max_batch
        cfg = model.config
        self.num_queries_per_kv = cfg.num_heads // cfg.cache_layout[1]  # the cache's KV heads
        max_positions = model.rotary.cos.shape[0]
        self.max_blocks = 1 << (-(-max_positions // bs) - 1).bit_length()
        # Inputs of every graph: ids, positions, slots (B each), then tables (B x width).
        self._buf = torch.zeros(max_batch * (3 + self.max_blocks), dtype=torch.long,
                                device=self.device)
        self._arange = torch.arange(max_batch, dtype=torch.long, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, Callable | None,
                                                  torch.Tensor | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_captured = 0

    def _padded_batch(self, n: int) -> int:
        return next(b for b in self.batch_sizes if b >= n)

    def _forward(self, B: int, W: int) -> torch.Tensor:
        """The step for B rows and block tables W wide, reading only the static buffer:
        fp32 logits [B, vocab] (the model's compute_logits: its scaling and soft-cap too)."""
        buf = self._buf
        positions = buf[B:2 * B]
        group = AttnGroup(start=0, end=B, pad_index=self._arange[:B].view(B, 1),
                          unpad_index=self._arange[:B],
                          block_tables=buf[3 * B:3 * B + B * W].view(B, W),
                          query_pos=positions.view(B, 1),
                          start_pos=[],  # only the C++ prompt kernels read it
                          block_size=self.block_size,
                          num_queries_per_kv=self.num_queries_per_kv)
        batch = ForwardBatch(input_ids=buf[:B], positions=positions,
                             slot_mapping=buf[2 * B:3 * B], logits_indices=self._arange[:B],
                             attn=AttentionMetadata(self.attention, [group]))
        hidden = self.model(batch, self.kv_cache.layers)
        return self.model.compute_logits(hidden)

    def _get(self, B: int, W: int):
        key = (B, W)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(B, W)
        return entry

    def _capture(self, B: int, W: int):
        if not self.capture:
            return None, lambda: self._forward(B, W), None
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        try:
            # Warm-up outside the capture: lazy initialisation (cuBLAS workspaces, kernel
            # selection) must not happen while capturing.
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                self._forward(B, W)
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(B, W)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            logger.warning("CUDA graph capture for batch %d, %d blocks failed (%s); "
                           "that shape runs eagerly", B, W, e)
            torch.cuda.synchronize(self.device)
            return None, lambda: self._forward(B, W), None
        self.num_captured += 1
        logger.debug("captured a decode graph: batch %d, %d blocks", B, W)
        return graph, None, out

    @torch.inference_mode()
    def execute(self, seqs) -> tuple[torch.Tensor, list[int]] | None:
        """fp32 logits of the sampled rows and their indices in `seqs` (as
        ModelRunner.execute), or None when this step is not one a graph runs."""
        n = len(seqs)
        if n > self.max_batch or any(len(s.token_ids) != 1 for s in seqs):
            return None
        bs, pad = self.block_size, self.pad_block
        B = self._padded_batch(n)
        W = table_width(max(s.start_pos // bs + 1 for s in seqs))
        attended = sum(s.start_pos + 1 for s in seqs)
        if W > self.max_blocks or (not self.attention.reads_in_place
                                   and B * W * bs > MAX_KEY_PADDING * attended + 64 * bs):
            return None
        ids, pos, slots, tables, _, _ = decode_lists(seqs, bs, width=W, pad_block=pad)
        fill = B - n
        host = (ids + [0] * fill + pos + [0] * fill + slots + [pad * bs] * fill
                + tables + [pad] * (W * fill))
        self._buf[:len(host)].copy_(torch.tensor(host, dtype=torch.long), non_blocking=True)
        graph, fn, out = self._get(B, W)
        if graph is not None:
            graph.replay()
        else:
            out = fn()
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        logits = out[:n] if len(sampled) == n else out[:n][sampled]
        # A copy: the graph's output is overwritten by the next replay.
        return logits.to(torch.float32, copy=True), sampled
