"""The roofline model: textbook figures, the embedded model's sizes, phase labels, the CLI."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from servelm import roofline as rl
from servelm.models.loader import open_checkpoint

GPU = rl.Hardware(bandwidth=2000e9, flops=990e12)
CPU = rl.Hardware(bandwidth=30e9, flops=2.3e12)


def test_textbook_7b_at_16_bits():
    m = rl.ModelShape(num_params=7_000_000_000, weight_bits=16)
    assert m.weight_bytes_per_step == pytest.approx(14e9)
    step = rl.predict_decode(m, GPU, batch=1, context=0)
    assert step.seconds == pytest.approx(7e-3)
    assert 1 / step.seconds == pytest.approx(142.9, abs=0.1)
    assert step.bound == "memory"


def test_embedded_model_sizes(gguf_path):
    cfg = open_checkpoint(gguf_path).config()
    m = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=16)
    assert 134e6 < m.num_params < 136e6  # SmolLM2-135M, tied embeddings counted once
    assert m.weight_bytes_per_step == pytest.approx(m.num_params * 2)
    # Only the 3 KV heads are cached, not the 9 query heads.
    assert m.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert 1 / rl.predict_decode(m, CPU, 1, 0).seconds == pytest.approx(30e9 / (m.num_params * 2))


def test_phases_are_labelled_by_what_limits_them():
    m = rl.ModelShape(num_params=135_000_000, weight_bits=16, num_layers=30, num_kv_heads=3,
                      head_dim=64, num_heads=9)
    assert rl.predict_decode(m, CPU, batch=1, context=512).bound == "memory"
    assert rl.predict_prefill(m, CPU, 512).bound == "compute"
    # Batching amortises the weights: throughput rises with batch until compute or KV dominates.
    tps = [b / rl.predict_decode(m, CPU, b, 512).seconds for b in (1, 4, 16, 64)]
    assert tps == sorted(tps) and tps[-1] > 10 * tps[0]
    # Quantised weights cut the bytes per step and so the memory-bound decode time.
    m4 = rl.ModelShape(num_params=135_000_000, weight_bits=4)
    assert rl.predict_decode(m4, CPU, 1, 0).seconds == pytest.approx(
        rl.predict_decode(rl.ModelShape(num_params=135_000_000, weight_bits=16), CPU, 1, 0)
        .seconds / 4)


def test_prefill_charges_the_lm_head_and_last_layer_tail_once(gguf_path):
    # 512 prompt tokens go through every layer up to the last one's attention; only the last
    # token through the last layer's o_proj and MLP and the LM head.
    cfg = open_checkpoint(gguf_path).config()
    m = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=16)
    head = 2 * 49152 * 576
    tail = 2 * (576 * 576 + 3 * 576 * 1536)  # o_proj, gate/up/down
    assert m.lm_head_flops == head and m.sampled_row_flops == head + tail
    assert m.prefill_flops(512, 256) == pytest.approx(
        512 * m.flops_per_token(256) - 511 * (head + tail))
    assert m.prefill_flops(32, 100, sampled_rows=0) == pytest.approx(
        32 * (m.flops_per_token(100) - head - tail))
    p = rl.predict_prefill(m, CPU, 512)
    assert p.compute_seconds == pytest.approx(m.prefill_flops(512, 256) / CPU.flops)
    assert rl.ModelShape(num_params=10, weight_bits=16).lm_head_flops == 0  # shape unknown
    assert rl.ModelShape(num_params=10, weight_bits=16, vocab_size=8,
                         hidden_size=4).sampled_row_flops == 64  # layer sizes unknown: the head


def test_max_batch_from_the_kv_pool():
    m = rl.ModelShape(num_params=1, weight_bits=16, num_layers=2, num_kv_heads=1, head_dim=4)
    assert m.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    assert rl.max_batch(m, kv_pool_bytes=32 * 100 * 10, context=100) == 10


def test_measure_hardware_gives_positive_rates():
    hw = rl.measure_hardware("float32", "cpu", seconds=0.05)
    assert hw.bandwidth > 1e8 and hw.flops > 1e9
    assert hw.int8_ops is None or hw.int8_ops > 1e9  # int8 x int8 -> int32 where it runs
    from servelm.layers import q8act

    assert (hw.q8act_ops is not None and hw.q8act_ops > 1e9) == q8act.available()
    from servelm.layers import w8a8

    assert (hw.w8a8_ops is not None and hw.w8a8_ops > 1e9) == (w8a8.available()
                                                               and w8a8.int8_dot())


def test_the_w8a8_roof_is_its_fastest_form(monkeypatch):
    """Where another form runs too (the pair form, AMX-INT8's tiles), the roof is the fastest
    form's rate; a form that does not run here (None) is left out, and none running gives
    None."""
    rates = {"w8a8": 0.8e12, "w8a8_pairs": 1.1e12, "w8a8_amx": 3.2e12}
    monkeypatch.setattr(rl, "_method_ops", lambda dev, best, m: rates[m])
    assert rl._w8a8_ops(None, None) == 3.2e12
    rates["w8a8_amx"] = None
    assert rl._w8a8_ops(None, None) == 1.1e12
    rates["w8a8_pairs"] = None
    assert rl._w8a8_ops(None, None) == 0.8e12
    rates["w8a8"] = None
    assert rl._w8a8_ops(None, None) is None


def test_the_int8_roof_bounds_prompts_on_int8_activations():
    m = rl.ModelShape(num_params=135e6, weight_bits=4.5, num_layers=30, num_kv_heads=3,
                      head_dim=64, num_heads=9, hidden_size=576, vocab_size=49152,
                      tied_embeddings=True)
    hw = rl.Hardware(bandwidth=50e9, flops=0.4e12, int8_ops=1.6e12)
    int8 = rl.int8_hardware(hw)
    assert int8.flops == 1.6e12 and int8.bandwidth == hw.bandwidth
    assert rl.int8_hardware(CPU) is None  # not measured: no int8 roof
    # A 2,048-token prompt is compute-bound: four times the rate, a quarter of the time.
    p, p8 = rl.predict_prefill(m, hw, 2048), rl.predict_prefill(m, int8, 2048)
    assert p.bound == "compute" and p8.seconds == pytest.approx(p.seconds / 4, rel=0.05)
    text = rl.report(m, hw, prompt_lens=(2048,))
    assert "int8 matmul: 1.60 TOP/s (4.0x)" in text and "q8act:" not in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["2048"])
    assert row.split() == ["2048", f"{p.seconds * 1e3:.1f}ms", "compute", f"{p8.seconds * 1e3:.1f}ms"]


def test_the_int8_column_is_the_q8act_kernels_roof_where_measured():
    """q8act's blocks of 32 run under the whole-row int8 roof: where its rate is known,
    that is the roof of the layers on int8 activations, and the column's prediction."""
    m = rl.ModelShape(num_params=135e6, weight_bits=4.5, num_layers=30, num_kv_heads=3,
                      head_dim=64, num_heads=9, hidden_size=576, vocab_size=49152,
                      tied_embeddings=True)
    hw = rl.Hardware(bandwidth=50e9, flops=0.4e12, int8_ops=0.8e12, q8act_ops=0.5e12)
    int8 = rl.int8_hardware(hw)
    assert int8.flops == 0.5e12
    assert rl.int8_hardware(rl.Hardware(50e9, 0.4e12, q8act_ops=0.5e12)).flops == 0.5e12
    p8 = rl.predict_prefill(m, int8, 2048)
    text = rl.report(m, hw, prompt_lens=(2048,))
    assert "int8 matmul: 0.80 TOP/s (2.0x)" in text and "q8act: 0.50 TOP/s (1.2x)" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["2048"])
    assert row.split()[-1] == f"{p8.seconds * 1e3:.1f}ms"
    assert "int8" not in rl.report(m, CPU)


