"""Compatibility: the Llama model class is the generic decoder (servelm/models/decoder.py)."""

from servelm.models.decoder import CausalLM, DecoderLayer  # noqa: F401

LlamaForCausalLM = CausalLM
