"""Weight-only int8 / int4 quantisation as module swaps, split by concept:

- numerics: quantise / dequantise / pack / unpack int8 and int4, the bf16 / fp32 tiles,
  tinygemm's operands (no layers, no choice of kernel);
- formats: the layers that hold a weight format (QuantLinear, Int8Linear, Int4Linear,
  TiledLinear);
- surgery: quantize_model / quantize_linear, the model's layers swapped by name (TARGETS).

`quantize_model(model, "int8" | "int4")` replaces the model's `nn.Linear` layers (qkv_proj,
o_proj, gate_up_proj, down_proj, lm_head) by `Int8Linear` / `Int4Linear`. The names below
are the package's public ones, importable from here or from their module.
"""

from servelm.quantization.formats import (CUDA_INT4_MAX_ROWS, CUDA_INT8_MAX_ROWS, TILE_OPS,
                                          Int4Linear, Int8Linear, QuantLinear, TiledLinear,
                                          kernels_available)
from servelm.quantization.numerics import (DEFAULT_GROUP_SIZE, GROUP_SIZES, METHODS,
                                           check_method, dequantize_int4,
                                           dequantize_int4_reference, dequantize_int8,
                                           dequantize_tinygemm, inner_k_tiles, int4_codec,
                                           pack_int8, pack_tiles, quantize_int4,
                                           quantize_int4_reference, quantize_int8,
                                           tinygemm_operands, unpack_int4, unpack_int4_reference,
                                           unpack_int8, unpack_tiles, unpacked_once)
from servelm.quantization.surgery import TARGETS, quantize_linear, quantize_model

__all__ = [
    "CUDA_INT4_MAX_ROWS", "CUDA_INT8_MAX_ROWS", "DEFAULT_GROUP_SIZE", "GROUP_SIZES", "METHODS",
    "TARGETS", "TILE_OPS", "Int4Linear",
    "Int8Linear", "QuantLinear", "TiledLinear", "check_method", "dequantize_int4",
    "dequantize_int4_reference", "dequantize_int8", "dequantize_tinygemm", "inner_k_tiles",
    "int4_codec", "kernels_available", "pack_int8", "pack_tiles", "quantize_int4",
    "quantize_int4_reference", "quantize_int8", "quantize_linear", "quantize_model",
    "tinygemm_operands", "unpack_int4", "unpack_int4_reference", "unpack_int8", "unpack_tiles",
    "unpacked_once",
]
