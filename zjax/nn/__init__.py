"""Flax NNX building blocks that meet zjax's layer schedule."""

from zjax.nn.stack import Stack, bind_runners, iter_stacks

__all__ = ["Stack", "bind_runners", "iter_stacks"]
