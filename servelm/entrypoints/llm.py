"""LLM: the offline Python API, in the shape vLLM's users know."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Sequence

from tqdm import tqdm

from servelm.config import EngineConfig, config_from_options, engine_options, options_doc
from servelm.engine.engine import LLMEngine
from servelm.lora import LoRARequest
from servelm.outputs import EmbeddingRequestOutput, RequestOutput
from servelm.pooling_params import PoolingParams
from servelm.runtime import finish_startup, init_process
from servelm.sampling_params import SamplingParams
from servelm.tokenizer import load_chat_template

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    >>> llm = LLM(dtype="float32")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **options: Any):
        # The docstring and signature are generated below, from the options' declarations.
        config = config_from_options(EngineConfig, {"model": model, **options}, "LLM")
        init_process(config)  # this process's start-up: threads, the kernels' environment
        self.engine = LLMEngine(config)
        finish_startup()  # what start-up allocated, out of the garbage collector's way
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
        lora_request: a LoRA adapter for every prompt, or one per prompt (None: the base
        model); needs enable_lora=True.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, _as_lora_list(lora_request, len(prompts)))

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's LLM.embed: `out.outputs.embedding`, a list of
        floats), in prompt order. The prompts run through the same scheduler as generate's
        (batched, chunked); the model's pooling (LLMEngine.pooling_config: last token,
        L2-normalised, unless the checkpoint says otherwise); pooling_params: dimensions
        (Matryoshka models only) and normalize, one for all or one per prompt."""
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts")
        return [EmbeddingRequestOutput.from_base(out)
                for out in self._run(prompts, params, use_tqdm)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        chat_template: a file or the Jinja source, instead of the model's;
        chat_template_kwargs: template variables (e.g. {"enable_thinking": False});
        tools: OpenAI-style tool definitions, for templates that render them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        template = None if chat_template is None else load_chat_template(chat_template)
        prompts: list[Prompt] = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           tools=tools, chat_template=template,
                                           template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self._run(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm,
                         _as_lora_list(lora_request, len(prompts)))

    def _run(self, prompts: list[Prompt], params: list, use_tqdm: bool,
             loras: list | None = None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                kw = {"lora_request": lora} if lora is not None else {}
                if isinstance(prompt, dict):
                    engine.add_request(rid, prompt.get("prompt"), p,
                                       prompt_token_ids=prompt.get("prompt_token_ids"), **kw)
                else:
                    engine.add_request(rid, prompt, p, **kw)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", file=sys.stderr,
                   disable=not use_tqdm or None, leave=False)
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]


def _as_lora_list(lora_request, n: int) -> list:
    """One LoRARequest (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, (LoRARequest, str)):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
    return loras


def _options_signature() -> inspect.Signature:
    """LLM.__init__'s signature: model, then every engine option as a keyword with its
    default (servelm.config.engine_options)."""
    P = inspect.Parameter
    options = sorted(engine_options(), key=lambda o: o.keyword != "model")  # model first
    return inspect.Signature([P("self", P.POSITIONAL_OR_KEYWORD)] + [
        P(o.keyword, P.POSITIONAL_OR_KEYWORD if o.keyword == "model" else P.KEYWORD_ONLY,
          default=o.default, annotation=o.spec.keyword_type or inspect.formatannotation(o.type))
        for o in options])


LLM.__init__.__signature__ = _options_signature()
LLM.__init__.__doc__ = ("""The engine's settings by keyword, each a field of servelm.config's
EngineConfig or of a config it holds (its CLI flags in brackets). model: a GGUF file, an HF
directory, a Hugging Face id ORG/NAME (revision, download_dir) or ORG/NAME:QUANT.

""" + options_doc())


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params
