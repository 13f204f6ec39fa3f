"""Generation with a key/value cache from any model with ``init_cache`` and ``decode`` (the
reference GPT and Llama): ``generate``, the token choice ``pick`` (temperature, nucleus) and
``until_stop``. Used by ``zjax sample`` and by RL rollouts.

It imports ``zjax.errors``, JAX and Flax only.
"""

from zjax.generate._decode import generate, pick, until_stop

__all__ = ["generate", "pick", "until_stop"]
