"""servelm: a fast LLM inference engine and OpenAI-compatible server on PyTorch."""

from servelm.entrypoints.llm import LLM
from servelm.lora import LoRARequest
from servelm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from servelm.pooling_params import PoolingParams
from servelm.sampling_params import SamplingParams
from servelm.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams", "LoRARequest",
           "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
