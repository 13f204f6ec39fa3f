"""Models: a model as init + loss over stored params (``Trainable``: ``from_nnx`` for a Flax NNX
module, ``from_pytree`` for any JAX model through the gather-on-use transform), and the
reference models used by configs, tests and benchmarks (``GPT``, ``Llama``).

``GPTConfig`` and ``LlamaConfig`` (the ``model`` sections) load without Flax: a config
validates without the model; the rest loads on first use (PEP 562). It imports ``zjax.nn``,
``zjax.lora``, ``zjax.partition`` and the runtime; never the step or anything above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zjax._lazy import exports
from zjax.models.config import GPTConfig, LlamaConfig

__all__ = [
    "DROPOUT_KEYS",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Packing",
    "Trainable",
    "adapted_weights",
    "adapters_off",
    "from_nnx",
    "from_pytree",
    "lm_loss",
    "model_class",
    "router_losses",
    "sequence_logps",
    "split_batch",
    "token_losses",
    "with_adapters",
]

_LAZY = {"GPT": "zjax.models.gpt", "lm_loss": "zjax.models.gpt", "Llama": "zjax.models.llama",
         "Trainable": "zjax.models.trainable", "from_nnx": "zjax.models.trainable",
         "from_pytree": "zjax.models.trainable", "Packing": "zjax.models._batch",
         "DROPOUT_KEYS": "zjax.models._batch", "adapted_weights": "zjax.models._linears",
         "adapters_off": "zjax.models._linears", "sequence_logps": "zjax.models._lm",
         "router_losses": "zjax.models._lm", "token_losses": "zjax.models._lm",
         "split_batch": "zjax.models._batch", "with_adapters": "zjax.models._adapted"}


__getattr__ = exports(__name__, _LAZY)


def model_class(config: Any) -> type | None:
    """The reference model a ``model`` section builds (``GPT`` for a :class:`GPTConfig`,
    ``Llama`` for a :class:`LlamaConfig`); None for another loop's section."""
    name = {GPTConfig: "GPT", LlamaConfig: "Llama"}.get(type(config))
    return None if name is None else __getattr__(name)


if TYPE_CHECKING:
    from zjax.models._adapted import with_adapters
    from zjax.models._batch import DROPOUT_KEYS, Packing, split_batch
    from zjax.models._linears import adapted_weights, adapters_off
    from zjax.models._lm import router_losses, sequence_logps, token_losses
    from zjax.models.gpt import GPT, lm_loss
    from zjax.models.llama import Llama
    from zjax.models.trainable import Trainable, from_nnx, from_pytree