def test_the_int8_column_blends_w8a8_on_its_layers_with_the_rest():
    """On quantised weights w8a8 runs qkv, o and gate_up (their share of a layer's FLOPs from
    the model's sizes), down_proj stays on q8act: the int8 column's rate is the FLOP-weighted
    harmonic blend of the two. On bf16 weights it runs down_proj too: w8a8's rate alone."""
    m = rl.ModelShape(num_params=135e6, weight_bits=4.5, num_layers=30, num_kv_heads=3,
                      head_dim=64, num_heads=9, hidden_size=576, vocab_size=49152,
                      tied_embeddings=True, intermediate_size=1536)
    share = rl.w8a8_share(m)
    want = (576 * 960 + 576 * 576 + 2 * 576 * 1536) / (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert share == pytest.approx(want)
    hw = rl.Hardware(bandwidth=50e9, flops=0.4e12, int8_ops=0.8e12, q8act_ops=0.5e12,
                     w8a8_ops=0.75e12)
    rate = rl.int8_hardware(hw, m).flops
    assert rate == pytest.approx(1 / (share / 0.75e12 + (1 - share) / 0.5e12))
    bf16 = dataclasses.replace(m, weight_bits=16)
    assert rl.w8a8_share(bf16) == 1.0
    assert rl.int8_hardware(hw, bf16).flops == pytest.approx(0.75e12)
    assert rl.int8_hardware(hw).flops == 0.5e12  # no sizes: q8act's
    assert rl.w8a8_share(dataclasses.replace(m, intermediate_size=None)) == 0.0
    text = rl.report(m, hw, prompt_lens=(2048,))
    assert "w8a8: 0.75 TOP/s (1.9x)" in text and f"the int8 column at {rate / 1e12:.2f}" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["2048"])
    assert row.split()[-1] == f"{rl.predict_prefill(m, rl.int8_hardware(hw, m), 2048).seconds * 1e3:.1f}ms"


