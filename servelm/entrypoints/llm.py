"""LLM: the offline Python API, in the shape vLLM's users know."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from tqdm import tqdm

from servelm.config import (CacheConfig, EngineConfig, KernelConfig, SchedulerConfig,
                            SpeculativeConfig)
from servelm.engine.engine import LLMEngine
from servelm.outputs import EmbeddingRequestOutput, RequestOutput
from servelm.pooling_params import PoolingParams
from servelm.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    >>> llm = LLM(dtype="float32")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 revision: str | None = None, download_dir: str | None = None,
                 tokenizer: str | None = None, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None,
                 kv_cache_memory: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, seed: int = 0,
                 num_threads: int | None = None, enable_prefix_caching: bool = True,
                 admission_lookahead: int = 64, tensor_parallel_size: int = 1,
                 quantization: str | None = None, enforce_eager: bool = False,
                 kernel_tuning: str = "cached", linear_method: str = "auto",
                 batch_invariant: bool | None = None, cpu_kernels: bool = True,
                 fused_decode: bool = True, hugepages: bool = True,
                 triton_attention: bool = True, attention_backend: str = "auto",
                 tuning_cache_dir: str | None = None, shm_collectives: bool = True,
                 kv_cache_dtype: str = "auto", commit_kv_while_idle: bool = True,
                 speculative_config: dict | SpeculativeConfig | None = None,
                 dequantized_copy_memory: int | None = None,
                 overlap_grammar_masks: bool = True):
        """The engine's settings by name (servelm.config: EngineConfig and the configs it
        holds). model: a GGUF file, an HF directory, a Hugging Face id ORG/NAME (revision,
        download_dir) or ORG/NAME:QUANT; quantization None: the checkpoint's own format;
        chat_template: a file or the Jinja source, replacing the model's;
        kernel_tuning, linear_method ... are KernelConfig's fields;
        speculative_config as vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}."""
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.engine = LLMEngine(EngineConfig(
            model=model, revision=revision, download_dir=download_dir, tokenizer=tokenizer,
            chat_template=_template(chat_template), chat_template_kwargs=chat_template_kwargs,
            dtype=dtype, device=device, seed=seed, num_threads=num_threads,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization,
            enforce_eager=enforce_eager, speculative=speculative_config,
            kernels=KernelConfig(cpu_kernels=cpu_kernels, linear_method=linear_method,
                                 tuning=kernel_tuning, tuning_cache_dir=tuning_cache_dir,
                                 batch_invariant=batch_invariant, fused_decode=fused_decode,
                                 hugepages=hugepages, triton_attention=triton_attention,
                                 attention_backend=attention_backend,
                                 shm_collectives=shm_collectives,
                                 dequantized_copy_bytes=dequantized_copy_memory,
                                 overlap_grammar_masks=overlap_grammar_masks),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype,
                              commit_while_idle=commit_kv_while_idle),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      admission_lookahead=admission_lookahead)))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

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
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        chat_template: a file or the Jinja source, instead of the model's;
        chat_template_kwargs: template variables (e.g. {"enable_thinking": False});
        tools: OpenAI-style tool definitions, for templates that render them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        template = _template(chat_template)
        prompts: list[Prompt] = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           tools=tools, chat_template=template,
                                           template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self._run(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                if isinstance(prompt, dict):
                    engine.add_request(rid, prompt.get("prompt"), p,
                                       prompt_token_ids=prompt.get("prompt_token_ids"))
                else:
                    engine.add_request(rid, prompt, p)
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


def _template(value: str | None) -> str | None:
    """A chat template given as a file or as the source itself (load_chat_template)."""
    if value is None:
        return None
    from servelm.tokenizer import load_chat_template

    return load_chat_template(value)


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
