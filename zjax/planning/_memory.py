"""Per-device memory of a train step: the ZeRO paper's formula, the state's bytes from its
shardings, and the compiled step's own figures (``memory_analysis()``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zjax.partition import nbytes
from zjax.step import ZeroStep

__all__ = ["compiled_bytes", "compiled_memory", "format_bytes", "formula", "frozen_figures",
           "n_params_of", "nvme_lines", "state_bytes"]


def formula(n_params: int, n_devices: int, *, stage: int, param_bytes: int, grad_bytes: int,
            optimizer_bytes_per_param: float, secondary_group: int = 1,
            secondary_params: int = 0, trained_params: int | None = None) -> dict[str, int]:
    """The ZeRO paper's model-state bytes per device (its K is ``optimizer_bytes_per_param``).

    Stage 0: ``(p + g + K)Ψ``; 1: ``(p + g)Ψ + KΨ/N``; 2: ``pΨ + (g + K)Ψ/N``; 3: all ``/N``.
    With ZeRO++'s hpZ over groups of ``secondary_group`` (k) devices, ``hpz_secondary_bytes``
    is the secondary partition the forward keeps for the backward, ``pΨ'/k`` (ZeRO++'s
    ``2Ψ/k`` in 16 bits) besides the model state, where Ψ' (``secondary_params``) counts the
    layer stack's sharded params: the leaves outside it are gathered across nodes again.
    ``trained_params``: the parameters that have gradients and optimizer state (adapters over
    a frozen base), default all.
    """
    psi, n = n_params, n_devices
    trained = psi if trained_params is None else trained_params
    params = param_bytes * psi / (n if stage >= 3 else 1)
    grads = grad_bytes * trained / (n if stage >= 2 else 1)
    opt = optimizer_bytes_per_param * trained / (n if stage >= 1 else 1)
    out = {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": opt,
           "model_state_bytes": params + grads + opt}
    if secondary_group > 1:
        out["hpz_secondary_bytes"] = param_bytes * secondary_params / secondary_group
    return {k: round(v) for k, v in out.items()}


def state_bytes(zstep: ZeroStep) -> dict[str, int]:
    """Per device: stored params (a frozen base's included), reduced gradients
    (``zero.reduce_dtype``, transient), float32 master and optimizer state, and what of the
    state lives in host memory."""
    plan, a = zstep.plan, zstep.abstract_state
    reduce = plan.zero.reduce  # the configured dtype: the one an accelerator reduces in
    optimizer = nbytes(a.opt_state) + nbytes(a.master)
    # with the optimizer on NVMe: the float32 master and the per-parameter state, in files
    nvme = 0 if zstep.nvme is None else nbytes(
        (zstep.canonical["params"], [x for x in jax.tree.leaves(zstep.canonical["opt_state"])
                                     if x.ndim]))
    return {
        "params_bytes": nbytes(a.params) + nbytes(a.frozen),  # a frozen base's too
        "grads_bytes": sum(plan.leaf_bytes(leaf, reduce, plan.zero.stage >= 2)
                           for leaf in plan.leaves if not leaf.frozen),
        "optimizer_bytes": optimizer + nvme,
        "host_bytes": nbytes(a, memory="host"),
        "nvme_bytes": nvme,
    }


def compiled_memory(compiled: Any) -> dict[str, int]:
    """``argument_bytes``, ``output_bytes``, ``temp_bytes`` and ``peak_bytes`` (arguments +
    outputs + temporaries - donated aliases) of a compiled step, per device."""
    mem = compiled.memory_analysis()
    out = {"argument_bytes": int(mem.argument_size_in_bytes),
           "output_bytes": int(mem.output_size_in_bytes),
           "temp_bytes": int(mem.temp_size_in_bytes)}
    out["peak_bytes"] = sum(out.values()) - int(mem.alias_size_in_bytes)
    return out


def compiled_bytes(compiled: Any, host: int, *, nvme: int = 0) -> dict[str, int]:
    """``temp_bytes``, ``host_bytes``, ``total_bytes`` (peak in device memory) and
    ``nvme_bytes`` of the compiled step; ``host``, ``nvme``: the state's host and NVMe bytes
    (from its shardings; the optimizer's swap files). The streamed step (parameters on NVMe)
    adds its gradients' swap files, the NVMe bytes a step reads and writes and its host
    buffers (``stream_bytes``)."""
    mem = compiled.memory_analysis()
    # TPU counts host-memory arguments and outputs apart (host_*); XLA:CPU counts them in
    # argument/output, so there the host-placed state is taken out by its shardings
    host_apart = (mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes
                  + mem.host_temp_size_in_bytes) > 0
    if host_apart:  # the compiler's own figure: it includes the backend's padding
        host = int(mem.host_argument_size_in_bytes)
    figures = compiled_memory(compiled)
    stream = compiled.stream_bytes(nvme) if hasattr(compiled, "stream_bytes") else {}
    return {"temp_bytes": figures["temp_bytes"], "host_bytes": host,
            "host_temp_bytes": int(mem.host_temp_size_in_bytes),
            "total_bytes": figures["peak_bytes"] - (0 if host_apart else host),
            "nvme_bytes": nvme, **stream}


def nvme_lines(d: dict[str, Any]) -> list[str]:
    """A report table's NVMe lines: the state there, and the streamed step's traffic."""
    lines = [f"  {'on NVMe':<22}{format_bytes(d['nvme_bytes']):>14}"] if d.get("nvme_bytes") \
        else []
    if d.get("nvme_read_bytes"):
        lines.append(f"  {'NVMe per step':<22}{format_bytes(d['nvme_read_bytes']):>14} read, "
                     f"{format_bytes(d['nvme_written_bytes'])} written; host buffers "
                     f"{format_bytes(d['stream_host_bytes'])}")
    return lines


def _frozen_params(zstep: ZeroStep) -> int:
    """The frozen base's parameters: a quantized weight counts its weights, not its bytes
    (:attr:`ZeroStep.base_target` has their float shapes)."""
    if zstep.base_target is None:
        return 0
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(zstep.base_target))


def n_params_of(zstep: ZeroStep) -> int:
    """Ψ: the trained leaves' sizes and the frozen base's parameters."""
    return _frozen_params(zstep) + sum(leaf.size for leaf in zstep.plan.leaves
                                       if not leaf.frozen)


def frozen_figures(zstep: ZeroStep, trained: int) -> dict[str, Any]:
    """A report's ``frozen``: the adapters' count and the frozen base's, its bytes per
    device and dtypes (``frozen_kind`` ``reference``: a preference loss's frozen copy of the
    trained weights, not counted in Ψ); empty when nothing is frozen."""
    base = [leaf for leaf in zstep.plan.leaves if leaf.frozen]
    if not base:
        return {}
    if zstep.derived_frozen:  # a preference loss's reference: a copy of the trained leaves
        return {"trained_params": trained, "frozen_params": sum(leaf.size for leaf in base),
                "frozen_bytes": nbytes(zstep.abstract_state.frozen),
                "frozen_dtypes": sorted({leaf.dtype.name for leaf in base}),
                "frozen_kind": "reference"}
    return {"trained_params": trained, "frozen_params": _frozen_params(zstep),
            "frozen_bytes": nbytes(zstep.abstract_state.frozen),
            "frozen_dtypes": sorted({leaf.dtype.name for leaf in base})}


def format_bytes(n: float) -> str:
    """``n`` bytes as the reports print them (``1.50 GiB``, ``12 B``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
