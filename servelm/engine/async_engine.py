"""AsyncLLMEngine: the engine stepped by one background thread, with an asyncio face.

The engine is not thread-safe, so one thread owns it. Adds, aborts and LoRA adapter loads
and unloads reach that thread through an inbox (a list under a condition variable) and are
applied between steps; each step's outputs go back to the event loop through one
asyncio.Queue per request. Model compute therefore never runs on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from servelm.engine.engine import EngineStats, LLMEngine
from servelm.outputs import PoolingRequestOutput, RequestOutput
from servelm.pooling_params import PoolingParams
from servelm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Admission refused: max_queue sequences are already waiting."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at that moment gets this error."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (by abort()) before it finished."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down: no new requests; in-flight ones past the drain time
    get this error."""


class LoRANotLoadedError(LookupError):
    """The request names a LoRA adapter that was unloaded before the engine thread took it."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state published by the engine thread after every iteration (read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0   # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of which found cached
    stats: EngineStats = field(default_factory=EngineStats)  # a copy of the engine's counters
    lora_resident: tuple[str, ...] = ()  # LoRA adapters in the model's slots, LRU first
    lora_loads: int = 0                  # adapters written into a slot (residency misses)


def _put_all(items: list) -> None:
    """On the event loop: each (queue, output) of one engine step, in order."""
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """One request's outputs in step order: `async for out in stream`.

    Leaving early (break, cancellation, `aclose()`, or `async with` exit) aborts the request,
    which frees its KV blocks before the engine's next step.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | PoolingRequestOutput | BaseException] = (
            asyncio.Queue())

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.abort()


