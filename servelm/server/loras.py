"""LoRA adapters through the server: vLLM's runtime routes POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (its bodies, spellings and plain-text answers), behind the API key,
and each registered adapter's /v1/models card (its base as `parent`, its path as `root`).

Which adapter a request runs with is its `model` field (ServingContext.adapter, checked by
every generating route); loads and unloads run on the engine thread between steps
(AsyncLLMEngine.add_lora / remove_lora), so a step never sees an adapter change under it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servelm.lora.request import LoRARequest
from servelm.server.errors import APIError, from_validation_error
from servelm.server.protocol import ModelCard
from servelm.server.serving import ServingContext

if TYPE_CHECKING:
    from servelm.server.api import Routes

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (what requests put in `model`) and its path (a PEFT
    directory or a llama.cpp GGUF LoRA file, on the server's machine). load_inplace: replace
    an adapter of that name (refused while requests use it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body; lora_int_id is accepted and not needed (names are unique)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def adapter_cards(ctx: ServingContext, base: ModelCard) -> list[ModelCard]:
    """/v1/models' entries of the registered adapters, as vLLM lists them."""
    return [card(base, r) for r in ctx.engine.loras.values()]


def card(base: ModelCard, lora: LoRARequest) -> ModelCard:
    """An adapter's entry: the base's (family, context length), its own name and path, and
    the base as its parent."""
    return base.model_copy(update={"id": lora.lora_name, "root": lora.lora_path,
                                   "parent": base.id})


def _check_enabled(ctx: ServingContext) -> None:
    if not ctx.engine.lora_enabled:
        raise APIError(400, "LoRA adapters are not enabled on this server: start it with "
                            "--enable-lora (or --lora-modules NAME=PATH)", code="lora_disabled")


def _parse(body: bytes, schema: type[BaseModel]) -> BaseModel:
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _openapi(schema: type[BaseModel]) -> dict:
    return {"openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema.model_json_schema()}}}},
        "response_class": PlainTextResponse,
        "responses": {200: {"description": "done: a line saying so",
                            "content": {"text/plain": {"schema": {"type": "string"}}}}}}


def add_routes(app: FastAPI, routes: Routes) -> None:
    ctx = routes.ctx

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(routes.check_api_key)],
              **_openapi(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = _parse(await routes.read(request), LoadLoRAAdapterRequest)
        _check_enabled(ctx)
        name = req.lora_name
        if name == ctx.model_name:
            raise APIError(400, f"'{name}' is the served model's name; an adapter needs a name "
                                f"of its own", param="lora_name", code="invalid_value")
        if name in ctx.engine.loras and not req.load_inplace:
            raise APIError(400, f"the LoRA adapter '{name}' is already loaded (from "
                                f"{ctx.engine.loras[name].lora_path}); unload it first, or send "
                                f"load_inplace true", param="lora_name", code="invalid_value")
        lora = LoRARequest(name, ctx.engine.new_lora_id(), req.lora_path)
        try:
            await ctx.engine.add_lora(lora, replace=req.load_inplace)
        except ValueError as e:  # the loader's LoRAError: what does not fit, named
            raise APIError(400, f"LoRA adapter '{name}' from {req.lora_path}: {e}",
                           param="lora_path", code="invalid_value") from None
        logger.info("LoRA adapter %s loaded from %s", name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(routes.check_api_key)],
              **_openapi(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = _parse(await routes.read(request), UnloadLoRAAdapterRequest)
        _check_enabled(ctx)
        name = req.lora_name
        try:
            await ctx.engine.remove_lora(name)
        except KeyError:
            raise APIError(404, f"the LoRA adapter '{name}' is not loaded", param="lora_name",
                           code="model_not_found") from None
        except ValueError as e:  # requests use it
            raise APIError(400, f"{e}: unload it once they finish", param="lora_name",
                           code="invalid_value") from None
        logger.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
