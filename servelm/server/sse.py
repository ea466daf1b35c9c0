"""EventStreamResponse: the streamed response every route's stream uses (OpenAI's and
Anthropic's SSE, Responses' events, Ollama's NDJSON), below api.py and its adapters so
each imports it without importing the app."""

from __future__ import annotations

from typing import Callable

import anyio
from fastapi.responses import StreamingResponse


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and abort their requests, as soon as the client leaves.

    Starlette only listens for the disconnect under old ASGI versions; here we always do,
    so a request still waiting in the queue (sending nothing) is aborted too.
    """

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection closed mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()
