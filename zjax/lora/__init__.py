"""Low-rank adapters (LoRA) over a frozen base: the ``lora`` section, the adapters' params and
their matmul, used by the reference models' linear layers.

It owns the ``lora`` section (``zjax.lora.config``, light: a config validates without Flax)
and imports only ``zjax.nn`` (the tensor-parallel operators), ``zjax.errors`` and
``zjax.schema``; the rest loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.lora.config import ALL_LINEAR, GPT2_LINEAR_NAMES, LINEAR_NAMES, LoraConfig

_LAZY = {
    "ADAPTER_SUFFIXES": "zjax.lora._adapters",
    "AdapterDropout": "zjax.lora._dropout",
    "row_keys": "zjax.lora._dropout",
    "adapter_pair": "zjax.lora._adapters",
    "is_adapter": "zjax.lora._adapters",
    "lora_matmul": "zjax.lora._adapters",
    "merged_weight": "zjax.lora._adapters",
    "BaseCodec": "zjax.lora._quant",
    "dequantize": "zjax.lora._quant",
    "quantize": "zjax.lora._quant",
}

__all__ = [
    "ADAPTER_SUFFIXES",
    "ALL_LINEAR",
    "GPT2_LINEAR_NAMES",
    "LINEAR_NAMES",
    "AdapterDropout",
    "BaseCodec",
    "LoraConfig",
    "adapter_pair",
    "dequantize",
    "is_adapter",
    "lora_matmul",
    "merged_weight",
    "quantize",
    "row_keys",
]

__getattr__ = exports(__name__, _LAZY)

if TYPE_CHECKING:
    from zjax.lora._adapters import (
        ADAPTER_SUFFIXES,
        adapter_pair,
        is_adapter,
        lora_matmul,
        merged_weight,
    )
    from zjax.lora._dropout import AdapterDropout, row_keys
    from zjax.lora._quant import BaseCodec, dequantize, quantize
