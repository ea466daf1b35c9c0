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


def test_forward_batch_carries_no_path_choice():
    """ForwardBatch lives beside the attention metadata it carries; which op runs is the
    model's, chosen once, not a flag on every step's batch."""
    import dataclasses

    from servelm.attention import metadata

    names = [f.name for f in dataclasses.fields(metadata.ForwardBatch)]
    # (lora_slots: data, each row's adapter slot; recurrent: each sequence's tokens and
    # state slot for linear attention; kv_views: a hybrid's block groups' slots and tables;
    # none a choice of path.)
    assert names == ["input_ids", "positions", "slot_mapping", "logits_indices", "attn",
                     "lora_slots", "recurrent", "kv_views"]
    assert build_forward_batch.__annotations__["return"].startswith("tuple[ForwardBatch")


def _tiny_model(qk_norm=False, rotary_dim=None):
    from servelm.models.config import ModelConfig
    from servelm.models.decoder import CausalLM

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=256, qk_norm=qk_norm,
                      rotary_dim=rotary_dim)
    torch.manual_seed(0)
    model = CausalLM(cfg, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def test_op_modules_are_bound_to_their_implementation_once_built():
    """The ModelRunner selects every op module's implementation at construction: with the
    C++ kernels a model's norms, rotary + KV write and SwiGLU activation are servelm_ops'
    (the per-head q/k norms a head a row), without them the PyTorch references; the
    forwards take no flag, the choice survives pinning, and the same tokens' hidden states
    agree between the two."""
    import inspect

    from servelm.config import KernelConfig
    from servelm.engine.model_runner import KVCache, ModelRunner
    from servelm.kernels import load_ops
    from servelm.models import layers as L

    for fn in (L.RMSNorm.forward, L.RMSNorm.add_forward, L.GatedMLP.forward):
        assert "kernels" not in inspect.signature(fn).parameters
    cpu = torch.device("cpu")
    built = _tiny_model(qk_norm=True)
    assert all(not m.uses_kernels for m in built.modules() if isinstance(m, L.OpModule))
    kv = KVCache(built.config, 8, BS, torch.float32, cpu)
    ref = ModelRunner(built, kv, cpu, kernels=KernelConfig(cpu_kernels=False, tuning="off"))
    layer = ref.model.layers[0]
    assert ref.model.norm.__dict__["_norm"] is L.rms_norm_ref
    assert layer.self_attn.__dict__["_qkv"] is L.qkv_ref
    assert layer.mlp.__dict__["_mlp"] is L.mlp_ref
    assert layer.self_attn.q_norm._norm is L.rms_norm_ref
    seqs = [SeqInput(list(range(1, 12)), 0, [0])]
    want, _ = ref.execute(seqs)
    if not load_ops("ops"):
        return
    ops = torch.ops.servelm_ops
    model = _tiny_model(qk_norm=True)
    run = ModelRunner(model, KVCache(model.config, 8, BS, torch.float32, cpu), cpu,
                      kernels=KernelConfig(attention_backend="reference", tuning="off"))
    layer = model.layers[0]
    assert model.norm.__dict__["_norm"] is ops.rms_norm
    assert layer.input_layernorm.__dict__["_add_norm"] is ops.fused_add_rms_norm
    assert layer.self_attn._qkv is L.qkv_kernels
    assert layer.self_attn._rotary_kv_write is ops.rotary_kv_write
    assert layer.self_attn.q_norm._norm is L.head_rms_norm  # per head, a head a row
    assert layer.mlp._mlp is L.mlp_kernels and layer.mlp._silu_mul is ops.silu_and_mul
    got, _ = run.execute(seqs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The runner's switch (tests compare the paths on one runner) selects every op again.
    run.use_kernels = False
    assert model.norm._norm is L.rms_norm_ref and layer.self_attn._qkv is L.qkv_ref
    run.use_kernels = True
    assert model.norm._norm is ops.rms_norm
    # A partial rotary runs the reference rotary + KV write on the kernels' layout.
    partial = _tiny_model(rotary_dim=4)
    L.select_ops(partial, True)
    assert partial.layers[0].self_attn._rotary_kv_write is L.rotary_kv_write_ref
