"""One step's attention metadata: the padded groups (AttnGroup), the ragged decode rows
(RaggedDecodes), the flat token lists a backend fills in the order it attends them, and
the ForwardBatch that carries them and the step's tokens to the model."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from servelm.attention.backend import AttentionBackend


@dataclass
class AttnGroup:
    """Sequences whose attention runs as one padded batch (all decodes, or all prefills).

    The group covers the flat tokens [start, end). Its sequences are padded to the
    longest query (Q) and the longest context (L = num_blocks * block_size).
    """

    start: int
    end: int
    pad_index: torch.Tensor     # [B, Q] long: flat token (relative to start) of each padded slot
    unpad_index: torch.Tensor   # [end - start] long: padded slot (b * Q + q) of each flat token
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with block 0 (masked out)
    # [B, Q] long: absolute position of each padded query slot (padding: 0, so it sees key 0).
    query_pos: torch.Tensor
    start_pos: list[int]        # host copy: each sequence's first query position
    block_size: int
    num_queries_per_kv: int     # G: query heads sharing one KV head

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, G * Q, L] bool, True = may attend; rows ordered (group, query). Built on
        first use (the reference's SDPA, once per step); the kernels' causal softmax
        masks from query_pos and never builds it."""
        return self.window_mask(None)

    def window_mask(self, window: int | None, g: int | None = None) -> torch.Tensor:
        """`mask`, and with a sliding window only the last `window` keys (the query's own
        included: key > pos - window); one mask per window, built once a step. g: the
        layer's query heads per KV head where it is not the model's (Gemma 4's global
        layers have their own KV-head count)."""
        masks = self.__dict__.setdefault("_masks", {})
        g = g or self.num_queries_per_kv
        key = window if g == self.num_queries_per_kv else ("g", window, g)
        if key not in masks:
            B, Q = self.query_pos.shape
            keys = torch.arange(self.block_tables.shape[1] * self.block_size,
                                device=self.query_pos.device).view(1, 1, -1)    # [1, 1, L]
            pos = self.query_pos.unsqueeze(-1)                                  # [B, Q, 1]
            mask = keys <= pos                                                  # causal
            if window is not None:
                mask &= keys > pos - window
            masks[key] = mask.unsqueeze(1).expand(B, g, Q, mask.shape[-1]).reshape(B, 1, g * Q, -1)
        return masks[key]

    def fits_window(self, window: int | None) -> bool:
        """Whether no query of the group has a key outside `window` (then windowed
        attention equals causal attention, and kernels without a window may run it)."""
        return window is None or max(self.start_pos) + self.pad_index.shape[1] <= window

    @functools.cached_property
    def context_lens(self) -> torch.Tensor:
        """[B] int32: keys each sequence attends to at its last query (built on first use,
        by the Triton decode attention, and shared by the layers)."""
        return (self.query_pos[:, -1] + 1).to(torch.int32)

    @functools.cached_property
    def prefill_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt-attention kernels' (C++, Triton) int32 view: block tables [B, max_blocks],
        cumulative query counts [B + 1] (each sequence's tokens are consecutive) and first
        positions [B]. Built on the first layer's call and shared by the others."""
        B, Q = self.pad_index.shape
        n = self.end - self.start
        dev = self.block_tables.device
        if n == B * Q:  # every sequence has Q queries
            cu = torch.arange(0, n + 1, Q, dtype=torch.int32, device=dev)
        else:
            cu = torch.zeros(B + 1, dtype=torch.int32, device=dev)
            cu[1:] = torch.bincount(self.unpad_index // Q, minlength=B).cumsum(0)
        return (self.block_tables.to(torch.int32).contiguous(), cu,
                torch.tensor(self.start_pos, dtype=torch.int32, device=dev))


@dataclass
class RaggedDecodes:
    """The step's first `num` flat tokens: single-query rows attended over one int32 block
    table each (ragged lengths, no padding groups): the C++ decode op's, and the
    DecodeStack's, input."""

    num: int
    block_tables: torch.Tensor  # [num, max_blocks] int32
    context_lens: torch.Tensor  # [num] int32


@dataclass
class AttentionMetadata:
    """One step's attention plan, built by `backend` (AttentionBackend.build) from the
    scheduled sequences; each layer hands it back to that backend's forward. `groups`
    cover the flat tokens after the ragged decodes (all of them when there are none)."""

    backend: AttentionBackend
    groups: list[AttnGroup]
    decodes: RaggedDecodes | None = None


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides weights and the cache: explicit, no globals.
    Which implementation each op runs is not here: the model's op modules chose it once
    (servelm.models.layers.select_ops)."""

    input_ids: torch.Tensor       # [T] long, all scheduled tokens flattened
    positions: torch.Tensor       # [T] long
    slot_mapping: torch.Tensor    # [T] long: block_id * block_size + offset of each token's KV
    logits_indices: torch.Tensor  # [S] long: flat tokens whose next-token logits are needed
    # The attention backend's metadata for this step, the backend with it; the flat tokens
    # are in the order that backend attends them.
    attn: AttentionMetadata
    # LoRA: each flat token's and each logits row's adapter slot ([T], [S] int32; -1 none),
    # or None when no sequence of the step has an adapter.
    lora_slots: tuple[torch.Tensor, torch.Tensor] | None = None
    # Linear-attention layers: each sequence's flat tokens and state slot
    # (servelm.models.linear_attention.RecurrentBatch), None for a model without them.
    recurrent: Any = None
    # A hybrid model's further block groups (SeqInput.group_tables): per group, this batch
    # with that group's slots and block tables (group_views); its layers read their own.
    kv_views: list[ForwardBatch] | None = None

    def for_group(self, group: int) -> ForwardBatch:
        """The batch a layer of block group `group` reads (0: this one)."""
        if not group:
            return self
        if not self.kv_views:
            raise ValueError("the pool keeps this model's layers in block groups: each "
                             "sequence needs its group tables (SeqInput.group_tables)")
        return self.kv_views[group - 1]

    def stack_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step's KV slots and int32 block tables as the DecodeStack takes
        them: [M] and [M, W], or with block groups [G * M] and [G, M, W]."""
        tables = self.attn.decodes.block_tables
        if not self.kv_views:
            return self.slot_mapping, tables
        views = [v.attn.decodes.block_tables for v in self.kv_views]
        width = max(t.shape[1] for t in (tables, *views))
        stacked = torch.zeros(1 + len(views), tables.shape[0], width, dtype=torch.int32,
                              device=tables.device)
        for g, t in enumerate((tables, *views)):
            stacked[g, :, :t.shape[1]] = t
        return (torch.cat([self.slot_mapping, *(v.slot_mapping for v in self.kv_views)]),
                stacked)


class FlatTokens:
    """The flat per-token lists of a batch, filled sequence by sequence."""

    def __init__(self, input_ids=None, positions=None, slots=None, logits_indices=None,
                 sampled=None, order=None):
        # The sequences' indices in flat order (each one's tokens are contiguous).
        self.order: list[int] = order if order is not None else []
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

    def add_grouped(self, seqs: list, order: list[int], keys: list, start: int,
                    block_size: int, g: int, device: torch.device) -> list[AttnGroup]:
        """Append seqs[order[j]] in turn (flat tokens from `start`); consecutive ones with
        the same key (keys[j]) form one attention group."""
        groups: list[AttnGroup] = []
        members: list = []
        for j, i in enumerate(order):
            s = seqs[i]
            n = len(s.token_ids)
            self.order.append(i)
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
                grp = build_group(members, start, block_size, g, device)
                groups.append(grp)
                start, members = grp.end, []
        return groups


def bucket(s, block_size: int, ragged: bool = False) -> tuple[bool, int]:
    """Attention group of a sequence (a SeqInput): decodes apart from prompt chunks, and
    within each, contexts of similar length (same power-of-two block count) together, so
    padding every member to the longest context costs at most 2x the keys actually
    attended to. With `ragged` (attention that reads only each row's own keys), one group
    of each."""
    if ragged:
        return len(s.token_ids) > 1, 0
    num_blocks = -(-(s.start_pos + len(s.token_ids)) // block_size)
    return len(s.token_ids) > 1, num_blocks.bit_length()


def build_group(seqs: list, start: int, block_size: int, g: int,
                device: torch.device) -> AttnGroup:
    """One padded AttnGroup of `seqs` (SeqInputs), their flat tokens from `start`."""
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


def decode_lists(dec: list, block_size: int, width: int | None = None, pad_block: int = 0
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


def group_views(batch: ForwardBatch, order: list[int], seqs: list, block_size: int
                ) -> list[ForwardBatch]:
    """For each further block group of a hybrid model (SeqInput.group_tables), `batch`
    with that group's KV slots and block tables: the same flat tokens (`order`: the
    sequences' indices in flat order) and attention groups, only the pages differ."""
    meta, bs = batch.attn, block_size
    device = batch.slot_mapping.device
    views = []
    for g in range(len(seqs[0].group_tables)):
        tables = [s.group_tables[g] for s in seqs]
        slots = []
        for i in order:
            s, t = seqs[i], tables[i]
            slots += [t[p // bs] * bs + p % bs
                      for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
        at, dec = 0, None
        if meta.decodes is not None:
            nd, width = meta.decodes.num, meta.decodes.block_tables.shape[1]
            rows: list[int] = []
            for i in order[:nd]:
                nb = (seqs[i].start_pos + bs) // bs
                rows += tables[i][:nb] + [0] * (width - nb)
            dec = replace(meta.decodes, block_tables=torch.tensor(
                rows, dtype=torch.int32, device=device).view(nd, width))
            at = nd
        groups = []
        for grp in meta.groups:
            B, width = grp.block_tables.shape
            rows = []
            for i in order[at:at + B]:
                nb = -(-(seqs[i].start_pos + len(seqs[i].token_ids)) // bs)
                rows.append(tables[i][:nb] + [0] * (width - nb))
            at += B
            groups.append(replace(grp, block_tables=torch.tensor(rows, dtype=torch.long,
                                                                 device=device)))
        views.append(replace(batch, slot_mapping=torch.tensor(slots, dtype=torch.long,
                                                              device=device),
                             attn=AttentionMetadata(meta.backend, groups, dec)))
    return views


def decode_group_lists(dec: list, block_size: int, width: int) -> tuple[list[int], list[int]]:
    """decode_lists' KV slots and block tables (`width` blocks a row) in each further block
    group of a hybrid model (SeqInput.group_tables), group after group."""
    slots: list[int] = []
    tables: list[int] = []
    for g in range(len(dec[0].group_tables) if dec else 0):
        for s in dec:
            t = s.group_tables[g]
            nb = (s.start_pos + block_size) // block_size
            tables += t[:nb]
            tables += [0] * (width - nb)
            slots.append(t[s.start_pos // block_size] * block_size + s.start_pos % block_size)
    return slots, tables
