"""Architecture names (HF `architectures`, GGUF `general.architecture`) -> model family.

Every family runs on the one generic decoder (decoder.CausalLM, which the loader builds:
loader.get_model_class); the family object (family.Family, one file each in families/) says
how its configs and checkpoints read."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.families.cohere import Cohere
from servelm.models.families.deepseek import DeepseekV2, DeepseekV3
from servelm.models.families.ernie4_5 import Ernie4_5
from servelm.models.families.exaone4 import Exaone4
from servelm.models.families.gemma2 import Gemma2
from servelm.models.families.gemma3 import Gemma3
from servelm.models.families.gemma4 import Gemma4
from servelm.models.families.glm4 import Glm4
from servelm.models.families.glm4_moe import Glm4Moe
from servelm.models.families.gpt_neox import GptNeoX
from servelm.models.families.gpt_oss import GptOss
from servelm.models.families.granite import Granite, GraniteMoe
from servelm.models.families.llama import Llama, Mistral
from servelm.models.families.llama4 import Llama4
from servelm.models.families.ministral3 import Ministral3
from servelm.models.families.mixtral import Mixtral
from servelm.models.families.olmo2 import Olmo2, Olmo3
from servelm.models.families.phi import Phi
from servelm.models.families.phi3 import Phi3
from servelm.models.families.qwen2 import Qwen2
from servelm.models.families.qwen2_moe import Qwen2Moe
from servelm.models.families.qwen3 import Qwen3, Qwen3Moe
from servelm.models.families.qwen3_next import Qwen3_5, Qwen3_5Moe, Qwen3Next
from servelm.models.families.smollm3 import SmolLM3
from servelm.models.families.stablelm import StableLm
from servelm.models.families.starcoder2 import Starcoder2

FAMILIES: tuple[Family, ...] = (Llama(), Mistral(), Qwen2(), Qwen3(), Qwen3Moe(), Mixtral(),
                                Phi3(), Gemma3(), Gemma2(), SmolLM3(),
                                Granite(), Olmo2(), Olmo3(), Qwen2Moe(),
                                Glm4(), Glm4Moe(), Starcoder2(), Exaone4(), Ernie4_5(),
                                GraniteMoe(), StableLm(), Phi(), Cohere(), Ministral3(),
                                GptNeoX(), GptOss(), Llama4(), DeepseekV2(), DeepseekV3(),
                                Qwen3Next(), Qwen3_5(), Qwen3_5Moe(), Gemma4())
_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}
_BY_GGUF = {a: f for f in FAMILIES for a in f.gguf_architectures}


def _lookup(table: dict[str, Family], name: str, what: str) -> Family:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unsupported {what} {name!r} "
                         f"(supported: {', '.join(sorted(table))})") from None


def family_for_architecture(architecture: str) -> Family:
    return _lookup(_BY_ARCH, architecture, "model architecture")


def family_for_gguf(arch: str) -> Family:
    return _lookup(_BY_GGUF, arch, "GGUF architecture")


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)