def test_the_probe_sizes_its_matmul_to_the_budget(monkeypatch):
    """A dtype the CPU runs slowly (bf16 emulated without AVX512-BF16 took minutes a 2048
    matmul, at every `servelm serve` start) is probed on a smaller matmul: one no larger
    than the budget's worth of time, whatever the CPU."""
    import torch

    sizes = []
    real = torch.randn

    def spy(*shape, **kw):
        sizes.append(shape[0])
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "randn", spy)
    slow = torch.Tensor.__matmul__

    def slow_matmul(a, b):  # a CPU where every matmul costs 0.1 s
        import time
        time.sleep(0.1)
        return slow(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", slow_matmul)
    hw = rl.measure_hardware("float32", "cpu", seconds=0.5)
    assert max(sizes) == 256 and hw.flops > 0


def _roofline(capsys, *args):
    """`servelm roofline ARGS` in this process (the entry point itself runs as a process in
    test_formats.py): its exit status, stdout and stderr."""
    from servelm.cli import main

    try:
        rc = main(["roofline", *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def test_cli_from_a_description(capsys):
    r = _roofline(capsys, "--params", "7e9", "--bits", "16", "--bandwidth", "2000", "--flops", "990")
    assert r.returncode == 0, r.stderr
    assert "weight bytes read per decode step: 14.00 GB" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["1"])
    assert row.split()[1:] == ["7.00ms", "142.9", "memory"]


def test_cli_on_the_embedded_model(capsys):
    r = _roofline(capsys, "--bandwidth", "30", "--flops", "2.3", "--dtype", "bfloat16",
                  "--kv-cache-memory", "1GiB")
    assert r.returncode == 0, r.stderr
    assert "KV cache per token (3 KV heads): 23.04 KB" in r.stdout
    assert "compute" in r.stdout and "memory" in r.stdout and "holds" in r.stdout


def test_cli_rejects_bad_numbers(capsys):
    r = _roofline(capsys, "--bandwidth", "-3", "--flops", "1")
    assert r.returncode == 2 and "--bandwidth" in r.stderr


def test_moe_reads_its_chosen_experts_and_multiplies_only_active_weights():
    from servelm.models.config import ModelConfig

    # Qwen3-30B-A3B's shape: 30.5 B parameters, 3.3 B active.
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", family="qwen3_moe", vocab_size=151936,
                      hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                      num_kv_heads=4, head_dim=128, max_position_embeddings=4096, qk_norm=True,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    assert round(cfg.num_params / 1e9, 1) == 30.5 and round(cfg.num_active_params / 1e9, 1) == 3.4
    m = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=16)
    embed = cfg.vocab_size * cfg.hidden_size  # untied: the input embedding is only indexed
    assert m.weight_bytes(1) == pytest.approx((cfg.num_active_params - embed) * 2)
    assert m.flops_per_token() == pytest.approx(2 * (cfg.num_active_params - embed))
    # More tokens a step reach more experts, up to all of them.
    sizes = [m.weight_bytes(b) for b in (1, 8, 64, 4096)]
    assert sizes == sorted(sizes) and sizes[-1] == pytest.approx((cfg.num_params - embed) * 2)
    dense = rl.ModelShape.from_config(ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64),
        weight_bits=16, kv_bits=16)
    assert dense.weight_bytes(1) == dense.weight_bytes(64) == dense.weight_bytes_per_step
    # int4 weights in groups of 64 with int4 experts in groups of 32.
    q = rl.ModelShape.from_config(cfg, weight_bits=4.5, kv_bits=16,
                                  expert_bits=rl.quantized_expert_bits("int4"))
    experts = cfg.expert_params * 8 / 128
    assert q.weight_bytes(1) == pytest.approx(
        (cfg.num_active_params - embed - experts) * 4.5 / 8 + experts * 5 / 8)
    assert rl.quantized_expert_bits("int8") == 8
    assert rl.quantized_expert_bits(None) is None


