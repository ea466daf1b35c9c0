"""The triton backend: CUDA paged attention in Triton (servelm/kernels/triton_attention.py),
K/V read in place through the block tables. One group of decodes (split-K, merged by
log-sum-exp) and one of prompt chunks (causal flash-style tiles), ragged, never padded to
the longest row, with any sliding window, attention chunk, soft-cap and sinks. Tests run it
in Triton's interpreter on CPU tensors."""

from __future__ import annotations

from servelm.attention.backend import AttentionBackend, AttentionSpec, per_group
from servelm.attention.reference import build_grouped


class TritonBackend(AttentionBackend):
    name = "triton"
    options = frozenset({"softcap", "sinks", "chunk"})
    reads_in_place = True

    def unsupported(self, spec: AttentionSpec) -> str | None:
        from servelm.kernels import triton_attention as ta

        if spec.device.type != "cuda":
            return f"the Triton kernels run on CUDA, not {spec.device.type}"
        if lack := spec.kernels_lack(self.options):
            return f"the Triton attention kernels do not {lack}"
        if not ta.available():
            return "Triton is not installed"
        # Both kernels must compile for each layer's shape here and agree with the references.
        for kvh, d in spec.shapes():
            if not ta.works(spec.device, spec.dtype, spec.num_heads, kvh, d, spec.block_size,
                            spec.kv_dtype, spec.asks()):
                return (f"its kernels failed their probe on {kvh} KV heads of {d} dims "
                        f"(see the log)")
        return None

    def build(self, seqs, block_size, num_queries_per_kv, device):
        return build_grouped(self, seqs, block_size, num_queries_per_kv, device, ragged=True)

    def forward(self, layer, q, k_cache, v_cache, scales, meta):
        from servelm.kernels import triton_attention as ta

        opts = dict(window=layer.window, chunk=getattr(layer, "chunk", None),
                    softcap=getattr(layer, "softcap", None), sinks=getattr(layer, "sinks", None))

        def attend(qg, group):
            Q = group.pad_index.shape[1]
            if Q == 1:  # one token a row (decodes): split-K over each row's keys
                return ta.paged_decode_attention(qg, k_cache, v_cache, group.block_tables,
                                                 group.context_lens, layer.scale, scales=scales,
                                                 **opts)
            tables, cu_q, start_pos = group.prefill_metadata
            return ta.paged_prefill_attention(qg, k_cache, v_cache, tables, cu_q, start_pos, Q,
                                              layer.scale, scales=scales, **opts)

        return per_group(q, meta.groups, attend)
