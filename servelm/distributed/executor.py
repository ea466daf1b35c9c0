"""TPExecutor: the engine's executor when tensor_parallel_size > 1 (rank 0's side).

It starts N-1 worker processes on this host (torch.multiprocessing, spawn, a store on a
free loopback port), or, when the process was launched by torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set), joins the ranks torchrun started, on one host or several.
Rank 0 runs the engine (scheduler, sampler, clients); on any other torchrun rank the
constructor runs the worker loop and then exits the process: the same command line
serves on rank 0 and works on the others.

It implements servelm.engine.executor.Executor: `execute(seqs) -> (logits, rows)`
broadcasts the step's metadata, runs rank 0's shard, and gathers the logits. Every rank
builds its shard, pool and runner with the same ModelWorker as a single process does. A worker that dies (or any failure
inside a step: the ranks are then out of step) raises WorkerDiedError, which is fatal
(`fatal = True`): the async engine fails every request in flight and reports unhealthy.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
import weakref

import torch

from servelm.distributed.parallel_state import (TPGroup, gloo_address, torchrun_env,
                                               torchrun_store)
from servelm.distributed.sharding import ShardPlan
from servelm.distributed.worker import (STEP, STOP, allocate_rank, encode_seqs, load_rank,
                                        lora_manager, run_step, spawn_main, worker_main)
from servelm.engine.executor import (Executor, default_kv_bytes, kv_groups_of, pool_blocks,
                                     state_slots, state_snapshots)
from servelm.engine.state_cache import StateCache
from servelm.engine.model_runner import KVCache, SeqInput
from servelm.models import kv_quant
from servelm.models.registry import family_for_architecture

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0


def _worker_context():
    """How tensor-parallel ranks start: forked from a server process that imported torch and
    servelm's worker once (a spawned rank re-imports them, seconds of every engine start);
    spawned where there is no forkserver. Either way a rank shares nothing with this process
    but its arguments, and sees the environment the server started with."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["servelm.distributed.worker"])
    return ctx


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or the ranks fell out of step; the engine cannot go on."""

    fatal = True


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Ranks:
    """What must be cleaned up at shutdown; kept apart from the executor so that a
    weakref.finalize (which runs at interpreter exit too) can own it."""

    def __init__(self) -> None:
        self.procs: list = []      # spawned workers (rank i + 1); empty under torchrun
        self.group: TPGroup | None = None
        self.usable = False        # the workers are in their step loop and in step with us
        self.busy = False          # a step is in flight (on the engine thread)

    def close(self) -> None:
        if self.group is not None and self.usable and not self.busy:
            self.usable = False
            try:
                self.group.broadcast_object((STOP,))
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self.procs = []


def per_rank_threads(config, local_ranks: int) -> int:
    """Intra-op threads for each rank: the engine's thread count (default: the physical
    cores) shared among the ranks on this host, at least one each."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // local_ranks)


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel world: owns rank 0's shard and KV pool, drives the rest."""

    def __init__(self, config, ckpt, model_config, dtype: torch.dtype, device: torch.device,
                 max_len: int):
        tp = config.tensor_parallel_size
        # A model that cannot be split fails here, before any process starts (shard_model
        # checks it again per rank).
        family_for_architecture(model_config.architecture).require_tensor_parallel()
        for rank in range(tp):
            ShardPlan.of(model_config, rank, tp)
        self.ranks = _Ranks()
        self._finalizer = weakref.finalize(self, self.ranks.close)
        self.error: WorkerDiedError | None = None
        env = torchrun_env()
        if env is not None:
            if env.world_size != tp:
                raise ValueError(f"tensor_parallel_size is {tp} but the launcher started "
                                 f"{env.world_size} processes (WORLD_SIZE); they must agree")
            if device.type == "cuda":
                device = torch.device("cuda", env.local_rank)
            torch.set_num_threads(per_rank_threads(config, env.local_world_size))
            group = TPGroup(torchrun_store(env), env.rank, tp, device,
                            hostname=gloo_address(env), shm=config.kernels.shm_collectives)
            if env.rank != 0:
                # A worker: serve rank 0's steps, then leave (the engine is rank 0's alone).
                logger.info("tensor-parallel rank %d of %d: serving as a worker", env.rank, tp)
                worker_main(group, config, ckpt, model_config, dtype, device, max_len)
                sys.exit(0)
        else:
            threads = per_rank_threads(config, tp)
            torch.set_num_threads(threads)
            group = self._spawn_workers(config, dtype, device, max_len, threads,
                                        ckpt.keep_mxfp4)
        self.ranks.group = self.group = group
        self.device = device
        try:
            self.worker, self.plan = load_rank(group, config, ckpt, model_config, dtype,
                                               device, max_len)
            sizes = self._size_pools(config, model_config, dtype, device)
            self.num_blocks, self.num_state_slots, self.num_state_snapshots = sizes
            allocate_rank(self.worker, config, dtype, sizes)
            group.control_all_reduce_max(0)  # every rank has loaded and allocated
        except Exception as e:
            self.ranks.close()
            reported = self._reported()
            if reported:
                raise WorkerDiedError(f"tensor-parallel start-up failed: {reported}") from e
            raise
        self.ranks.usable = True
        # LoRA: the adapters rank 0's manager wrote into slots since the last step, which the
        # other ranks write (their shards) before running it; likewise the recurrent states
        # restored from snapshots since the last step.
        self.lora_writes: list[tuple[int, str, str]] = []
        self.restores: list[tuple[int, int]] = []
        logger.info("tensor parallelism: %d ranks; rank 0 holds query heads %s, KV heads %s",
                    tp, self.plan.q_heads, self.plan.kv_heads)

    # ---- start-up ------------------------------------------------------------------------

    def _spawn_workers(self, config, dtype, device, max_len, threads,
                       keep_mxfp4: bool) -> TPGroup:
        import torch.multiprocessing as mp
        from torch.distributed import TCPStore

        tp = config.tensor_parallel_size
        store = TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=_START_TIMEOUT_S))
        ctx = _worker_context()
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, tp):
            p = ctx.Process(target=spawn_main, name=f"servelm-tp-worker-{rank}", daemon=True,
                            args=(rank, tp, store.port, config, dtype, str(device), max_len,
                                  threads, os.getpid(), level, keep_mxfp4))
            p.start()
            self.ranks.procs.append(p)
            logger.info("tensor-parallel worker %d: pid %d", rank, p.pid)
        # Wait for every worker to reach the store, failing fast if one dies on the way.
        deadline = time.monotonic() + _START_TIMEOUT_S
        self.ranks.group = None
        try:
            for rank, p in enumerate(self.ranks.procs, 1):
                while not store.check([f"up/{rank}"]):
                    if not p.is_alive():
                        raise WorkerDiedError(f"tensor-parallel worker {rank} (pid {p.pid}) "
                                              f"{_describe_exit(p.exitcode)} while starting")
                    if time.monotonic() > deadline:
                        raise WorkerDiedError(f"tensor-parallel worker {rank} did not start "
                                              f"within {_START_TIMEOUT_S:.0f} s")
                    time.sleep(0.05)
            return TPGroup(store, 0, tp, device, hostname="127.0.0.1",
                           shm=config.kernels.shm_collectives)
        except BaseException:
            self.ranks.close()
            raise

    def _size_pools(self, config, model_config, dtype, device) -> tuple[int, int, int]:
        """Rank 0 decides the number of blocks, recurrent-state slots and state snapshots
        for every rank (broadcast to them): kv_cache_memory is per rank, and the rank with
        the most KV heads (and linear-attention heads) must fit it."""
        cache = config.cache
        kv_dtype = kv_quant.storage_dtype(cache.kv_cache_dtype, dtype)  # the pool's storage
        # Each rank's block: its own KV heads (a latent cache's one row, whole on every rank).
        self.kv_groups = kv_groups_of(config, model_config)
        local = [ShardPlan.of(model_config, r, self.group.world).local_config(model_config)
                 for r in range(self.group.world)]
        block = [KVCache.bytes_per_block(c, cache.block_size, kv_dtype, self.kv_groups)
                 for c in local]
        budget = cache.kv_cache_memory or default_kv_bytes(device)
        slot_bytes = max(StateCache.bytes_per_slot(c, dtype) for c in local)
        slots = snapshots = 0
        if slot_bytes:  # linear-attention layers: their states first, the blocks in the rest
            total = budget
            slots = state_slots(config.scheduler.max_num_seqs, slot_bytes, budget)
            budget -= slots * slot_bytes
            if cache.enable_prefix_caching:
                snapshots = state_snapshots(slots, slot_bytes, total)
                budget -= snapshots * slot_bytes
        sizes = (pool_blocks(budget, max(block), " on a rank"), slots, snapshots)
        self.group.broadcast_object(sizes)
        self.block_bytes = block[self.plan.rank]
        return sizes

    # ---- steps ---------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker has died (cheap: no collective)."""
        if self.error is not None:
            raise self.error
        for rank, p in enumerate(self.ranks.procs, 1):
            if not p.is_alive():
                self._fail(f"tensor-parallel worker {rank} (pid {p.pid}) "
                           f"{_describe_exit(p.exitcode)}")

    def _reported(self) -> str:
        group = self.ranks.group
        errors = group.reported_errors() if group is not None else {}
        return "; ".join(msg.strip().splitlines()[-1] for msg in errors.values())

    def _fail(self, message: str, cause: BaseException | None = None):
        reported = self._reported()
        if reported:
            message += f" ({reported})"
        self.error = WorkerDiedError(f"{message}; the engine cannot continue, restart it")
        self.ranks.usable = False
        raise self.error from cause

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        """ModelRunner.execute over all ranks: fp32 logits [S, vocab] on rank 0, and rows."""
        self.check_health()
        self.ranks.busy = True
        try:
            writes, self.lora_writes = self.lora_writes, []
            restores, self.restores = self.restores, []
            self.group.broadcast_object((STEP, encode_seqs(seqs), writes, restores))
            return run_step(self.group, self.worker.runner, self.plan, seqs)
        except Exception as e:
            # Let a dying worker finish dying, so the message can say what happened.
            deadline = time.monotonic() + 2
            while (time.monotonic() < deadline
                   and all(p.is_alive() for p in self.ranks.procs) and self.ranks.procs):
                time.sleep(0.05)
            dead = [(r, p) for r, p in enumerate(self.ranks.procs, 1) if not p.is_alive()]
            if dead:
                msg = "; ".join(f"tensor-parallel worker {r} (pid {p.pid}) "
                                f"{_describe_exit(p.exitcode)}" for r, p in dead)
            else:
                msg = f"a tensor-parallel step failed: {e}"
            self._fail(msg, e)
        finally:
            self.ranks.busy = False

    def restore_states(self, restores: list[tuple[int, int]]) -> None:
        """Rank 0's states now; every other rank's before the next step runs."""
        super().restore_states(restores)
        self.restores += restores

    def lora_manager(self, config, model_config):
        """Rank 0's LoRA manager (its shards), reporting each write to the other ranks."""
        mgr = lora_manager(self.worker, config, model_config, self.plan)
        if mgr is not None:
            mgr.on_write = lambda slot, name, path: self.lora_writes.append((slot, name, path))
        return mgr

    def execute_pooling(self, seqs: list[SeqInput]):
        """Pooling requests (embeddings) do not run across ranks."""
        raise NotImplementedError("pooling requests (embeddings) are not supported with "
                                  "tensor_parallel_size > 1")

    def shutdown(self) -> None:
        """Stop the workers (they exit after the stop message); idempotent."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.ranks.procs]
