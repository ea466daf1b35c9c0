"""Architecture name (as HF config.json spells it) -> model class."""

from __future__ import annotations

from torch import nn

from servelm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r} "
                         f"(supported: {', '.join(sorted(_MODELS))})") from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