class AsyncLLMEngine:
    """Serves many asyncio callers from one engine thread.

    max_queue bounds the sequences that would wait to run: those beyond what the
    scheduler can run at once (max_num_seqs), counting requests just added and not yet
    seen by the engine thread. A generate() past it raises QueueFullError at once; a
    request with more samples than could ever be admitted raises ValueError.
    """

    def __init__(self, engine: LLMEngine | None, max_queue: int | None = None):
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None  # set when the thread died
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []          # guarded by _cond
        self._num_pending = 0                  # sequences in the inbox; guarded by _cond
        self._streams: dict[str, RequestStream] = {}  # live requests; guarded by _cond
        self._stopping = False
        self.draining = False                  # set by start_drain(): no new requests
        self._ids = itertools.count()
        # The registered LoRA adapters (name -> LoRARequest), republished by the engine thread
        # whenever they change: a new dict each time, read from any thread.
        self.loras: dict = {}
        self._publish_loras()
        self._last_lora_id = 0  # guarded by _cond
        self._thread = threading.Thread(target=self._run, name="servelm-engine", daemon=True)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine],
              max_queue: int | None = None) -> "AsyncLLMEngine":
        """Build the engine on the engine thread itself, start it, and return once it runs.

        Then every torch call runs on that one thread. With libgomp, a thread that runs
        OpenMP regions after another thread already has a pool gets them much slower:
        a 1x576x1536 bf16 matmul took 41 us on the first thread and 88 us on a later one
        here, which cost single-stream decode about a third of its speed. Raises what the
        factory raised.
        """
        self = cls(None, max_queue)
        built = threading.Event()

        def run() -> None:
            try:
                self.engine = factory()
                self._publish_loras()
            except BaseException as e:  # handed to the caller below
                self.error = e
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=run, name="servelm-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self.error is not None:
            raise self.error
        return self

    @property
    def tokenizer(self):
        """The engine's tokenizer (thread-safe to use from the event loop)."""
        return self.engine.tokenizer

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (--enable-lora)."""
        return getattr(self.engine, "lora", None) is not None

    @property
    def healthy(self) -> bool:
        """Whether the engine thread is running and accepting requests."""
        if not (self._thread.is_alive() and self.error is None and not self._stopping
                and not self.draining):
            return False
        check = getattr(self.engine, "check_health", None)
        try:
            if check is not None:
                check()  # e.g. a tensor-parallel worker died while the engine idled
        except Exception as e:
            self.error = e
            return False
        return True

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if not self._thread.is_alive() and not self._stopping:
            self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread; requests still in flight get EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def start_drain(self) -> None:
        """Refuse new requests (ShuttingDownError); those in flight go on."""
        self.draining = True

    def expire(self, message: str = "the server is shutting down") -> None:
        """End every request in flight with ShuttingDownError (thread-safe)."""
        self.draining = True
        with self._cond:
            self._inbox.append(("fail_all", ShuttingDownError(message)))
            self._cond.notify()

    # ---- event-loop side -------------------------------------------------------------------

    def _max_seqs(self) -> int:
        return self.engine.scheduler.config.max_num_seqs

    def _queue_depth(self, n: int) -> int:
        """Sequences that would wait to run if n more were added now."""
        snap = self.snapshot
        if snap.num_waiting:  # already queueing (out of sequences or KV blocks): all wait
            return snap.num_waiting + self._num_pending + n
        return max(0, snap.num_running + self._num_pending + n - self._max_seqs())

    def encode(self, prompt: str | list[int] | None, params: PoolingParams,
               request_id: str | None = None, prompt_token_ids: list[int] | None = None,
               cache_salt: str | None = None) -> RequestStream:
        """Validate and queue a pooling request (an embedding), under generate()'s admission
        control and with its errors; its stream yields one PoolingRequestOutput, at the end."""
        return self.generate(prompt, params, request_id, prompt_token_ids, cache_salt)

    def check_fits(self, num_prompts: int, n: int = 1) -> None:
        """ValueError, naming the limits, when num_prompts prompts of n samples each are more
        sequences than could ever be admitted at once (running + queued): waiting would not
        help, so this is the caller's error, not a full queue's (QueueFullError)."""
        if self.max_queue is None:
            return
        most = self._max_seqs() + self.max_queue
        if num_prompts * n <= most:
            return
        limits = (f"this server admits at most {most} sequences at once (--max-num-seqs "
                  f"{self._max_seqs()} running + --max-queue {self.max_queue} waiting)")
        if num_prompts == 1:
            raise ValueError(f"n ({n}) is more samples than {limits}")
        raise ValueError(f"{num_prompts} prompts x n={n} are {num_prompts * n} sequences, more "
                         f"than {limits}; send them in smaller requests")

    def generate(self, prompt: str | list[int] | None, params: SamplingParams | PoolingParams,
                 request_id: str | None = None,
                 prompt_token_ids: list[int] | None = None,
                 cache_salt: str | None = None, lora_request=None) -> RequestStream:
        """Validate and queue a request; returns its stream of outputs (PoolingParams: a
        pooling request, see encode).

        cache_salt keeps the request's prompt out of other salts' prefix caches.
        lora_request: a registered LoRA adapter's name (or a LoRARequest) to run it with;
        one unloaded before the engine thread takes the request fails its stream with
        LoRANotLoadedError.
        Must be called from a running event loop. Raises at once (nothing is queued):
        ValueError for a prompt that cannot run, QueueFullError, EngineDeadError
        (ShuttingDownError while draining).
        """
        if self.draining:
            raise ShuttingDownError("the server is shutting down")
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.error or 'stopped'}")
        self.check_fits(1, params.n)
        text, ids, _ = self.engine.prepare_prompt(prompt, params, prompt_token_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, asyncio.get_running_loop())
        with self._cond:
            if self.max_queue is not None and self._queue_depth(params.n) > self.max_queue:
                raise QueueFullError(f"the server is at capacity: {self.max_queue} sequences are "
                                     f"already waiting; retry later")
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[rid] = stream
            self._inbox.append(("add", rid, text, ids, params, time.perf_counter(), cache_salt,
                                lora_request))
            self._num_pending += params.n
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its blocks are freed before the next step."""
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    async def add_lora(self, lora_request, replace: bool = False) -> None:
        """Load and check a LoRA adapter in a worker thread (the engine steps on meanwhile:
        a large adapter's files do not stall every stream), then register it on the engine
        thread, between steps. ValueError: LoRA is off, the name is taken (unless replace:
        then the new adapter takes the old one's place if no request uses it, and the old one
        stays if the new one does not fit), or the adapter does not fit the model."""
        load_lora = getattr(self.engine, "load_lora", None)
        adapter = await asyncio.to_thread(load_lora, lora_request) if load_lora else None

        def add(engine: LLMEngine) -> None:
            name = lora_request.lora_name
            old = engine.lora.get(name) if engine.lora is not None else None
            if old is None:
                engine.add_lora(lora_request, adapter)
                return
            if not replace:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            kept = engine.lora.adapter(name)
            engine.remove_lora(name)
            try:
                engine.add_lora(lora_request, adapter)
            except Exception:  # the old one stays
                engine.add_lora(old, kept)
                raise

        await self._call(add)

    async def remove_lora(self, name: str) -> None:
        """Unregister a LoRA adapter on the engine thread: KeyError if unknown, ValueError
        while requests use it."""
        await self._call(lambda engine: engine.remove_lora(name))

    def new_lora_id(self) -> int:
        """An integer id no adapter has had in this engine's life: an id names one load, so
        a name loaded again (from another path, or the same one changed) gets a new one."""
        with self._cond:
            self._last_lora_id = 1 + max([self._last_lora_id,
                                          *(r.lora_int_id for r in self.loras.values())])
            return self._last_lora_id

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread between steps; its result or exception here."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """fn(engine) queued for the engine thread, to run between steps (from any thread);
        its future. EngineDeadError at once when the engine is not running."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.error or 'stopped'}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._inbox.append(("call", fn, future))
            self._cond.notify()
        return future

    def _publish_loras(self) -> None:
        """Engine thread: the registered adapters as the event loop sees them."""
        list_loras = getattr(self.engine, "list_loras", None)
        self.loras = {r.lora_name: r for r in list_loras()} if list_loras else {}

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        idle_work = True  # LLMEngine.commit_idle has more to do
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or engine.has_unfinished_requests()
                           or idle_work):
                    self._cond.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            if not inbox and not engine.has_unfinished_requests():
                # Idle: one slice (a few ms), then the inbox is looked at again.
                idle_work = engine.commit_idle()
                continue
            # Counted up front so that the pending count stays right even if _apply raises.
            num_added = sum(item[4].n for item in inbox if item[0] == "add")
            try:
                self._apply(inbox)
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                    # A step may leave idle work behind: the re-tune its decode times asked
                    # for (LLMEngine.commit_idle returns False at once when there is none).
                    idle_work = True
            except Exception as e:
                logger.exception("engine step failed; failing every request in flight")
                # A fatal error (a tensor-parallel worker died) leaves no engine to step.
                if (not self._fail_all(EngineStepError(f"engine error: {e!r}"))
                        or getattr(e, "fatal", False)):
                    self.error = e
                    break
            finally:
                self._publish(num_added)
        dead = EngineDeadError(f"the engine has stopped: {self.error or 'shut down'}")
        self._fail_all(dead)
        with self._cond:
            left, self._inbox = self._inbox, []
        for item in left:  # calls nobody will run
            if item[0] == "call" and item[2].set_running_or_notify_cancel():
                item[2].set_exception(dead)

    def _apply(self, inbox: list[tuple]) -> None:
        """Apply queued adds, aborts and calls in order."""
        for item in inbox:
            if item[0] == "fail_all":
                self._fail_all(item[1])
                continue
            if item[0] == "call":
                _, fn, future = item
                if not future.set_running_or_notify_cancel():  # its caller has gone
                    continue
                # The adapters are republished before the caller hears back: a client told
                # "loaded" may use the adapter in its very next request.
                try:
                    result = fn(self.engine)
                except Exception as e:  # the caller's to answer
                    self._publish_loras()
                    future.set_exception(e)
                else:
                    self._publish_loras()
                    future.set_result(result)
                continue
            if item[0] == "abort":
                self.engine.abort_request(item[1])  # frees its blocks before the next step
                self._deliver_error(item[1], RequestAbortedError(f"request {item[1]} was aborted"))
                continue
            _, rid, text, ids, params, arrival, salt, lora = item
            with self._cond:
                live = rid in self._streams
            if not live:  # failed by an engine error while it sat in the inbox
                continue
            known = self.engine.lora
            if isinstance(lora, str) and (known is None or lora not in known):
                self._deliver_error(rid, LoRANotLoadedError(
                    f"the LoRA adapter '{lora}' was unloaded"))
                continue
            try:
                self.engine.add_request(rid, text, params, arrival, prompt_token_ids=ids,
                                        cache_salt=salt, lora_request=lora)
            except Exception as e:  # e.g. the context shrank since validation: tell the caller
                self._deliver_error(rid, e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
                if stream is not None:
                    by_loop.setdefault(stream._loop, []).append((stream._queue, out))
        # One hand-over per event loop and step, not one per request: each wakes the loop
        # (a write to its self-pipe) and takes the GIL, 64 times a step at 64 streams.
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(error)

    def _fail_all(self, error: BaseException) -> bool:
        """Give every live request the error and abort it; False if the engine is left unclean."""
        with self._cond:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(error)
        try:
            for rid in streams:
                self.engine.abort_request(rid)
            return not self.engine.has_unfinished_requests()
        except Exception:
            logger.exception("could not abort requests after an engine error")
            return False

    def _publish(self, num_added: int) -> None:
        sched, stats = self.engine.scheduler, self.engine.stats
        bm = self.engine.block_manager
        lora = self.engine.lora
        snap = EngineSnapshot(lora_resident=tuple(lora.resident) if lora else (),
                              lora_loads=lora.loads if lora else 0,
                              num_running=sched.num_running, num_waiting=sched.num_waiting,
                              kv_cache_usage=bm.usage, num_preemptions=sched.num_preemptions,
                              prefix_cache_queries=bm.num_queried_tokens,
                              prefix_cache_hits=bm.num_hit_tokens, stats=replace(stats))
        with self._cond:
            self.snapshot = snap
            self._num_pending -= num_added
