"""What a plan reads of the streamed step: every program it runs, compiled, how many times a
step runs each, and the step's device memory at its peak.

A step runs, per micro-batch, each segment's forward and backward and the loss once, and each
Stack call's layer forward and backward once per layer. The device holds, besides the program
running: the leaves outside the Stacks (read once per step) and their float32 gradients, the
saved layer inputs (unless ``zero.offload_activations`` keeps them in host memory), and the
layers the host has put on the devices ahead of the one computing (``AHEAD``). The peak is the
largest, over the programs, of the program's own compiled peak plus what is held beside it
(nothing held is counted twice: a segment takes the non-Stack leaves as arguments, a layer
program does not). All of it is per device and depends on the depth only through the saved
inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zjax.partition.plan import ShardPlan
from zjax.step._nvme import NvmeOptimizer
from zjax.step._stream_io import check_buffer, layer_elements
from zjax.step._stream_programs import Programs

__all__ = ["StreamCompiled", "StreamFigures", "StreamLowered", "stream_figures"]


def _device_bytes(tree: Any, n_devices: int) -> int:
    """Bytes per device of abstract arrays: a placed one's shard, a per-device one (leading
    axis of one per device) its share."""
    total = 0
    for a in jax.tree.leaves(tree):
        sharding = getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if sharding is not None else a.shape
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        total += size if sharding is not None else size // n_devices
    return total


@dataclasses.dataclass(frozen=True)
class _Memory:
    """``memory_analysis()`` of the whole step, in the compiler's field names."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    temp_size_in_bytes: int
    alias_size_in_bytes: int
    host_argument_size_in_bytes: int = 0
    host_output_size_in_bytes: int = 0
    host_temp_size_in_bytes: int = 0
    generated_code_size_in_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StreamFigures:
    """The streamed step's programs compiled for figures.

    Attributes:
      programs: ``(name, compiled, runs per step, bytes held beside it)`` of each.
      held: per device, what stays on the devices between programs: ``nonstack_params``,
        ``nonstack_grads``, ``saved_inputs`` (0 in device memory when offloaded),
        ``layers_ahead``, and ``saved_inputs_host``.
      traffic: per device, ``grad_file_bytes`` (the gradients' swap files) and per step
        ``nvme_read_bytes`` and ``nvme_written_bytes`` (layers
        read forward and backward, gradients written and read back, the update's master,
        moments and gradients), and ``stream_host_bytes``: the host buffers (layers read
        ahead, the update's sub-groups in flight), this process's over its devices.
    """

    programs: tuple[tuple[str, Any, int, int], ...]
    held: dict[str, int]
    traffic: dict[str, int]

    def _peak(self) -> tuple[Any, int]:
        def peak(entry):
            mem = entry[1].memory_analysis()
            return (mem.argument_size_in_bytes + mem.output_size_in_bytes
                    + mem.temp_size_in_bytes - mem.alias_size_in_bytes + entry[3])

        best = max(self.programs, key=peak)
        return best[1], best[3]

    def memory_analysis(self) -> _Memory:
        """The step's peak: its largest program's figures, the bytes held beside it counted
        as arguments (they are the step's state while it runs); the offloaded saved inputs
        as host temporaries."""
        compiled, held = self._peak()
        mem = compiled.memory_analysis()
        return _Memory(int(mem.argument_size_in_bytes) + held, int(mem.output_size_in_bytes),
                       int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes),
                       host_temp_size_in_bytes=self.held["saved_inputs_host"])

    def as_text(self) -> str:
        """The peak program's compiled HLO."""
        return self._peak()[0].as_text()

    def stream_bytes(self, state_nvme: int) -> dict[str, int]:
        """What a plan adds to its per-device figures: :attr:`traffic`, and ``nvme_bytes``:
        ``state_nvme`` (master and moments) plus the gradients' swap files."""
        extra = {k: v for k, v in self.traffic.items() if k != "grad_file_bytes"}
        return {**extra, "nvme_bytes": state_nvme + self.traffic["grad_file_bytes"]}

    def weighted_texts(self) -> list[tuple[str, int]]:
        """Each program's compiled HLO with the times a step runs it (a plan's collective
        bytes per step)."""
        return [(compiled.as_text(), runs) for _, compiled, runs, _ in self.programs]


