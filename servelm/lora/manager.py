"""Which LoRA adapters the engine knows, and which of them are resident in the model's slots.

Registering an adapter loads and checks it at once (so a bad path or shape is refused when it
is named, never in the middle of a step) and keeps its weights in host memory. A step names
the adapters its rows use (the scheduler admits at most max_loras distinct ones a step);
`slots_for` makes each one resident, writing it into a free slot or into the least recently
used slot no row of this step needs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable

import torch

from servelm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """The registered adapters (name -> LoRARequest and loaded weights) and the resident ones
    (name -> slot, least recently used first) of one model's wrapped layers."""

    def __init__(self, layers: dict, max_loras: int, max_rank: int, model_config,
                 plan=None):
        """layers: the wrapped LoRALinears by module path (servelm.lora.wrap.apply_lora).
        plan: this rank's servelm.distributed.sharding.ShardPlan under tensor parallelism
        (each adapter written as its shard), else None."""
        self.layers = layers
        self.plan = plan
        # Called as on_write(slot, name, path) after an adapter is written into a slot (the
        # tensor-parallel executor has the other ranks write their shards).
        self.on_write = None
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.model_config = model_config
        self.requests: dict[str, LoRARequest] = {}
        self._weights: dict[str, object] = {}  # name -> servelm.lora.loader.LoRAAdapter
        self.resident: OrderedDict[str, int] = OrderedDict()
        self._next_id = 1
        self.loads = 0  # adapters written into a slot (residency misses)
        # name -> which registration it is (a count over every add): the prefix-cache salt,
        # so an adapter loaded again under its name never reads its old weights' KV.
        self.generation: dict[str, int] = {}
        self._generations = 0

    @classmethod
    def of_worker(cls, worker, config, model_config, plan=None) -> "LoRAManager | None":
        """The manager over a ModelWorker's wrapped layers (config: the EngineConfig; plan:
        the rank's ShardPlan under tensor parallelism), None when LoRA is off."""
        if worker.lora_layers is None:
            return None
        return cls(worker.lora_layers, config.lora.max_loras, config.lora.max_lora_rank,
                   model_config, plan=plan)

    def __contains__(self, name: str) -> bool:
        return name in self.requests

    def get(self, name: str) -> LoRARequest | None:
        return self.requests.get(name)

    def load(self, request: LoRARequest):
        """The adapter's weights read and checked against the model (LoRAError naming what
        does not fit), not registered: touches nothing add() changes, so another thread may
        run it while the engine steps (AsyncLLMEngine.add_lora)."""
        from servelm.lora.loader import LoRAError, load_adapter

        if not request.lora_path:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has no path")
        adapter = load_adapter(request.lora_path, self.model_config, name=request.lora_name,
                               max_rank=self.max_rank)
        missing = [m for m in adapter.modules if m not in self.layers]
        if missing:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} adapts {missing[0]}, which "
                            f"this model does not adapt")
        return adapter

    def add(self, request: LoRARequest, adapter=None) -> LoRARequest:
        """Register an adapter (loaded and checked here unless `adapter` is load()'s result
        for it); the same name and path again is a no-op. LoRAError (a ValueError) naming
        what does not fit."""
        from servelm.lora.loader import LoRAError

        old = self.requests.get(request.lora_name)
        if old is not None:
            if old.lora_path == request.lora_path:
                return old
            raise LoRAError(f"a LoRA adapter named {request.lora_name!r} is already loaded "
                            f"(from {old.lora_path}); unload it first")
        if adapter is None:
            adapter = self.load(request)
        self.requests[request.lora_name] = request
        self._weights[request.lora_name] = adapter
        self._generations += 1
        self.generation[request.lora_name] = self._generations
        self._next_id = max(self._next_id, request.lora_int_id + 1)
        logger.info("LoRA adapter %s: rank %d, %d modules, from %s", request.lora_name,
                    adapter.rank, len(adapter.modules), request.lora_path)
        return request

    def register(self, name: str, path: str) -> LoRARequest:
        """add() under a new id."""
        old = self.requests.get(name)
        req = LoRARequest(name, old.lora_int_id if old else self._next_id, path)
        return self.add(req)

    def remove(self, name: str) -> None:
        """Forget an adapter (KeyError if unknown); its slot is freed."""
        del self.requests[name]
        del self._weights[name]
        del self.generation[name]
        slot = self.resident.pop(name, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)

    def adapter(self, name: str):
        """The loaded weights (servelm.lora.loader.LoRAAdapter) of a registered adapter."""
        return self._weights[name]

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """Each named adapter's slot, made resident where it is not (at most max_loras names:
        the scheduler's limit)."""
        names = list(dict.fromkeys(names))
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step holds {len(names)} LoRA adapters, over max_loras "
                               f"{self.max_loras}")
        out = {}
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
                out[name] = self.resident[name]
        for name in names:
            if name in out:
                continue
            used = set(self.resident.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used resident adapter this step does not need
                victim = next(n for n in self.resident if n not in out)
                slot = self.resident.pop(victim)
            self._write(name, slot)
            self.resident[name] = slot
            out[name] = slot
        return out

    def _write(self, name: str, slot: int) -> None:
        adapter = self._weights[name]
        for path, layer in self.layers.items():
            parts = adapter.modules.get(path)
            if parts is None:
                layer.clear_slot(slot)
            else:
                layer.set_slot(slot, parts if self.plan is None
                               else shard_parts(path, parts, self.plan))
        self.loads += 1
        if self.on_write is not None:
            self.on_write(slot, name, self.requests[name].lora_path)

    def write(self, slot: int, name: str, path: str) -> None:
        """A tensor-parallel worker: write its shard of the adapter rank 0 wrote into slot
        (registered from path on first sight)."""
        if name not in self.requests or self.requests[name].lora_path != path:
            if name in self.requests:
                self.remove(name)
            self.register(name, path)
        for other, s in list(self.resident.items()):
            if s == slot:
                del self.resident[other]
        self._write(name, slot)
        self.resident[name] = slot

    def slot_bytes(self) -> int:
        """Bytes one resident slot takes across the model's adapted layers."""
        return sum(layer.slot_bytes() for layer in self.layers.values())


def shard_parts(path: str, parts: list, plan) -> list:
    """An adapted layer's parts as this rank holds them (Megatron's split, as the base's:
    servelm.distributed.sharding): column-parallel qkv_proj and gate_up_proj keep the rank's
    rows of each part's B (its heads, its slice of the intermediate size) and all of A;
    row-parallel o_proj and down_proj keep the rank's columns of A and all of B, their
    partial deltas summed by the layer's all-reduce with its output. A gated DeltaNet's
    in_proj_qkvz and in_proj_ba keep the rows of the rank's key heads and their value
    heads (q, k, v; z; b; a), its out_proj the columns of those value heads."""
    plan = plan.for_layer(int(path.split(".")[1]))  # path: layers.{i}.<section>.<name>
    D = plan.head_dim
    q = slice(plan.q_heads[0] * D, plan.q_heads[1] * D)
    kv = slice(plan.kv_heads[0] * D, plan.kv_heads[1] * D)
    inter = slice(*plan.intermediate)
    kind = path.rsplit(".", 1)[1]
    rows = {"qkv_proj": (q, kv, kv), "gate_up_proj": (inter, inter),
            "attn_gate": (q,), "c_fc": (inter,)}.get(kind)
    cols = {"o_proj": q, "down_proj": inter, "c_proj": inter}.get(kind)
    if kind in ("in_proj_qkvz", "in_proj_ba", "out_proj"):  # a gated DeltaNet's key heads
        dk, dv, key = plan.lin_dk, plan.lin_dv, plan.total_lin_k_heads * plan.lin_dk
        kh = torch.arange(plan.lin_k_heads[0] * dk, plan.lin_k_heads[1] * dk)
        vh = slice(plan.lin_v_heads[0] * dv, plan.lin_v_heads[1] * dv)
        vi = torch.arange(vh.start, vh.stop)
        heads = slice(*plan.lin_v_heads)
        rows = {"in_proj_qkvz": (torch.cat([kh, key + kh, 2 * key + vi]), vh),
                "in_proj_ba": (heads, heads)}.get(kind)
        cols = vh if kind == "out_proj" else None
    out = []
    for j, ab in enumerate(parts):
        if ab is None:
            out.append(None)
        elif rows is not None:
            out.append((ab[0], ab[1][rows[j]]))
        else:
            out.append((ab[0][:, cols], ab[1]))
    return out
