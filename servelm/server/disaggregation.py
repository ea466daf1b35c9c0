"""A server's part in disaggregated prefill and decode (its --role): a prefill server answers a
request carrying `kv_transfer_params: {"do_remote_decode": true, "remote_host", "remote_port"}`
(vLLM's field) as usual, then sends the prompt's KV blocks to that decode server's receiver
and says in the answer's `kv_transfer_params` what arrived; a decode server receives blocks
into its prefix cache, so the same prompt sent to it next is computed only past them
(servelm.distributed.kv_transfer; the router does both sends: servelm.router)."""

from __future__ import annotations

import asyncio
import logging

from servelm.distributed.kv_transfer import (KVReceiver, KVSender, KVTransferConfig,
                                             KVTransferError)
from servelm.server.errors import APIError

logger = logging.getLogger(__name__)

PARAM = "kv_transfer_params"
_KNOWN = {"do_remote_decode": bool, "do_remote_prefill": bool, "remote_host": str,
          "remote_port": int}


class Disaggregation:
    """The sender and receiver of one server, built once its engine runs."""

    def __init__(self, config: KVTransferConfig, engine):
        self.config = config
        self.engine = engine
        llm = engine.engine
        why = llm.kv_transfer_check()
        if why is not None and (config.sends or config.receives):
            raise ValueError(f"--role {config.role} cannot move KV blocks: {why}")
        self.why_not = why
        layout = llm.kv_layout() if why is None else None
        self.sender = (KVSender(layout, config.shm, config.timeout)
                       if config.sends and why is None else None)
        self.receiver = None
        if config.receives:
            self.receiver = KVReceiver(config.host, config.port or 0, layout, self._import,
                                       config.shm, config.timeout)

    def _import(self, token_ids: list[int], salt: str | None, data) -> int:
        """On a receiver's thread: the engine thread's import, waited for."""
        future = self.engine.submit(lambda e: e.import_prefix(token_ids, salt, data))
        return future.result(timeout=self.config.timeout)

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()

    def report(self) -> dict:
        """GET /v1/stats' kv_transfer: the role, where this server receives, the counts."""
        r = self.receiver
        return {"role": self.config.role,
                "receiver": None if r is None else {"host": r.host, "port": r.port,
                                                    "shm": self.config.shm},
                "sent": None if self.sender is None else self.sender.stats.report(),
                "received": None if r is None else r.stats.report()}

    def target(self, params: dict | None, stream: bool, num_prompts: int,
               lora: str | None) -> tuple[str, int] | None:
        """The decode server a request's kv_transfer_params asks its prompt's KV be sent to,
        or None; a 400 naming the field for what cannot be done."""
        if params is None:
            return None
        for key, value in params.items():
            kind = _KNOWN.get(key)
            if kind is None:
                raise APIError(400, f"unknown field {PARAM}.{key}: servelm reads "
                                    f"{', '.join(sorted(_KNOWN))}", param=f"{PARAM}.{key}",
                               code="invalid_value")
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise APIError(400, f"{PARAM}.{key} must be a {kind.__name__}",
                               param=f"{PARAM}.{key}", code="invalid_value")
        if not params.get("do_remote_decode"):
            return None  # do_remote_prefill: the blocks are in the prefix cache already
        if self.sender is None:
            why = (self.why_not if self.config.sends else
                   f"its role is {self.config.role} (a prefill server sends: --role prefill)")
            raise APIError(400, f"this server cannot send KV blocks: {why}",
                           param=f"{PARAM}.do_remote_decode", code="invalid_value")
        for key in ("remote_host", "remote_port"):
            if key not in params:
                raise APIError(400, f"{PARAM}.do_remote_decode needs {PARAM}.{key}",
                               param=f"{PARAM}.{key}", code="invalid_value")
        if not 0 < params["remote_port"] < 65536:
            raise APIError(400, f"{PARAM}.remote_port must be in [1, 65535]",
                           param=f"{PARAM}.remote_port", code="invalid_value")
        if stream:
            raise APIError(400, f"{PARAM}.do_remote_decode needs stream false (the KV is sent "
                                "once the prompt has run)", param="stream", code="invalid_value")
        if num_prompts != 1:
            raise APIError(400, f"{PARAM}.do_remote_decode takes one prompt, got {num_prompts}",
                           param="prompt", code="invalid_value")
        if lora is not None:
            raise APIError(400, f"{PARAM}.do_remote_decode is not available with a LoRA "
                                "adapter (its blocks are salted by this server's load of it)",
                           param="model", code="invalid_value")
        return params["remote_host"], params["remote_port"]

    async def send(self, token_ids: list[int], salt: str | None,
                   target: tuple[str, int]) -> dict:
        """The finished prompt's cached blocks sent to target; what the answer reports
        (an "error" instead when they could not be: the decode server then computes the
        prompt itself)."""
        ids = list(token_ids)
        try:
            n, data = await self.engine._call(lambda e: e.export_prefix(ids, salt))
            if n == 0:
                return {"tokens": 0, "cached_tokens": 0, "bytes": 0, "transport": None,
                        "seconds": 0.0}
            return await asyncio.to_thread(self.sender.send, *target, ids[:n], salt, data)
        except (KVTransferError, RuntimeError) as e:
            logger.warning("KV transfer to %s:%d failed: %s", *target, e)
            return {"error": str(e)}
