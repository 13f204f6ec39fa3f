"""Flax NNX building blocks that meet zjax's layer schedule and tensor parallelism: the
layer ``Stack``, one attention function for every backend, the tiled MLP, the chunked loss,
FP8 matmuls and Megatron's tensor-parallel operators.

It imports only the runtime (mesh axes, the traced platform), ``zjax.errors`` and the FP8
scaling of ``zjax.partition.fp8``; models and any user's model import it."""

from zjax.nn.fp8 import fp8_matmul
from zjax.nn.mlp import tiled
from zjax.nn.stack import Stack, bind_runners, iter_stacks, layer_only
from zjax.nn.tensor_parallel import column_parallel_input, model_axis_size, row_parallel_output

__all__ = [
    "Stack",
    "bind_runners",
    "column_parallel_input",
    "fp8_matmul",
    "iter_stacks",
    "layer_only",
    "model_axis_size",
    "row_parallel_output",
    "tiled",
]
