"""One tensor-parallel rank: load its shard, hold its KV pool, run each step rank 0 sends.

Rank 0 (servelm.distributed.executor) and every worker share the code here, and build
their shard, pool and runner with the single process's ModelWorker (servelm.engine.executor),
so all build the same shapes and run the same collectives in the same order:

    rank 0                                   workers
    load shard, tune its linears             load shard, tune its linears
    broadcast num_blocks           ->        receive num_blocks
    allocate KV pool, runner                 allocate KV pool, runner
    ready (all-reduce)             <->       ready
    per step: broadcast metadata   ->        receive metadata
              forward (61 all-reduces for SmolLM2) <-> forward
              gather logits        <-        send logits block
    at exit:  broadcast "stop"     ->        return
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F

from servelm.distributed.parallel_state import TPGroup
from servelm.distributed.sharding import Shard, ShardPlan
from servelm.engine.executor import ModelWorker, kv_groups_of
from servelm.engine.model_runner import ModelRunner, SeqInput
from servelm.models import kv_quant

logger = logging.getLogger(__name__)

STOP = "stop"
STEP = "step"


def load_rank(group: TPGroup, config, ckpt, cfg, dtype: torch.dtype, device: torch.device,
              max_len: int) -> tuple[ModelWorker, ShardPlan]:
    """This rank's worker (servelm.engine.executor.ModelWorker, as on one device) over its
    shard of the model, read from the checkpoint's parts it needs only; its KV pool comes
    with allocate_rank. Weight quantisation swaps the shard's plain nn.Linear layers as on
    one device (the all-reduces live in the parallel attention and MLP modules around them)."""
    plan = ShardPlan.of(cfg, group.rank, group.world)
    worker = ModelWorker(ckpt, cfg, dtype, device, max_len, config.quantization,
                         config.kernels, shard=Shard(plan, group), lora=config.lora)
    return worker, plan


def lora_manager(worker: ModelWorker, config, cfg, plan: ShardPlan):
    """This rank's LoRA manager (its shards of each adapter), None without LoRA."""
    from servelm.lora.manager import LoRAManager

    return LoRAManager.of_worker(worker, config, cfg, plan)


def allocate_rank(worker: ModelWorker, config, dtype: torch.dtype,
                  sizes: tuple[int, int, int]) -> None:
    """The rank's own pool (its KV heads only: the worker's model.config is the rank's
    local config; sizes: rank 0's (blocks, recurrent-state slots, state snapshots), its
    linear-attention layers' states of its own heads) and its runner; no CUDA graphs (a
    step's collectives run outside them)."""
    num_blocks, slots, snapshots = sizes
    worker.allocate(num_blocks, config.cache.block_size,
                    kv_quant.storage_dtype(config.cache.kv_cache_dtype, dtype),
                    kv_groups=kv_groups_of(config, worker.model.config),
                    state_slots=slots, state_snapshots=snapshots)


def encode_seqs(seqs: list[SeqInput]) -> list[tuple]:
    return [(s.token_ids, s.start_pos, s.block_table, s.sample, s.all_logits, s.num_logits,
             s.pooling, s.lora_slot, s.state_slot, s.state_snapshot, s.group_tables)
            for s in seqs]


def decode_seqs(items: list[tuple]) -> list[SeqInput]:
    return [SeqInput(*item[:8], state_slot=item[8], state_snapshot=item[9],
                     group_tables=item[10]) for item in items]


def run_step(group: TPGroup, runner: ModelRunner, plan: ShardPlan,
             seqs: list[SeqInput]) -> tuple[torch.Tensor | None, list[int]]:
    """This rank's forward; on rank 0 the full fp32 logits [S, vocab] (None elsewhere)."""
    local, sampled = runner.execute(seqs)  # [S, this rank's vocabulary slice]
    if not sampled:
        empty = torch.empty(0, plan.vocab_size, device=local.device)
        return (empty if group.rank == 0 else None), sampled
    pad = plan.vocab_per_rank - local.shape[1]
    if pad:
        local = F.pad(local, (0, pad))
    parts = group.gather_to_rank0(local.contiguous())
    if parts is None:
        return None, sampled
    return torch.cat(parts, dim=1)[:, :plan.vocab_size], sampled


def serve_steps(group: TPGroup, runner: ModelRunner, plan: ShardPlan, lora=None) -> None:
    """A worker's loop: run every step rank 0 broadcasts, until it says stop. A step first
    writes this rank's shard of the LoRA adapters rank 0 made resident for it (lora: the
    rank's LoRAManager)."""
    while True:
        msg = group.broadcast_object()
        if msg[0] == STOP:
            return
        for slot, name, path in msg[2]:
            lora.write(slot, name, path)
        if msg[3]:  # admissions on a cached prefix: their states from its snapshots
            runner.state_cache.restore(msg[3])
        with torch.inference_mode():
            run_step(group, runner, plan, decode_seqs(msg[1]))


def worker_main(group: TPGroup, config, ckpt, cfg, dtype: torch.dtype, device: torch.device,
                max_len: int) -> None:
    """Everything a rank other than 0 does, from loading to the stop message."""
    try:
        worker, plan = load_rank(group, config, ckpt, cfg, dtype, device, max_len)
        allocate_rank(worker, config, dtype, group.broadcast_object())  # rank 0's sizes
        group.control_all_reduce_max(0)  # ready
        serve_steps(group, worker.runner, plan, lora_manager(worker, config, cfg, plan))
    except BaseException:
        group.report_error(f"rank {group.rank}: {traceback.format_exc()}")
        raise


def _watch_parent(parent: int) -> None:
    """A worker whose engine process is gone has nothing to serve: exit. (The engine is not
    the worker's parent: a forkserver is.)"""
    def watch() -> None:
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # a pid taken by another user's process: ours is gone
                os._exit(1)
            time.sleep(1.0)
    threading.Thread(target=watch, name="servelm-tp-parent-watch", daemon=True).start()


def spawn_main(rank: int, world: int, port: int, config, dtype: torch.dtype, device: str,
               max_len: int, threads: int, parent: int, log_level: int,
               keep_mxfp4: bool = False) -> None:
    """Entry point of a worker process started by the executor (forked from the forkserver
    that preloaded this module, or spawned); keep_mxfp4: rank 0's choice for MXFP4
    experts (LLMEngine), so that every rank reads them alike."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    logging.basicConfig(level=log_level, format=f"%(levelname)s tp-rank{rank} %(name)s: "
                                                f"%(message)s")
    _watch_parent(parent)
    torch.set_num_threads(threads)
    from torch.distributed import TCPStore

    from servelm.models.loader import open_checkpoint

    store = TCPStore("127.0.0.1", port, world, is_master=False, wait_for_workers=False)
    store.set(f"up/{rank}", "1")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank)
    try:
        group = TPGroup(store, rank, world, dev, hostname="127.0.0.1",
                        shm=config.kernels.shm_collectives)
    except BaseException:
        store.set(f"error/{rank}", f"rank {rank}: {traceback.format_exc()}"[-2000:])
        raise
    try:
        ckpt = open_checkpoint(config.model)
        ckpt.keep_mxfp4 = keep_mxfp4
        cfg = ckpt.config()
    except BaseException:
        group.report_error(f"rank {rank}: {traceback.format_exc()}")
        raise
    worker_main(group, config, ckpt, cfg, dtype, dev, max_len)
    sys.stdout.flush()
