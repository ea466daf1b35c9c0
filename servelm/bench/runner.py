"""Request scheduling: a fixed number in flight, or Poisson arrivals at a given rate."""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from start) of n requests arriving as a Poisson process.

    Inter-arrival gaps are exponential with mean 1/rate; the first request goes at 0 so
    the run does not open with idle time. rate=inf: all at 0.
    """
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


async def run_requests(items: Sequence[T], send: Callable[[int, T], Awaitable[R]], *,
                       concurrency: int | None = None, request_rate: float = math.inf,
                       seed: int = 0,
                       on_done: Callable[[R], None] | None = None) -> tuple[list[R], float]:
    """Send every item through send(index, item); results in item order and the wall time.

    concurrency: keep exactly this many requests in flight (a pool of workers), ignoring
    request_rate. Otherwise requests start at Poisson arrival times at request_rate per second,
    however many are still running. send must not raise for failed requests: it returns a
    result describing the failure, so one bad request cannot end the run.
    """
    results: list[R | None] = [None] * len(items)

    async def one(i: int) -> None:
        results[i] = r = await send(i, items[i])
        if on_done is not None:
            on_done(r)

    start = time.perf_counter()
    if concurrency is not None:
        queue = iter(range(len(items)))  # shared: each worker takes the next index

        async def worker() -> None:
            for i in queue:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
    else:
        tasks = []
        for i, at in enumerate(poisson_arrivals(len(items), request_rate, seed)):
            # Sleep to an absolute time so scheduling delays do not accumulate into drift.
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - start  # type: ignore[return-value]
