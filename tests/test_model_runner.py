"""Batch building: grouping for attention, slots, and which rows get logits (no model)."""

from __future__ import annotations

import torch

from servelm.engine.model_runner import SeqInput, build_forward_batch

BS = 16


def _table(n_blocks, first):
    return list(range(first, first + n_blocks))


def test_decodes_of_very_different_lengths_are_not_padded_together():
    seqs = [SeqInput([5], 19, _table(2, 0)),            # context 20: 2 blocks
            SeqInput([6], 1999, _table(125, 10)),       # context 2000: 125 blocks
            SeqInput([7], 24, _table(2, 200)),          # context 25: 2 blocks
            SeqInput([8, 9, 10], 0, _table(1, 300))]    # a 3-token prompt
    batch, sampled = build_forward_batch(seqs, BS, 3, torch.device("cpu"))
    # Two decode groups (2 blocks; 125 blocks) and the prompt: nobody is padded to 2,000 keys
    # but the one sequence that attends to them.
    assert [(g.end - g.start, g.block_tables.shape[1] * BS) for g in batch.attn.groups] == \
        [(2, 32), (1, 2000), (3, 16)]
    # Flat order: decodes (short bucket, long bucket) then the prompt; rows map back.
    assert batch.input_ids.tolist() == [5, 7, 6, 8, 9, 10]
    assert sampled == [0, 2, 1, 3]
    assert batch.logits_indices.tolist() == [0, 1, 2, 5]
    # Slot of position p is block_table[p // BS] * BS + p % BS.
    assert batch.slot_mapping.tolist()[:3] == [1 * BS + 3, 201 * BS + 8, (10 + 124) * BS + 15]
    assert batch.positions.tolist() == [19, 24, 1999, 0, 1, 2]


def test_chunk_that_does_not_sample_has_no_logits_row():
    seqs = [SeqInput(list(range(32)), 0, _table(2, 0), sample=False),
            SeqInput([1], 40, _table(3, 5))]
    batch, sampled = build_forward_batch(seqs, BS, 3, torch.device("cpu"))
    assert sampled == [1] and batch.logits_indices.tolist() == [0]
    prefill = batch.attn.groups[-1]
    # Causal: query q of the chunk sees keys 0..q only.
    m = prefill.mask[0, 0]  # rows ordered (group head, query)
    assert m[0].nonzero().flatten().tolist() == [0]
    assert m[31].nonzero().flatten().tolist() == list(range(32))
