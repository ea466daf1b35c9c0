"""Executor: how the engine's steps run, the one seam between the engine (scheduler,
sampler, requests) and the model.

    Executor            the interface the engine holds: execute / execute_pooling (a step's
                        logits), the KV pool it sized (num_blocks, block_bytes, kv_cache),
                        check_health, shutdown; read-only model, tuning report and runner
    UniProcExecutor     one process: the model, its KV pool (sized with a draft model's,
                        which shares the budget) and its ModelRunner
    TPExecutor          tensor parallelism (servelm.distributed.executor): rank 0's shard,
                        driving the other ranks
    ModelWorker         model + linear tuning + KV pool + runner, built in one place for
                        every process that runs a model: the single process, each tensor-
                        parallel rank, a draft model
    default_kv_bytes    the KV budget when kv_cache_memory is not given

The engine chooses the executor (servelm.engine.engine.build_executor): this module does
not import servelm.distributed, which imports it.
"""

from __future__ import annotations

import abc
import os
from typing import Callable, Protocol

import torch

from servelm.config import EngineConfig, KernelConfig, LoRAConfig
from servelm.engine.calibration import cache_file as calibration_file
from servelm.engine.calibration import calibrate as calibrate_activations
from servelm.engine.calibration import wanted
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput
from servelm.engine.state_cache import StateCache
from servelm.models import kv_quant
from servelm.models.config import KVGroups, ModelConfig
from servelm.lora.wrap import apply_lora
from servelm.models.loader import load_model
from servelm import tuning_cuda
from servelm.tuning import TuningReport, finalize_linears
from servelm.tuning_cache import cache_dir

DEFAULT_CPU_KV_BYTES = 2 << 30


