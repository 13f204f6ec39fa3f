"""Generation with a key/value cache from any model with ``init_cache`` and ``decode`` (the
reference GPT and Llama): ``generate`` (also of left-padded prompts of different lengths),
its traceable core ``decode_tokens`` (for callers inside their own ``jit``), the token choice
``pick`` (temperature, nucleus) and ``until_stop``. Used by ``zjax sample`` and by RL rollouts.

It imports ``zjax.errors``, JAX and Flax only.
"""

from zjax.generate._decode import decode_tokens, generate, pick, until_stop

__all__ = ["decode_tokens", "generate", "pick", "until_stop"]