def stream_figures(programs: Programs, batch: Any, compile: Callable[[Any], Any], *,
                   engine: NvmeOptimizer, micro_batches: int, ahead: int,
                   overlap: bool = False) -> StreamFigures:
    """Compile every program of a step on ``batch`` (its micro-batch's shape) with
    ``compile(lowered)``; see the module docstring for what is held beside each.
    ``overlap``: the last micro-batch's gradients go straight into the update (no clip),
    not through the gradients' files.

    Raises:
      ConfigError: a layer does not fit ``zero.offload_param.buffer_size``.
    """
    plan = programs.plan
    check_buffer(engine, programs, plan.zero.offload_param.buffer_size)
    n_dev = plan.mesh.devices.size
    nonstack, outputs, entries, saved = _nonstack(plan, programs), [], [], 0
    grads = [jax.ShapeDtypeStruct(a.shape, np.float32, sharding=a.sharding) for a in nonstack]
    # float32 gradients of the non-Stack leaves: one sum, and one per micro-batch beside it
    held = {"nonstack_params": _device_bytes(nonstack, n_dev),
            "nonstack_grads": _device_bytes(grads, n_dev) * (1 if micro_batches == 1 else 2)}
    layer_max, index = 0, jax.ShapeDtypeStruct((), np.int32)
    for c, call in enumerate(programs.calls):
        shards, x, context = programs.layer_args(c, batch)
        layer_max = max(layer_max, _device_bytes(shards, n_dev))
        saved += call.n_layers * _device_bytes(x, n_dev)
        entries += [(f"segment {c} forward", programs.cut_fwd(c), (nonstack, batch, outputs),
                     1, True),
                    (f"segment {c} backward", programs.cut_bwd(c),
                     (nonstack, batch, outputs, x), 1, True),
                    (f"{call.path} layer forward", programs.layer_fwd(c),
                     (shards, x, context, index), call.n_layers, False),
                    (f"{call.path} layer backward", programs.layer_bwd(c),
                     (shards, x, context, index, x), call.n_layers, False)]
        outputs = [*outputs, x]
    entries.append(("loss", programs.tail(grads=True), (nonstack, batch, outputs), 1, True))
    offloaded = plan.zero.offload_activations
    held |= {"saved_inputs": 0 if offloaded else saved, "layers_ahead": ahead * layer_max,
             "saved_inputs_host": saved if offloaded else 0}
    beside = held["nonstack_grads"] + held["saved_inputs"] + held["layers_ahead"]
    compiled = tuple(
        (name, compile(fn.lower(*args)), runs * micro_batches,
         beside + (0 if takes_nonstack else held["nonstack_params"]))
        for name, fn, args, runs, takes_nonstack in entries)
    return StreamFigures(compiled, held, _traffic(programs, engine, micro_batches, overlap))


def _traffic(programs: Programs, engine: NvmeOptimizer, micro_batches: int,
             overlap: bool) -> dict[str, int]:
    """Per device: NVMe bytes a step reads and writes, and the stream's host buffers."""
    plan = programs.plan
    own = lambda leaf: int(np.prod(NamedSharding(plan.mesh, leaf.spec).shard_shape(leaf.shape),
                                   dtype=np.int64))
    stacked = 4 * sum(own(leaf) for leaf in plan.leaves if leaf.stacked)
    total = 4 * sum(own(leaf) for leaf in plan.leaves)
    mb, parts = micro_batches, engine.n_parts
    processes = len({d.process_index for d in plan.mesh.devices.flat})
    local = plan.mesh.devices.size // processes
    section = plan.zero.offload_param
    sub = min(plan.zero.sub_group_size, max(engine.sizes.values(), default=1))  # the stream's
    buffers = (section.buffer_count * layer_elements(engine, programs) * 4
               + 2 * engine.section.buffer_count * sub * 4 * (parts + 1))
    # the gradients' files: each micro-batch's sums of the Stacks' layers written, read back
    # by the next one and by the update; the rest summed on the devices, written once and
    # read by the update; with overlap the last micro-batch's go straight into the update
    grad_io = (mb - 1) * stacked if overlap else mb * stacked + (total - stacked)
    return {"grad_file_bytes": total,
            "nvme_read_bytes": 2 * mb * stacked + (total - stacked) + parts * total + grad_io,
            "nvme_written_bytes": parts * total + grad_io,
            "stream_host_bytes": buffers // local}


def _nonstack(plan: ShardPlan, programs: Programs) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(leaf.shape, plan.stored_param_dtype(leaf),
                                 sharding=NamedSharding(plan.mesh, leaf.spec))
            for leaf in programs.nonstack]


class StreamLowered:
    """The streamed step for a batch shape: ``compile`` makes it callable, ``compile_each``
    gives a plan its figures (:class:`StreamFigures`).

    Args:
      step: the streamed step (called by the compiled step).
      figures: ``figures(compile)``: every program compiled by ``compile(lowered)``, with
        the step's figures (:func:`stream_figures` with the rest bound).
    """

    def __init__(self, step: Callable, figures: Callable[[Callable], StreamFigures]):
        self._step, self._figures = step, figures

    def compile_each(self, compile: Callable[[Any], Any]) -> StreamFigures:
        """Every program of a step compiled by ``compile(lowered)``, with its figures."""
        return self._figures(compile)

    def compile(self, compiler_options: dict | None = None) -> StreamCompiled:
        return StreamCompiled(self, compiler_options)


class StreamCompiled:
    """A streamed step: callable as the step; ``memory_analysis()``, ``as_text()`` and
    ``weighted_texts()`` are the whole step's (its programs compiled when first asked)."""

    def __init__(self, lowered: StreamLowered, compiler_options: dict | None):
        self._lowered, self._options, self._figures = lowered, compiler_options, None

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        return self._lowered._step(state, batch)

    def figures(self) -> StreamFigures:
        if self._figures is None:
            self._figures = self._lowered.compile_each(
                lambda lowered: lowered.compile(self._options))
        return self._figures

    def memory_analysis(self) -> Any:
        return self.figures().memory_analysis()

    def as_text(self) -> str:
        return self.figures().as_text()

    def weighted_texts(self) -> list[tuple[str, int]]:
        return self.figures().weighted_texts()

    def stream_bytes(self, state_nvme: int) -> dict[str, int]:
        return self.figures().stream_bytes(state_nvme)
