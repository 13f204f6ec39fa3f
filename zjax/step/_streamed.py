"""The streamed step: parameters and optimizer state on NVMe (ZeRO-Infinity's
``offload_param: {device: nvme}``), a model larger than host memory trained.

The one-program step takes every stored parameter as an input; this one runs the model as
per-layer programs driven from the host, as DeepSpeed's hooks do (:mod:`zjax.step._cuts`,
:mod:`zjax.step._stream_programs`). One step, per micro-batch:

1. forward: the segment before each ``Stack`` call, then its layers one program each; each
   layer's shards read from the float32 master in the swap files ``buffer_count`` layers ahead
   (:class:`~zjax.step._stream_io.LayerReader`), cast to the working dtype on the host, put
   on the devices while the previous layer computes. Only each layer's input is kept.
2. backward: the loss's gradients, then each layer again in reverse, read again and run
   from its saved input; its gradient shards (reduce-scattered by the gather's VJP) written
   behind into gradient swap files (summed over micro-batches).
3. the NVMe optimizer's streamed update (:class:`~zjax.offload.nvme.StreamingOptimizer`) over
   master, moments and those gradients, clipped by their global norm, divided by the count.
   Without a clip (or ``skip_nonfinite``) the last micro-batch's layer gradients go straight
   into that update during the backward instead (:mod:`zjax.step._stream_update`).

A step stopped once the update has begun marks the swap files torn (``engine.torn``): no
later step or save reads them.

Device memory holds a few layers' weights and the saved layer inputs, whatever the depth;
host memory the read-ahead buffers and the update's sub-groups, whatever the model's size.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.errors import ConfigError, NvmeError
from zjax.models.trainable import Trainable
from zjax.offload import Update, sum_squares
from zjax.partition.plan import ShardPlan
from zjax.runtime.mesh import batch_axes
from zjax.step._grads import _check_micro_batches, metric_values
from zjax.step._nvme import NvmeOptimizer, clip_scale
from zjax.step._nvme_engine import local_value, shard_data
from zjax.step._state import TrainState
from zjax.step._stream_figures import StreamLowered, stream_figures
from zjax.step._stream_io import GradFiles, LayerReader, read_leaf
from zjax.step._stream_programs import Programs
from zjax.step._stream_update import Handoff, ParamNorm

__all__ = ["StreamEngine", "StreamedStep", "check_streamable"]

KEY = "zero.offload_param.device"
AHEAD = 2  # layers the host dispatches before the devices have run them
HOST = "pinned_host"  # where zero.offload_activations keeps the saved layer inputs


def check_streamable(trainable: Trainable, plan: ShardPlan) -> None:
    """Refuse, by key, what the streamed step does not run."""
    refused = [
        (any(leaf.frozen for leaf in plan.leaves), "a frozen base (lora.rank)"),
        (trainable.prepare is not None, "a loss that prepares its batch (a preference "
                                        "reference model)"),
        (trainable.score is not None, "per-row scores (preference precompute, GRPO)"),
        (trainable.dropout_seed is not None, "dropout (lora.dropout)"),
        (plan.n_node > 1, "zero.hpz_partition_size"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{KEY}: nvme streams the layers of a plain training loss; "
                              f"{what} is not built with it: use device: host")


class StreamEngine(NvmeOptimizer):
    """The NVMe optimizer's swap files with no working params on the devices (they are read
    from the master as the layers run), plus the gradients' swap files."""

    keep_params = False

    def __init__(self, plan: ShardPlan, tx, abstract_master: Any, param_shardings: Any):
        super().__init__(plan, tx, abstract_master, param_shardings)
        self.grads: GradFiles | None = None

    def start(self, master: Any, step: int = 0) -> TrainState:
        """:meth:`NvmeOptimizer.start` (a fine-tune's given params: whole leaves sliced on the
        devices, so each shard must be addressable by int32 offsets)."""
        self.check_shards()
        return super().start(master, step)

    def open(self):
        opt = super().open()
        self.grads = GradFiles(self, self.section.nvme_path, threads=self.section.buffer_count,
                               key="zero.offload_param.nvme_path")
        return opt

    def start_by_layers(self, nonstack: Callable[[], list], layer: Callable[[int], list],
                        depth: int) -> TrainState:
        """Fresh swap files filled with the whole model never in memory: ``nonstack()``
        gives the float32 master of the leaves outside the Stacks (own shards), then
        ``layer(i)`` every stacked leaf's layer ``i`` (leading axis one; a Stack shallower
        than ``i`` is skipped), ``i < depth``. The state at step 0."""
        opt, sumsq = self.open(), 0.0
        stacked = [j for j, leaf in enumerate(self.plan.leaves) if leaf.stacked]
        others = [j for j, leaf in enumerate(self.plan.leaves) if not leaf.stacked]
        for i in range(-1, depth):
            arrays = nonstack() if i < 0 else layer(i)
            for j, x in zip(others if i < 0 else stacked, arrays, strict=True):
                leaf = self.leaves[j]
                if i >= 0 and i >= leaf.shape[0]:  # a shallower Stack: it has no layer i
                    continue
                for (name, data), owned in zip(shard_data(x, leaf), leaf.owned, strict=True):
                    values = np.asarray(data, np.float32).reshape(-1)
                    opt.write_initial_at(name, max(i, 0) * values.size, values)
                    sumsq += sum_squares(values) if owned else 0.0
            del arrays
        if jax.process_count() > 1:
            sumsq = float(multihost_utils.process_allgather(np.float64(sumsq)).sum())
        self.param_norm = math.sqrt(sumsq)
        return self.started(None, 0)

    def close(self) -> None:
        if self.grads is not None:
            self.grads.close()
            self.grads = None
        super().close()


