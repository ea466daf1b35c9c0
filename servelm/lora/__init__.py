"""LoRA adapters: the request naming one (LoRARequest), their loading (loader), the resident
slots (manager) and the model's wrapped layers (wrap). The arithmetic is servelm.layers.lora's."""

from servelm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
