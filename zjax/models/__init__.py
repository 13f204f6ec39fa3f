"""Reference models used by configs, tests and benchmarks."""

from zjax.models.gpt import GPT, GPTConfig, lm_loss

__all__ = ["GPT", "GPTConfig", "lm_loss"]
