"""Where the streamed step's gradient shards go as the backward hands them over.

With a global-norm clip (or ``skip_nonfinite``) the update must wait for every gradient: the
shards go to the gradient swap files and the NVMe optimizer streams them after the backward
(DeepSpeed's order). Without either, nothing in the update depends on the other layers: each
layer's shards go straight into the optimizer's step in progress
(:class:`~zjax.offload.nvme.Update`) while the devices run the next layer's backward, so the
update's reads and writes of master and moments overlap the backward's compute and the
gradients never touch the disk (with micro-batches, the earlier ones' sums still wait in the
files).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zjax.offload import Update, sum_squares
from zjax.step._stream_io import GradFiles

__all__ = ["Handoff", "ParamNorm"]


class ParamNorm:
    """A sink of the optimizer's new master values: the sum of squares of the shards this
    process owns (:attr:`sumsq`)."""

    def __init__(self, leaves: list) -> None:
        self.owned: dict[str, bool] = {}
        for leaf in leaves:
            self.owned.update(zip(leaf.names, leaf.owned, strict=True))
        self.sumsq = 0.0

    def __call__(self, name: str, start: int, values: np.ndarray) -> None:
        del start
        if self.owned[name]:
            self.sumsq += sum_squares(values)


class Handoff:
    """One micro-batch's gradient shards: into ``grads`` (the swap files), or, given ``run``,
    summed with what the files hold and applied by ``run`` with ``sink`` receiving the new
    master values.

    Args:
      grads: the gradients' swap files.
      first: the first micro-batch (nothing to add from the files).
      last: the last micro-batch (its sums are final: counted in the gradient norm).
      run: the optimizer step the shards go straight into (last micro-batch only), or None.
      sink: receives the new master values with ``run``.
    """

    def __init__(self, grads: GradFiles, *, first: bool, last: bool, run: Update | None = None,
                 sink: ParamNorm | None = None):
        if run is not None and not last:
            raise ValueError("only the last micro-batch's gradients are final")
        self.grads, self.first, self.last = grads, first, last
        self.run, self.sink = run, sink

    def put(self, j: int, g: jax.Array, *, layer: tuple[int, int] | None) -> None:
        """Leaf ``j``'s gradient ``g`` (``layer``: ``(i, n_layers)`` of a stacked leaf)."""
        if self.run is None:
            self.grads.put(j, g, layer=layer, first=self.first, last=self.last)
            return
        for name, start, values in self.grads.summed(j, g, layer=layer, first=self.first,
                                                     last=True):
            self.run.ranges([(name, start, values.size)], _slicer(start, values), self.sink)


def _slicer(start: int, values: np.ndarray) -> Any:
    def grad(name: str, a: int, n: int) -> np.ndarray:
        del name
        return values[a - start:a - start + n]

    return grad