def test_a_per_layer_embedding_table_is_indexed_not_read():
    """Gemma 4's per-layer embedding table (vocab x layers x P) is looked up a row a token,
    as the input embedding is: neither read whole a step nor multiplied."""
    from servelm.models.config import ModelConfig

    kw = dict(architecture="Gemma4ForCausalLM", family="gemma4", vocab_size=1000,
              hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=1,
              head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    plain = ModelConfig(**kw)
    ple = ModelConfig(**kw, extra=dict(per_layer_input_size=8, per_layer_vocab_size=1000))
    table = 1000 * 4 * 8
    assert ple.lookup_params == table and plain.lookup_params == 0
    a, b = (rl.ModelShape.from_config(c, weight_bits=16, kv_bits=16) for c in (plain, ple))
    # The rest of the per-layer inputs (projections, norms, each layer's gate and projection)
    # are read and multiplied like any weight.
    rest = ple.num_params - plain.num_params - table
    assert rest == 64 * 4 * 8 + 8 + 4 * (2 * 64 * 8 + 64)
    assert b.weight_bytes(1) == pytest.approx(a.weight_bytes(1) + 2 * rest)
    assert b.flops_per_token() == pytest.approx(a.flops_per_token() + 2 * rest)


def test_windowed_layers_read_at_most_their_window():
    """Sliding layers read at most their window of KV (and spend attention FLOPs on it
    alone); a model whose every layer slides holds only about its window in the pool, and a
    hybrid one in block groups its window in the sliding layers."""
    from servelm.models.config import ModelConfig

    base = dict(architecture="Gemma3ForCausalLM", vocab_size=1000, hidden_size=256,
                intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=1,
                head_dim=64, max_position_embeddings=8192, sliding_window=512)
    hybrid = rl.ModelShape.from_config(ModelConfig(
        **base, layer_types=("sliding_attention",) * 5 + ("full_attention",)),
        weight_bits=16, kv_bits=16)
    full = rl.ModelShape.from_config(ModelConfig(**{**base, "sliding_window": None}),
                                     weight_bits=16, kv_bits=16)
    assert hybrid.kv_windows == (512,) * 5 + (0,) and full.kv_windows == ()
    assert hybrid.kv_bytes_per_token == full.kv_bytes_per_token == 6 * 2 * 64 * 2
    per_key = 2 * 64 * 2
    assert hybrid.kv_read_bytes(4096) == per_key * (5 * 512 + 4096)
    assert full.kv_read_bytes(4096) == per_key * 6 * 4096
    assert hybrid.kv_read_bytes(100) == full.kv_read_bytes(100)  # inside every window
    assert (hybrid.flops_per_token(4096) - hybrid.flops_per_token(0)
            == 4 * 4 * 64 * (5 * 512 + 4096))
    hw = rl.Hardware(50e9, 1e12)
    assert rl.predict_decode(hybrid, hw, 8, 4096).seconds < rl.predict_decode(full, hw, 8, 4096).seconds
    # Every layer sliding (Mistral-style): a sequence holds about its window.
    mistral = rl.ModelShape.from_config(ModelConfig(
        **{**base, "architecture": "MistralForCausalLM"},
        layer_types=("sliding_attention",) * 6), weight_bits=16, kv_bits=16)
    pool = 100 * 4096 * mistral.kv_bytes_per_token
    assert rl.max_batch(full, pool, 4096) == 100
    # In block groups (the default), its global layer holds every key, its five sliding
    # ones their window; in one table, every layer every key.
    assert hybrid.kv_window_groups and hybrid.kv_held_tokens(4096) == -(-(4096 + 5 * 512) // 6)
    assert rl.max_batch(hybrid, pool, 4096) == 100 * 4096 * 6 // (4096 + 5 * 512)
    one_table = rl.ModelShape.from_config(ModelConfig(
        **base, layer_types=("sliding_attention",) * 5 + ("full_attention",)),
        weight_bits=16, kv_bits=16, window_groups=False)
    assert rl.max_batch(one_table, pool, 4096) == 100
    assert rl.max_batch(mistral, pool, 4096) == 800


def test_layers_of_differing_kv_widths_count_each_its_own():
    """Gemma 4: global layers of twice the head size beside sliding ones. A token's KV, a
    step's reads and a sequence's held tokens count each layer at its own width (before,
    every layer at the model's head size)."""
    from dataclasses import replace

    from servelm.models.config import ModelConfig

    cfg = ModelConfig(architecture="Gemma4ForCausalLM", family="gemma4", vocab_size=1000,
                      hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4,
                      num_kv_heads=1, head_dim=64, max_position_embeddings=8192,
                      sliding_window=512, layer_types=("sliding_attention",) * 5
                      + ("full_attention",), layer_head_dims=(64,) * 5 + (128,),
                      layer_kv_heads=(1,) * 6)
    m = rl.ModelShape.from_config(cfg, weight_bits=16, kv_bits=16)
    assert m.kv_widths == (64,) * 5 + (128,)
    assert m.kv_bytes_per_token == 2 * (5 * 64 + 128) * 2
    assert m.kv_read_bytes(4096) == 2 * 2 * (5 * 64 * 512 + 128 * 4096)
    assert m.kv_read_bytes(100) == 100 * m.kv_bytes_per_token  # inside every window
    # In block groups: the global layer's every token, the sliding ones' window, by bytes.
    assert m.kv_held_tokens(4096) == -(-(128 * 4096 + 5 * 64 * 512) // (5 * 64 + 128))
    pool = 10 * 4096 * m.kv_bytes_per_token
    assert rl.max_batch(m, pool, 4096) == pool // (m.kv_bytes_per_token * m.kv_held_tokens(4096))
    assert m.flops_per_token(4096) - m.flops_per_token(0) == 4 * 4 * (5 * 64 * 512 + 128 * 4096)
    uniform = rl.ModelShape.from_config(replace(cfg, layer_head_dims=(), layer_kv_heads=()),
                                        weight_bits=16, kv_bits=16)
    assert uniform.kv_widths == uniform.attn_layers == ()
    assert uniform.kv_bytes_per_token == 2 * 6 * 64 * 2
    # Layer 4 reads layer 3's cache (KV-shared): it holds none, but reads and attends as
    # its source does.
    shared = rl.ModelShape.from_config(replace(cfg, kv_source_layers=(0, 1, 2, 3, 3, 5)),
                                       weight_bits=16, kv_bits=16)
    assert shared.kv_bytes_per_token == 2 * (4 * 64 + 128) * 2
    assert shared.kv_read_bytes(4096) == m.kv_read_bytes(4096)
    assert shared.flops_per_token(4096) - shared.flops_per_token(0) == (
        m.flops_per_token(4096) - m.flops_per_token(0))