def default_kv_bytes(device: torch.device) -> int:
    """The KV pools' budget without kv_cache_memory, after the weights are loaded: most of
    what the GPU has free; on CPU a quarter of the available memory, at most 2 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(64 << 20, min(DEFAULT_CPU_KV_BYTES, avail // 4))


def pool_blocks(kv_bytes: int, block_bytes: int, where: str = "") -> int:
    """Blocks of block_bytes in a kv_bytes budget; ValueError when not even one fits."""
    num_blocks = kv_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {kv_bytes} bytes holds no block "
                         f"(one block takes {block_bytes} bytes{where})")
    return num_blocks


def state_snapshots(num_slots: int, slot_bytes: int, kv_bytes: int) -> int:
    """How many recurrent states to keep for the prefix cache (state snapshots, beside a
    model's linear-attention layers): as many as there are slots, within a quarter of the
    pools' budget (0: not even one fits)."""
    return min(num_slots, (kv_bytes // 4) // slot_bytes)


def state_slots(max_num_seqs: int, slot_bytes: int, kv_bytes: int) -> int:
    """How many sequences' recurrent states (linear-attention layers) to hold: one for
    every sequence that may run at once, within half of the pools' budget (the KV blocks
    of the attention layers take the rest); ValueError when not even one fits."""
    if slot_bytes > kv_bytes // 2:
        raise ValueError(f"kv_cache_memory of {kv_bytes} bytes holds no sequence's recurrent "
                         f"state (one takes {slot_bytes} bytes, within half of the budget)")
    return min(max_num_seqs, (kv_bytes // 2) // slot_bytes)


class ModelWorker:
    """One process's model as it runs: built in two stages, because the KV pool's size is
    known only once the weights are in memory (free memory after them, a draft model's
    share, the tensor-parallel ranks' agreement on one block count).

    ModelWorker(...)   the weights loaded (the rank's shard under tensor parallelism), then
                       weight quantisation and each linear layer's method (finalize_linears)
    allocate(...)      the KV pool (the model's KV heads: a rank's own) and the ModelRunner
    """

    def __init__(self, ckpt, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_len: int, quantization: str | None,
                 kernels: KernelConfig, shard=None, lora: LoRAConfig | None = None,
                 calibration: list[int] | None = None, ssm_dtype: torch.dtype = torch.float32):
        """calibration: token ids the int8-activation layers are calibrated on where
        KernelConfig.int8_activations asks for them (servelm.engine.calibration); None: none.
        ssm_dtype: the linear-attention layers' recurrent states' (ssm_state_dtype)."""
        self.device = device
        self.kernels = kernels
        self.ssm_dtype = ssm_dtype
        self.model = load_model(ckpt, model_config, dtype, device, max_positions=max_len,
                                shard=shard)
        lora = lora if lora is not None and lora.enabled else None

        def calibrate(model: torch.nn.Module) -> None:
            if calibration and shard is None and wanted(model, kernels.int8_activations,
                                                        device, kernels):
                cache = (None if kernels.tuning == "off" else
                         calibration_file(cache_dir(kernels.tuning_cache_dir), ckpt.path,
                                          dtype, quantization, calibration))
                calibrate_activations(model, calibration, kernels, cache)

        # Weight-only quantisation (activations keep dtype), the int8-activation layers'
        # calibration and, on CPU, each linear layer's method per row bucket, measured here
        # (or read back): module swaps.
        self.tuning: TuningReport = finalize_linears(self.model, quantization, kernels,
                                                     calibrate=calibrate)
        if device.type == "cuda":  # the calibrated layers' int8 activations, where faster
            self.tuning = tuning_cuda.finalize(self.model, kernels or KernelConfig(), calibrate)
        # LoRA: the adaptable layers wrapped, with max_loras empty slots each.
        self.lora_layers = (apply_lora(self.model, lora.max_loras, lora.max_lora_rank,
                                       huge=kernels.hugepages if kernels else True)
                            if lora is not None else None)
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype,
                        groups: KVGroups | None = None) -> int:
        """One KV block of this model's pool (its own KV heads; with block groups, a page)."""
        return KVCache.bytes_per_block(self.model.config, block_size, kv_dtype, groups)

    def state_bytes(self) -> int:
        """One sequence's recurrent state in every linear-attention layer (0: none)."""
        return StateCache.bytes_per_slot(self.model.config, self.model.norm.weight.dtype,
                                         self.ssm_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 cuda_graphs: bool = False, max_graph_batch: int = 256,
                 state_slots: int = 0, state_snapshots: int = 0,
                 kv_groups: KVGroups | None = None) -> None:
        """The KV pool (with a spare block for captured CUDA-graph steps; a hybrid model's
        pages in block groups), the recurrent states' slots and snapshots (a model with
        linear-attention layers) and the runner."""
        self.kv_cache = KVCache(self.model.config, num_blocks, block_size, kv_dtype,
                                self.device, spare_block=cuda_graphs,
                                hugepages=self.kernels.hugepages, groups=kv_groups)
        states = (StateCache(self.model.config, state_slots, self.model.norm.weight.dtype,
                             self.device, num_snapshots=state_snapshots,
                             ssm_dtype=self.ssm_dtype)
                  if state_slots else None)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device,
                                  cuda_graphs=cuda_graphs, max_graph_batch=max_graph_batch,
                                  kernels=self.kernels, state_cache=states)


def ssm_state_dtype(name: str) -> torch.dtype:
    """CacheConfig.mamba_ssm_cache_dtype as the recurrent states' dtype (auto: float32)."""
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def kv_groups_of(config: EngineConfig, model_config: ModelConfig) -> KVGroups | None:
    """The block groups of the model's pool: a hybrid model's (ModelConfig.kv_groups:
    windowed and full-attention layers) unless CacheConfig.hybrid_kv_cache is off."""
    return model_config.kv_groups if config.cache.hybrid_kv_cache else None


class Executor(abc.ABC):
    """What the engine runs a step through. An implementation builds its model (or shards)
    and KV pool(s) in its constructor and sets `worker` (this process's ModelWorker),
    `num_blocks` (the block manager's size) and `block_bytes` (one block in this process,
    every pool that holds it)."""

    worker: ModelWorker
    num_blocks: int
    block_bytes: int
    # Recurrent-state slots (linear-attention layers; 0: the model has none) and, with
    # prefix caching, snapshots of such states: the block manager hands them out.
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    # A draft model whose pool was sized with the target's (speculative decoding): the
    # engine's speculator drafts with it.
    draft = None
    # A hybrid model's block groups (kv_groups_of): num_blocks counts pages then, and the
    # block manager keeps a table per group.
    kv_groups: KVGroups | None = None

    @abc.abstractmethod
    def execute(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        """A step's fp32 logits [S, vocab] and, per row, the index in `seqs` it belongs to
        (ModelRunner.execute)."""

    @abc.abstractmethod
    def execute_pooling(self, seqs: list[SeqInput]
                        ) -> tuple[torch.Tensor, list[int], torch.Tensor, list[int]]:
        """A step with pooling sequences: (logits, rows) for the others and the pooling
        sequences' final hidden states with their rows (ModelRunner.execute_pooling)."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise if steps can no longer run (a tensor-parallel worker has died)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release what outlives the executor object (worker processes); idempotent."""

    def restore_states(self, restores: list[tuple[int, int]]) -> None:
        """The block manager's restores (snapshot, slot) in this process's StateCache: each
        slot's recurrent state set to the snapshot's. (Snapshots are filled by the steps'
        forwards: SeqInput.state_snapshot.)"""
        self.runner.state_cache.restore(restores)

    def lora_manager(self, config: EngineConfig, model_config: ModelConfig):
        """The LoRA adapters' manager over this process's wrapped layers (None without LoRA)."""
        from servelm.lora.manager import LoRAManager

        return LoRAManager.of_worker(self.worker, config, model_config)

    # Read-only views of this process's worker, for the engine (commit_next on the pool),
    # `servelm tune` (the tuning report, the linear layers), tests and benchmarks.

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def tuning(self) -> TuningReport:
        return self.worker.tuning

    @property
    def kv_cache(self) -> KVCache:
        return self.worker.kv_cache

    @property
    def runner(self) -> ModelRunner:
        """This process's ModelRunner (its attention backend, its kernel choice)."""
        return self.worker.runner


class DraftPool(Protocol):
    """What the executor needs of a draft model (servelm.spec.draft_model's proposer): the
    size of its KV block, and its pool allocated with the target's block count."""

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int: ...

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 enable_caching: bool, cuda_graphs: bool = False,
                 max_graph_batch: int = 256) -> None: ...


class UniProcExecutor(Executor):
    """The whole model in this process."""

    def __init__(self, config: EngineConfig, ckpt, model_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device, max_len: int,
                 load_draft: Callable[[], DraftPool | None] | None = None,
                 calibration: list[int] | None = None):
        """config: the resolved EngineConfig (quantization decided). load_draft: loads the
        draft model (speculative decoding), called once the target's weights are in.
        calibration: the int8-activation layers' calibration tokens (ModelWorker)."""
        cache = config.cache
        self.worker = ModelWorker(ckpt, model_config, dtype, device, max_len,
                                  config.quantization, config.kernels, lora=config.lora,
                                  calibration=calibration,
                                  ssm_dtype=ssm_state_dtype(cache.mamba_ssm_cache_dtype))
        # A draft model before the KV pools: its weights come out of the memory the pools
        # are sized from, and its pool shares their budget.
        self.draft = load_draft() if load_draft is not None else None
        kv_dtype = kv_quant.storage_dtype(cache.kv_cache_dtype, dtype)
        self.kv_groups = kv_groups_of(config, model_config)
        block_bytes = self.worker.bytes_per_block(cache.block_size, kv_dtype, self.kv_groups)
        # A pool in block groups holds a block of tokens in one page of each group: the
        # draft's pool (one block a block of tokens) takes a block per that many pages.
        pages = len(self.kv_groups.layers) if self.kv_groups is not None else 1
        draft_bytes = (self.draft.bytes_per_block(cache.block_size, kv_dtype)
                       if self.draft is not None else 0)
        budget = cache.kv_cache_memory or default_kv_bytes(device)
        slot_bytes = self.worker.state_bytes()
        if slot_bytes:  # linear-attention layers: their states first, the blocks in the rest
            total = budget
            self.num_state_slots = state_slots(config.scheduler.max_num_seqs, slot_bytes, budget)
            budget -= self.num_state_slots * slot_bytes
            if cache.enable_prefix_caching:  # the prefix cache's copies of such states
                self.num_state_snapshots = state_snapshots(self.num_state_slots, slot_bytes,
                                                           total)
                budget -= self.num_state_snapshots * slot_bytes
        # With a draft model, both pools hold the same number of blocks (tokens).
        self.num_blocks = pool_blocks(budget, pages * block_bytes + draft_bytes) * pages
        self.block_bytes = block_bytes + draft_bytes // pages
        graphs = device.type == "cuda" and not config.enforce_eager
        max_graph_batch = min(256, config.scheduler.max_num_seqs)
        self.worker.allocate(self.num_blocks, cache.block_size, kv_dtype,
                             cuda_graphs=graphs, max_graph_batch=max_graph_batch,
                             state_slots=self.num_state_slots,
                             state_snapshots=self.num_state_snapshots,
                             kv_groups=self.kv_groups)
        if self.draft is not None:
            self.draft.allocate(self.num_blocks // pages, cache.block_size, kv_dtype,
                                cache.enable_prefix_caching, cuda_graphs=graphs,
                                max_graph_batch=max_graph_batch)

    def execute(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        return self.worker.runner.execute(seqs)

    def execute_pooling(self, seqs: list[SeqInput]
                        ) -> tuple[torch.Tensor, list[int], torch.Tensor, list[int]]:
        return self.worker.runner.execute_pooling(seqs)

    def check_health(self) -> None:
        """One process: nothing can die apart from it."""

    def shutdown(self) -> None:
        """Nothing outlives the object (the pool and weights go with it)."""
