"""Flax NNX building blocks that meet zjax's layer schedule and tensor parallelism."""

from zjax.nn.mlp import tiled
from zjax.nn.stack import Stack, bind_runners, iter_stacks
from zjax.nn.tensor_parallel import column_parallel_input, model_axis_size, row_parallel_output

__all__ = [
    "Stack",
    "bind_runners",
    "column_parallel_input",
    "iter_stacks",
    "model_axis_size",
    "row_parallel_output",
    "tiled",
]
