"""MXFP4 weights kept as they are (gpt-oss's experts; llama.cpp's MXFP4 type): the OCP
microscaling format, blocks of 32 E2M1 values (a 4-bit code: sign, two exponent bits, one
mantissa bit) sharing one E8M0 exponent byte e, w = E2M1(code) 2^(e - 127).

A checkpoint's MXFP4 tensor is read as an MXFP4Weight (its codes and exponents, never the
dense values: gpt-oss-20b's experts are about 10 GB as MXFP4 and 38 GB in bf16), and a MoE layer
keeps its routed experts in the q8act kernel's panels (servelm.layers.q8act.pack_q4: the codes
where an int4 weight has its nibbles) with one exponent byte a block, which servelm_q8act's
mxfp4_linear and moe_experts_mxfp4 multiply with activations quantised per block to int8:
the E2M1 value doubled is an integer in [-12, 12], so every product is exact, as in
llama.cpp's MXFP4 x Q8_0. Elsewhere (fp32 activations, no kernels, CUDA) an expert is
dequantised when it runs, exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from servelm.layers.q8act import BLOCK, NR, pack_q4, unpack_q4
from servelm.models.dequant import _GGML_E2M1_DOUBLED, _mx_values

BITS = 4 + 8 / BLOCK  # a code a weight, an exponent byte a block


@dataclasses.dataclass
class MXFP4Weight:
    """An MXFP4 tensor of logical shape [..., N, K] (rows N, K inputs) as a checkpoint holds
    it: blocks uint8 [..., N, K / 32, 16] in ggml's order (byte i of a block holds value i in
    its low nibble and value 16 + i in its high one) and exps uint8 [..., N, K / 32], each
    possibly a strided view (a block's 16 bytes contiguous).
    source: "gguf" or "hf", whose row order a family may still have to undo."""

    blocks: torch.Tensor
    exps: torch.Tensor
    source: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.exps.shape[:-1]) + (self.exps.shape[-1] * BLOCK,)

    @classmethod
    def from_ggml(cls, data: np.ndarray) -> "MXFP4Weight":
        """ggml's block_mxfp4 rows, uint8 [..., K / 32 * 17] (per block the exponent byte,
        then 16 bytes of codes): views of them (a GGUF file's memory-mapped bytes, read where
        they lie), not copies."""
        b = torch.from_numpy(np.ascontiguousarray(data)).view(*data.shape[:-1], -1, 17)
        return cls(b[..., 1:], b[..., 0], "gguf")

    @classmethod
    def from_hf(cls, blocks: torch.Tensor, scales: torch.Tensor) -> "MXFP4Weight":
        """An HF checkpoint's `*_blocks` [..., N, K / 32, 16] (each byte two values, the
        low nibble first) and `*_scales` [..., N, K / 32]."""
        b = blocks.view(torch.uint8)
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [..., G, 32] in order
        return cls((codes[..., :16] | (codes[..., 16:] << 4)).contiguous(),
                   scales.view(torch.uint8).contiguous(), "hf")

    def narrow(self, dim: int, start: int, end: int) -> "MXFP4Weight":
        """Elements [start, end) of logical dim `dim`: rows or experts, or inputs in whole
        blocks of 32 (a tensor-parallel rank's slice)."""
        nd = len(self.shape)
        dim %= nd
        if dim == nd - 1:
            if start % BLOCK or end % BLOCK:
                raise ValueError(f"an MXFP4 tensor splits its inputs in whole blocks of "
                                 f"{BLOCK}, not at {start}:{end}")
            g = slice(start // BLOCK, end // BLOCK)
            return MXFP4Weight(self.blocks[..., g, :], self.exps[..., g], self.source)
        return MXFP4Weight(self.blocks.narrow(dim, start, end - start),
                           self.exps.narrow(dim, start, end - start), self.source)

    def pieces(self, pieces: list[tuple[int, int, int]]) -> "MXFP4Weight":
        """The (dim, start, end) pieces (ShardPlan.slice_of's, in the logical layout) joined
        along their dim."""
        parts = [self.narrow(*p) for p in pieces]
        if len(parts) == 1:
            return parts[0]
        dim = pieces[0][0]
        if dim % len(self.shape) == len(self.shape) - 1:
            raise ValueError("an MXFP4 tensor's input pieces are not joined")
        return MXFP4Weight(torch.cat([p.blocks for p in parts], dim),
                           torch.cat([p.exps for p in parts], dim), self.source)

    def rows(self, index: torch.Tensor | slice) -> "MXFP4Weight":
        """Rows `index` (of dim -2 of the logical shape)."""
        return MXFP4Weight(self.blocks[..., index, :, :], self.exps[..., index, :], self.source)

    def codes(self) -> torch.Tensor:
        """uint8 [..., N, K]: each value's 4-bit code."""
        b = self.blocks
        return torch.cat((b & 0x0F, b >> 4), dim=-1).flatten(-2)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values [..., N, K], exactly (gguf-py's and transformers' dequantisation)."""
        codes = self.codes().unflatten(-1, (-1, BLOCK))
        return _mx_values(codes, self.exps.unsqueeze(-1), _GGML_E2M1_DOUBLED).flatten(-2).to(dtype)


def to_panels(w: MXFP4Weight, out: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix [N, K] -> (codes in pack_q4's panels, uint8 [ceil(N / 16), K / 32, 2, 4,
    32]; exponents uint8 [ceil(N / 16), K / 32, 16]), rows padded with zero codes and
    exponents (zeros); in C++ where the int4 codec is built, else in PyTorch. out: the two
    tensors to write them into."""
    from servelm.quantization.numerics import int4_codec

    if int4_codec(w.blocks) and hasattr(torch.ops.servelm_int4_codec, "mxfp4_to_panels"):
        return tuple(torch.ops.servelm_int4_codec.mxfp4_to_panels(
            w.blocks, w.exps, *(out if out is not None else (None, None))))
    packed, exps = to_panels_reference(w)
    if out is None:
        return packed, exps
    out[0].copy_(packed)
    out[1].copy_(exps)
    return out


def to_panels_reference(w: MXFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """to_panels in PyTorch operators alone (any device)."""
    codes, exps = w.codes(), w.exps
    n = codes.shape[0]
    pad = -n % NR
    if pad:
        codes = torch.cat((codes, codes.new_zeros(pad, codes.shape[1])))
        exps = torch.cat((exps, exps.new_zeros(pad, exps.shape[1])))
    return pack_q4(codes), exps.reshape(-1, NR, exps.shape[1]).transpose(1, 2).contiguous()


def dequantize_panels(packed: torch.Tensor, exps: torch.Tensor, n: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """to_panels' inverse, the values: [n, K] in dtype (exact in fp32 and bf16)."""
    codes = unpack_q4(packed)                                   # [16T, K]
    e = exps.transpose(1, 2).reshape(codes.shape[0], -1, 1)     # [16T, K / 32, 1]
    values = _mx_values(codes.reshape(codes.shape[0], -1, BLOCK).long(), e, _GGML_E2M1_DOUBLED)
    return values.reshape(codes.shape)[:n].to(dtype)