class StreamedStep:
    """``step(state, batch) -> (state, metrics)`` with parameters and optimizer state on NVMe.

    ``lower(abstract_state, batch).compile()`` is callable as the step; its figures
    (``memory_analysis()``, ``as_text()``, ``weighted_texts()``, ``stream_bytes()``) are the
    whole step's, every program compiled when first asked
    (:mod:`zjax.step._stream_figures`). The metrics are :class:`~zjax.step._nvme.NvmeStep`'s,
    with ``nvme_read_gbs`` / ``nvme_write_gbs`` over the whole step (layers, gradients,
    update).
    """

    def __init__(self, engine: StreamEngine, trainable: Trainable, plan: ShardPlan, *,
                 micro_batches: int, clip_norm: float | None, skip_nonfinite: bool):
        self.engine, self.trainable, self.plan = engine, trainable, plan
        self.micro_batches, self.clip_norm = micro_batches, clip_norm
        self.skip_nonfinite = skip_nonfinite
        # nothing global between the backward and the update: each layer's gradients go
        # straight into it (zjax.step._stream_update)
        self.overlap = clip_norm is None and not skip_nonfinite
        self._updating = False
        self.section = plan.zero.offload_param
        self._programs: dict = {}
        self.nonstack = [j for j, leaf in enumerate(plan.leaves) if not leaf.stacked]
        self.batch_sharding = NamedSharding(plan.mesh, P(batch_axes(plan.mesh)))

    def programs(self, batch: Any) -> Programs:
        """The programs for batches shaped like ``batch`` (found once per shape)."""
        key = jax.tree.map(lambda b: (b.shape, str(b.dtype)), batch)
        key = str(key)
        if key not in self._programs:
            self._programs[key] = Programs(self.trainable, self.plan, batch)
        return self._programs[key]

    def _reader(self, programs: Programs) -> LayerReader:
        return LayerReader(self.engine, programs, buffer_count=self.section.buffer_count,
                           buffer_size=self.section.buffer_size)

    def _split(self, batch: Any) -> list[Any]:
        """The micro-batches: each device's rows split as the one-program step splits them."""
        n, devices = self.micro_batches, self.plan.n_batch
        _check_micro_batches(_batch_rows(batch) // devices, self.plan, n)
        if n == 1:
            return [batch]

        def part(b, m):
            rows = b.reshape(devices, n, -1, *b.shape[1:])[:, m]
            return rows.reshape(-1, *b.shape[1:])

        return [jax.jit(lambda b, m=m: jax.tree.map(lambda x: part(x, m), b),
                        out_shardings=self.batch_sharding)(batch) for m in range(n)]

    def _forward(self, programs: Programs, nonstack: list, batch: Any, layers) -> tuple:
        """Every Stack call's layers forward: ``(outputs, saved inputs, contexts)``. The host
        runs at most ``AHEAD`` layers before the devices (each layer it dispatches holds its
        weights on the devices until it has run); the saved inputs go to host memory with
        ``zero.offload_activations``."""
        outputs, saved, contexts = [], [], []
        running: collections.deque = collections.deque()
        for c, call in enumerate(programs.calls):
            x, context = programs.cut_fwd(c)(nonstack, batch, outputs)
            inputs = []
            for i in range(call.n_layers):
                inputs.append(self._save(x))
                x = programs.layer_fwd(c)(next(layers), x, context, np.int32(i))
                running.append(x)
                if len(running) > AHEAD:
                    jax.block_until_ready(running.popleft())
            outputs.append(x)
            saved.append(inputs)
            contexts.append(context)
        return outputs, saved, contexts

    def _save(self, x: Any) -> Any:
        if not self.plan.zero.offload_activations:
            return x
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind(HOST)), x)

    def _restore(self, x: Any) -> Any:
        if not self.plan.zero.offload_activations:
            return x
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind("device")),
                            x)

    def _pass(self, programs: Programs, nonstack: list, batch: Any, layers, *,
              handoff: Callable[[Any], Handoff]) -> tuple[Any, list, Handoff]:
        """One micro-batch forward and backward: ``(sums, non-Stack leaves' gradients, the
        handoff)``; each layer's gradients handed over (:mod:`zjax.step._stream_update`)
        while the devices run the next layer's backward. ``handoff(sums)`` is where they
        go, given this micro-batch's loss sums."""
        outputs, saved, contexts = self._forward(programs, nonstack, batch, layers)
        g_ns, ct_out, sums = programs.tail(grads=True)(nonstack, batch, outputs)
        hand = handoff(sums)
        ct_out, pending = list(ct_out), None
        for c in reversed(range(len(programs.calls))):
            call, ct = programs.calls[c], ct_out[c]
            for i in reversed(range(call.n_layers)):
                g, ct = programs.layer_bwd(c)(next(layers), self._restore(saved[c][i]),
                                              contexts[c], np.int32(i), ct)
                saved[c][i] = None
                if pending is not None:
                    self._hand(hand, *pending)
                pending = (call, i, g)
            g_c, ct_prev = programs.cut_bwd(c)(nonstack, batch, outputs[:c], ct)
            g_ns = _add(g_ns, g_c)
            ct_out[:c] = [_add(a, b) for a, b in zip(ct_out[:c], ct_prev, strict=True)]
        if pending is not None:
            self._hand(hand, *pending)
        return sums, g_ns, hand

    @staticmethod
    def _hand(hand: Handoff, call, i: int, g: list) -> None:
        for j, gj in zip(call.leaves, g, strict=True):
            hand.put(j, gj, layer=(i, call.n_layers))

    def _schedule(self, programs: Programs) -> list[tuple[int, int]]:
        forward = [(c, i) for c, call in enumerate(programs.calls)
                   for i in range(call.n_layers)]
        return (forward + forward[::-1]) * self.micro_batches

    def _nonstack(self) -> list[jax.Array]:
        return [read_leaf(self.engine, j) for j in self.nonstack]

    def lower(self, abstract_state: TrainState, batch: Any) -> StreamLowered:
        del abstract_state  # the state holds no params: the programs take layers
        n = self.micro_batches
        micro = jax.tree.map(lambda b: jax.ShapeDtypeStruct((b.shape[0] // n, *b.shape[1:]),
                                                            b.dtype), batch)
        return StreamLowered(self, functools.partial(
            stream_figures, self.programs(batch), micro, engine=self.engine, micro_batches=n,
            ahead=AHEAD, overlap=self.overlap))

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        engine = self.engine
        step = int(local_value(state.step))
        if engine.torn:
            raise NvmeError(f"step {step}: the NVMe swap files were left mid-update "
                            f"({engine.torn}); resume from the last checkpoint")
        if step != engine.step:
            raise RuntimeError(f"this state is at step {step}, but the NVMe swap files hold "
                               f"step {engine.step}: only the newest state can step")
        try:
            return self._step(step, batch)
        except BaseException as e:
            # the update writes master and moments (during the last backward with overlap):
            # stopped once it has begun, the files hold neither step
            if self._updating:
                engine.torn = f"{type(e).__name__}: {e}"[:200]
            raise
        finally:
            self._updating = False

    def _step(self, step: int, batch: Any) -> tuple[TrainState, dict]:
        engine = self.engine
        t0, moved0 = time.perf_counter(), self._moved()
        sink = ParamNorm(engine.leaves)
        sums, run = self._gradients(batch, sink)
        loss_sum, count = float(sums[0]), float(sums[1])
        sumsq = engine.grads.sumsq
        if jax.process_count() > 1:
            sumsq = float(multihost_utils.process_allgather(np.float64(sumsq)).sum())
        norm = math.sqrt(sumsq) / count
        finite = bool(np.isfinite(loss_sum) and np.isfinite(norm))
        stats = None
        if run is not None:  # applied layer by layer during the backward
            stats = run.finish()
        elif finite or not self.skip_nonfinite:
            self._updating = True
            stats = engine.opt.update({name: engine.grads.source(name) for name in engine.sizes},
                                      sink, grad_scale=clip_scale(norm, self.clip_norm) / count)
        if stats is not None:
            finite = finite and stats.finite
            self._param_norm(sink)
        engine.step = step + 1
        metrics = {"loss": loss_sum / count, "grad_norm": norm,
                   "param_norm": engine.param_norm, "finite": finite, "count": count,
                   **metric_values({k: float(v) for k, v in sums[2].items()}, count),
                   **self._traffic(time.perf_counter() - t0, moved0, stats)}
        return (engine.started(None, step + 1),
                {k: jnp.asarray(v) for k, v in metrics.items()})

    def _gradients(self, batch: Any, sink: ParamNorm) -> tuple[Any, Update | None]:
        """Every micro-batch's forward and backward: the summed ``(loss_sum, count, extra)``
        (host floats), and the optimizer step the last one's gradients went into (``overlap``)
        or None (they are in the swap files)."""
        programs = self.programs(batch)
        reader, grads, opt = self._reader(programs), self.engine.grads, self.engine.opt
        grads.sumsq = 0.0
        layers = reader.layers(self._schedule(programs))
        nonstack, g_total, totals = self._nonstack(), None, None
        parts = self._split(batch)
        for m, part in enumerate(parts):
            first, last = m == 0, m == len(parts) - 1
            prior = 0.0 if totals is None else float(totals[1])

            def handoff(sums, first=first, last=last, prior=prior) -> Handoff:
                if not (last and self.overlap):
                    return Handoff(grads, first=first, last=last)
                count = prior + float(local_value(sums[1]))  # every micro-batch's tokens
                self._updating = True
                return Handoff(grads, first=first, last=True, sink=sink,
                               run=opt.begin(grad_scale=1.0 / count))

            sums, g_ns, hand = self._pass(programs, nonstack, part, layers, handoff=handoff)
            sums = jax.tree.map(lambda x: np.float64(local_value(x)), sums)
            totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
            g_total = _add(g_total, g_ns)
        whole = Handoff(grads, first=True, last=True, run=hand.run, sink=sink)
        for j, g in zip(self.nonstack, g_total, strict=True):
            whole.put(j, g, layer=None)
        grads.flush()
        return totals, hand.run

    def _param_norm(self, sink: ParamNorm) -> None:
        total = sink.sumsq
        if jax.process_count() > 1:
            total = float(multihost_utils.process_allgather(np.float64(total)).sum())
        self.engine.param_norm = math.sqrt(total)

    def _moved(self) -> tuple[int, int]:
        """Bytes read from and written to all the swap files so far (master and moments,
        gradients)."""
        stores = (self.engine.opt.store, self.engine.grads.store)
        return sum(s.read_bytes for s in stores), sum(s.written_bytes for s in stores)

    def _traffic(self, seconds: float, moved0: tuple[int, int], stats) -> dict:
        read, written = (b - a for a, b in zip(moved0, self._moved(), strict=True))
        t = max(seconds, 1e-9)
        return {"nvme_read_gbs": read / t / 1e9, "nvme_write_gbs": written / t / 1e9,
                "nvme_update_s": stats.seconds if stats else 0.0}

    def evaluate_metrics(self, params: Any, batch: Any, frozen: Any = None) -> tuple:
        """The mean loss and metrics of ``batch``, streamed forward (``params`` unused: they
        are on NVMe)."""
        del params, frozen
        programs = self.programs(batch)
        forward = [(c, i) for c, call in enumerate(programs.calls)
                   for i in range(call.n_layers)]
        nonstack = self._nonstack()
        outputs, _, _ = self._forward(programs, nonstack, batch,
                                      self._reader(programs).layers(forward))
        loss_sum, count, extra = programs.tail(grads=False)(nonstack, batch, outputs)
        return loss_sum / count, metric_values(extra, count)

    def evaluate(self, params: Any, batch: Any, frozen: Any = None) -> jax.Array:
        return self.evaluate_metrics(params, batch, frozen)[0]


@jax.jit
def _add_jit(a, b):
    return jax.tree.map(jnp.add, a, b)


def _add(a, b):
    return b if a is None else _add_jit(a, b)


def _batch_rows(batch: Any) -> int:
    return int(jax.tree.leaves(batch)[0].shape[0])
