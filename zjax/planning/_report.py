"""Exact per-device memory and communication of a train step, read off the compiled program.

The step is lowered from ``ShapeDtypeStruct``s (nothing allocated) and compiled; memory comes
from ``compiled.memory_analysis()`` and the state's shardings (host vs device by memory kind),
collective bytes from the compiled HLO (:mod:`zjax.planning._hlo`). Beside them: the ZeRO paper's
model-state formula for the same Ψ, N and dtypes. See ``docs/memory-model.md``.

On a ``data`` x ``model`` mesh, collective bytes are also split by the mesh axes they run over
(ZeRO's gathers and reduce-scatters over ``data``, tensor parallelism's all-reduces over
``model``), and the formula takes Ψ as the parameters one ``model`` slice holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zjax.errors import ConfigError
from zjax.partition import nbytes
from zjax.planning._experts import expert_all_to_all, expert_figures
from zjax.planning._flops import flops_per_token, peak_flops
from zjax.planning._hlo import collective_bytes
from zjax.planning._matmuls import matmul_figures, matmul_lines
from zjax.planning._memory import (
    compiled_bytes,
    compiled_memory,
    format_bytes,
    formula,
    frozen_figures,
    n_params_of,
    nvme_lines,
    state_bytes,
)
from zjax.planning._rollout import rollout_lines
from zjax.runtime.targets import Target
from zjax.step import ZeroStep

__all__ = ["PlanReport", "compiled_memory", "formula", "report"]


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What one configuration needs per device (the ``--json`` object of ``zjax plan``).

    Attributes:
      n_params: total parameter count Ψ.
      active_params: a mixture of experts' parameters one token uses (the chosen experts'
        and every shared one); None for a dense model.
      experts: a mixture's figures (:func:`zjax.planning._experts.expert_figures`): experts
        per device, the expert parameters one device stores, one layer's experts gathered,
        the all-to-all bytes over ``expert`` per step and per layer; empty for a dense model.
      frozen: with adapters over a frozen base (``lora``): ``trained_params`` (the adapters:
        gradients and optimizer state are theirs alone), ``frozen_params`` and
        ``frozen_bytes`` (the base as stored on one device, in ``frozen_dtypes``); empty
        when every parameter is trained.
      n_devices: devices in the mesh; ``setting``: the knobs the autotuner varies (stage,
        offload, prefetch, grad_accum, remat, and ``mesh``: the axis sizes).
      per_device: ``params_bytes`` (stored params), ``grads_bytes`` (reduced gradients in
        ``zero.reduce_dtype``, transient), ``optimizer_bytes`` (float32 master and optax state),
        ``model_state_bytes`` (their sum), ``temp_bytes`` (compiled temporaries: activations,
        gathered weights, gradients), ``host_bytes`` (state in host memory),
        ``host_temp_bytes`` (temporaries in host memory: offloaded activations),
        ``nvme_bytes`` (master and optimizer state on NVMe, in ``optimizer_bytes``; the
        streamed step's ``nvme_read_bytes`` / ``nvme_written_bytes`` a step and its host
        buffers, ``stream_host_bytes``) and ``total_bytes`` (compiled peak on the device).
      collectives: ``all_gather_bytes``, ``reduce_scatter_bytes``, ``all_reduce_bytes``
        (tensor bytes per step, read off the compiled HLO) and ``wire_bytes`` (what a ring
        moves: an all-reduce counts twice), the autotuner's measure of communication.
      formula: the ZeRO paper's ``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` and
        ``model_state_bytes`` for the same Ψ, N, stage and dtypes (N the ``data`` axis, Ψ the
        parameters of one ``model`` slice: split leaves count ``1/model``).
      replicated_leaves: ``{path, shape, reason}`` of each leaf kept whole over ``data``;
        ``notes``: caveats of this backend (e.g. XLA:CPU reducing in float32).
      collectives_by_axis: ``{axes: {kind: bytes}}``: the same collectives by the mesh axes
        they span (``data``, ``model``, ``data+model``).
      collectives_by_link: ``{intra_host | inter_host: {kind: bytes}}`` on more than one host
        (the processes' hosts, or ``hosts`` simulated: contiguous blocks of the mesh).
      context_per_layer: ``{all_to_all | collective_permute: bytes}`` per layer (forward,
        its recomputation and backward) of sequence parallelism's attention, with a
        ``context`` axis and a model naming its ``n_layers`` (a mixture's all-to-alls over
        ``expert`` left out).
      device_kind: the devices compiled for (``cpu``, ``NVIDIA H100 80GB HBM3``, ``TPU v5``);
        ``fits_device``: whether ``total_bytes`` fits their memory (``capacity_bytes``).
      overlap: per collective kind, the fraction of its bytes with compute scheduled between
        its start and its done, loops weighted by trip count (0 where the backend runs it
        synchronously).
      activations: where the activations go, estimated from a decoder's shape
        (:mod:`zjax.planning._activations`): ``saved_inputs_bytes``, ``attention_bytes``,
        ``mlp_bytes``, ``loss_bytes`` (one layer's or chunk's working set) and
        ``host_bytes``; empty for a model section that does not describe a decoder.
      flops: ``per_token`` (model FLOPs to train on one token, :func:`zjax.planning._flops
        .flops_per_token`), ``per_step`` (times the tokens of a step), ``peak_per_device``
        (the chip's bf16 peak, None when unknown) and ``step_s_at_peak`` (the step's model
        FLOPs at that peak on every device: the time an MFU of 100% would take).
      rollout: an RL run's generation phase (:func:`zjax.planning._rollout
        .rollout_figures`: the model gathered once, the cache, the state beside them, its
        peak and whether it fits); empty for other runs.
      matmuls: the compiled step's ``matmuls`` and ``fp8_matmuls`` per step (loops by trip
        count) and their ``matmul_flops`` / ``fp8_flops`` (:mod:`zjax.planning._matmuls`).
    """

    n_params: int
    n_devices: int
    setting: dict[str, Any]
    per_device: dict[str, int]
    collectives: dict[str, int]
    formula: dict[str, int]
    replicated_leaves: list[dict[str, Any]]
    notes: list[str] = dataclasses.field(default_factory=list)
    collectives_by_axis: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    device_kind: str = ""
    fits_device: bool | None = None
    overlap: dict[str, float] = dataclasses.field(default_factory=dict)
    flops: dict[str, float | None] = dataclasses.field(default_factory=dict)
    collectives_by_link: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    activations: dict[str, int] = dataclasses.field(default_factory=dict)
    context_per_layer: dict[str, int] = dataclasses.field(default_factory=dict)
    active_params: int | None = None
    experts: dict[str, Any] = dataclasses.field(default_factory=dict)
    frozen: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout: dict[str, Any] = dataclasses.field(default_factory=dict)
    matmuls: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanReport:
        return cls(**data)

    def fits(self, budget_bytes: int) -> bool:
        return self.per_device["total_bytes"] <= budget_bytes

    def _counts(self) -> str:
        """``N parameters (M active per token; T trained) on D devices``."""
        parts = ([] if self.active_params is None else
                 [f"{self.active_params:,} active per token"]) + (
            [f"{self.frozen['trained_params']:,} trained"]
            if self.frozen and self.frozen.get("frozen_kind") != "reference" else [])
        return (f"{self.n_params:,} parameters{' (' + '; '.join(parts) + ')' if parts else ''}"
                f" on {self.n_devices} devices")

    def _collective_lines(self) -> list[str]:
        """Collective bytes per step, sequence parallelism's per layer, a mixture's experts."""
        c = self.collectives
        lines = ["  collectives per step: "
                 + _kinds({k.removesuffix("_bytes"): v for k, v in c.items()})]
        if self.context_per_layer:
            lines.append("  context attention per layer: " + _kinds(self.context_per_layer))
        if self.experts:
            lines.append(_experts_line(self.experts))
        return lines

    def _frozen_lines(self) -> list[str]:
        """The frozen leaves' row under params: an adapters' base or a preference loss's
        reference copy."""
        fz = self.frozen
        if not fz:
            return []
        kind = "reference (frozen)" if fz.get("frozen_kind") == "reference" else "frozen base"
        return [f"    {kind:<20}{format_bytes(fz['frozen_bytes']):>14}  "
                f"({fz['frozen_params']:,} params, {', '.join(fz['frozen_dtypes'])})"]

    def table(self) -> str:
        """The human-readable report."""
        d, f, s = self.per_device, self.formula, self.setting
        mesh = s.get("mesh") or {}
        shape = " (" + " x ".join(f"{k} {v}" for k, v in mesh.items()) + ")" \
            if len(mesh) > 2 or mesh.get("model", 1) > 1 else ""
        where = f" ({s['target']}: {self.device_kind})" if s.get("target") else ""
        lines = [
            f"zjax plan{where}: {self._counts()}{shape}, "
            f"ZeRO stage {s['stage']}, offload {s['offload']}, prefetch {s['prefetch']}, "
            f"grad_accum {s['grad_accum']}, remat {s['remat']}"
            + (f", activations {s['activations']}"
               if s.get("activations", "device") != "device" else ""),
            f"  {'per device':<22}{'compiled':>14}{'ZeRO paper':>14}",
        ]
        for key, name in [("params_bytes", "params"), ("grads_bytes", "gradients"),
                          ("optimizer_bytes", "optimizer state"),
                          ("model_state_bytes", "model states")]:
            lines.append(f"  {name:<22}{format_bytes(d[key]):>14}{format_bytes(f[key]):>14}")
        lines += self._frozen_lines()
        if "hpz_secondary_bytes" in f:  # part of the temp: kept from forward to backward
            lines.append(f"  {'hpZ secondary (temp)':<22}{'':>14}"
                         f"{format_bytes(f['hpz_secondary_bytes']):>14}")
        lines.append(f"  {'activations/temp':<22}{format_bytes(d['temp_bytes']):>14}")
        lines += [f"    {name:<20}{'':>14}{format_bytes(self.activations[key]):>14}  (estimate)"
                  for key, name in _ACTIVATIONS if self.activations.get(key)]
        lines += [
            f"  {'total on device':<22}{format_bytes(d['total_bytes']):>14}",
            f"  {'in host memory':<22}{format_bytes(d['host_bytes']):>14}",
        ]
        if d.get("host_temp_bytes"):  # offloaded activations (zero.offload_activations)
            lines.append(f"  {'host temp':<22}{format_bytes(d['host_temp_bytes']):>14}")
        lines += nvme_lines(d)
        if d.get("capacity_bytes"):
            lines.append(f"  {'device memory':<22}{format_bytes(d['capacity_bytes']):>14}"
                         f"  {'fits' if self.fits_device else 'DOES NOT FIT'}")
        lines += rollout_lines(self.rollout)
        lines += self._collective_lines()
        if self.flops.get("per_step"):
            f_ = self.flops
            at_peak = (f", {f_['step_s_at_peak'] * 1e3:.1f} ms at the chips' bf16 peak"
                       if f_.get("step_s_at_peak") else "")
            lines.append(f"  model FLOPs per step: {f_['per_step'] / 1e12:.3g} TFLOP "
                         f"({f_['per_token'] / 1e9:.3g} GFLOP per token){at_peak}")
        lines += matmul_lines(self.matmuls)
        if self.overlap:
            lines.append("  overlapped with compute: " + ", ".join(
                f"{k.replace('_', '-')} {v:.0%}" for k, v in self.overlap.items()))
        if len(self.collectives_by_axis) > 1 or mesh.get("model", 1) > 1:
            lines += [f"    over {axes}: {_kinds(kinds)}"
                      for axes, kinds in self.collectives_by_axis.items()]
        lines += [f"    {link.replace('_', '-')}: {_kinds(kinds)}"
                  for link, kinds in self.collectives_by_link.items()]
        if self.replicated_leaves:
            lines.append(f"  replicated leaves ({len(self.replicated_leaves)}):")
            lines += [f"    {r['path']} {tuple(r['shape'])}: {r['reason']}"
                      for r in self.replicated_leaves]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# the activation estimate's rows, under the compiled temp
_ACTIVATIONS = (("saved_inputs_bytes", "saved layer inputs"),
                ("attention_bytes", "attention, a layer"), ("mlp_bytes", "MLP, a layer"),
                ("loss_bytes", "loss, a chunk"), ("host_bytes", "inputs on the host"))


def _notes(plan) -> list[str]:
    notes = []
    if plan.reduce_dtype != plan.zero.reduce:
        notes.append(f"this backend reduces in {plan.reduce_dtype.name} (its temp and "
                     f"collective figures say so); gradients are counted in "
                     f"{plan.zero.reduce.name}, the zero.reduce_dtype an accelerator uses")
    if plan.scatter == "all_reduce":
        notes.append("XLA:CPU with several processes: reduce-scatters run as all-reduces plus a "
                     "slice (gloo's reduce-scatter returns wrong values, jax-ml/jax#40830)")
    return notes


def report(zstep: ZeroStep, compiled: Any, *, grad_accum: int = 1,
           remat: bool | None = None, target: Target | None = None,
           tokens_per_step: int | None = None, model_shape: dict | None = None,
           hosts: int | None = None, activations: dict[str, int] | None = None) -> PlanReport:
    """The :class:`PlanReport` of ``zstep`` from its compiled step (``lower(b).compile()``).

    ``hosts``: simulate that many hosts (contiguous blocks of the mesh's devices, ``replica``
    outermost) for the intra/inter-host split; default: the devices' own processes.

    ``target``: the compile-only target compiled for (name and device memory).
    ``tokens_per_step`` and ``model_shape`` (``n_layers``, ``d_model``, ``seq_len`` of a
    transformer) give the model FLOPs (:mod:`zjax.planning._flops`). ``activations``: the
    estimate of :func:`zjax.planning._activations.estimate`.
    """
    plan, zero = zstep.plan, zstep.plan.zero
    shape = dict(model_shape or {})
    n_experts = shape.pop("n_experts", None)  # not FLOPs figures
    moe_layers = shape.pop("moe_layers", shape.get("n_layers"))
    n_params = n_params_of(zstep)
    # what one model slice holds: tensor parallelism divides the split leaves
    slice_params = sum(leaf.size // (plan.n_model if leaf.model_dim is not None else 1)
                       for leaf in plan.leaves)
    state = state_bytes(zstep)
    per_device = {k: state[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    per_device["model_state_bytes"] = sum(per_device.values())
    per_device.update(compiled_bytes(compiled, state["host_bytes"], nvme=state["nvme_bytes"]))
    capacity = per_device["capacity_bytes"] = target.capacity_bytes if target else None
    texts = compiled.weighted_texts() if hasattr(compiled, "weighted_texts") else \
        compiled.as_text()
    coll = collective_bytes(texts, mesh_axes=dict(plan.mesh.shape),
                            decomposed=plan.backend.decomposes_collectives,
                            hosts=host_of_devices(plan.mesh, hosts))
    trained = sum(leaf.size for leaf in plan.leaves if not leaf.frozen)
    # K of the paper: float32 master plus the optimizer's per-parameter state
    k = 4 + nbytes(zstep.canonical["opt_state"], per_device=False) / max(1, trained)
    return PlanReport(
        n_params=n_params,
        n_devices=plan.n_batch * plan.n_context * plan.n_model,
        setting=_setting(plan, grad_accum=grad_accum, remat=remat, target=target),
        per_device=per_device,
        collectives=_collectives(coll),
        formula=formula(slice_params, plan.n_shard, stage=zero.stage,
                        param_bytes=zero.gather.itemsize, grad_bytes=zero.reduce.itemsize,
                        optimizer_bytes_per_param=k,
                        secondary_group=plan.n_data if plan.n_node > 1 else 1,
                        secondary_params=sum(plan.leaf_bytes(leaf, "uint8", False)
                                             for leaf in plan.leaves
                                             if leaf.stacked and leaf.dim is not None),
                        trained_params=sum(
                            leaf.size // (plan.n_model if leaf.model_dim is not None else 1)
                            for leaf in plan.leaves if not leaf.frozen)),
        replicated_leaves=[{"path": leaf.path, "shape": list(leaf.shape), "reason": leaf.reason}
                           for leaf in plan.replicated],
        notes=_notes(plan),
        collectives_by_axis=coll.by_axis,
        device_kind=plan.mesh.devices.flat[0].device_kind,
        fits_device=None if capacity is None else per_device["total_bytes"] <= capacity,
        overlap={k: coll.overlap[k] for k in ("all_gather", "reduce_scatter", "all_reduce",
                                              *_CONTEXT_KINDS) if k in coll.overlap},
        flops=_flops(n_params, plan, tokens_per_step, shape),
        collectives_by_link=coll.by_link,
        activations=dict(activations or {}),
        context_per_layer=_per_layer(coll, plan, shape.get("n_layers")),
        active_params=n_params - shape["inactive_params"] if "inactive_params" in shape
        else None,
        experts=expert_figures(plan, coll.by_axis, n_experts=n_experts, n_layers=moe_layers),
        frozen=frozen_figures(zstep, trained),
        matmuls=matmul_figures(texts),
    )


def _setting(plan, *, grad_accum: int, remat: bool | None, target: Target | None) -> dict:
    """The report's ``setting``: the knobs the autotuner varies and the mesh's axis sizes."""
    zero = plan.zero
    return {"stage": zero.stage, "offload": _offload_name(zero),
            "prefetch": zero.prefetch_layers if zero.stage == 3 else None,
            "grad_accum": grad_accum, "remat": remat,
            "activations": ("offload" if zero.offload_activations else "partition"
                            if zero.partition_activations else "device"),
            "mesh": {"data": plan.n_data, "model": plan.n_model,
                     **({"replica": plan.n_replica} if plan.n_replica > 1 else {}),
                     **({"context": plan.n_context} if plan.n_context > 1 else {}),
                     **({"expert": plan.n_expert} if plan.n_expert > 1 else {}),
                     **({"node": plan.n_node} if plan.n_node > 1 else {})},
            "target": target.name if target else None}


def _per_layer(coll, plan, n_layers: int | None) -> dict[str, int]:
    """Sequence parallelism's collective bytes per layer (every layer runs the same ones);
    a mixture's all-to-alls over ``expert`` are not among them."""
    if not n_layers or plan.n_context == 1:
        return {}
    kinds = {k: getattr(coll, k) for k in _CONTEXT_KINDS}
    kinds["all_to_all"] -= expert_all_to_all(coll.by_axis)
    return {k: v // n_layers for k, v in kinds.items() if v}


def _experts_line(e: dict[str, Any]) -> str:
    a2a = "" if not e["all_to_all_bytes"] else (
        f"; all-to-all {format_bytes(e['all_to_all_bytes'])} per step, "
        f"{format_bytes(e['all_to_all_off_device_bytes'])} off the device"
        + (f" ({format_bytes(e['all_to_all_per_layer'])} a layer)"
           if e["all_to_all_per_layer"] else ""))
    return (f"  experts: {e['n_experts']} ({e['experts_per_device']} per device), "
            f"{e['expert_params']:,} expert parameters, {format_bytes(e['params_bytes'])} stored "
            f"per device, {format_bytes(e['gathered_layer_bytes'])} a layer gathered{a2a}")


_CONTEXT_KINDS = ("all_to_all", "collective_permute")


def _kinds(kinds: dict) -> str:
    """``all-gather 3.30 MiB, reduce-scatter ...`` of ``{kind: bytes}``."""
    return ", ".join(f"{k.replace('_', '-')} {format_bytes(v)}" for k, v in kinds.items())


def _collectives(coll) -> dict[str, int]:
    """The per-step collective bytes the report keeps: ZeRO's and tensor parallelism's, and
    sequence parallelism's (Ulysses' all-to-alls, the ring's permutes) where there are any."""
    return {"all_gather_bytes": coll.all_gather, "reduce_scatter_bytes": coll.reduce_scatter,
            "all_reduce_bytes": coll.all_reduce,
            **{f"{k}_bytes": getattr(coll, k) for k in _CONTEXT_KINDS if getattr(coll, k)},
            "wire_bytes": coll.wire}


def host_of_devices(mesh, hosts: int | None) -> list[int] | None:
    """The host of each device in the mesh's flat order, or None on one host."""
    devices = list(mesh.devices.flat)
    if hosts is not None:
        if hosts < 1 or len(devices) % hosts:
            raise ConfigError(f"--hosts: {hosts} does not divide the {len(devices)} devices")
        per = len(devices) // hosts
        out = [i // per for i in range(len(devices))]
    else:
        out = [getattr(d, "process_index", 0) for d in devices]
    return out if len(set(out)) > 1 else None


def _flops(n_params: int, plan, tokens: int | None, shape: dict) -> dict:
    per_token = flops_per_token(n_params, **shape)
    peak = peak_flops(plan.mesh.devices.flat[0].device_kind)
    per_step = per_token * tokens if tokens else None
    n = plan.n_batch * plan.n_context * plan.n_model
    return {"per_token": per_token, "per_step": per_step, "peak_per_device": peak,
            "step_s_at_peak": per_step / (peak * n) if per_step and peak else None}


def _offload_name(zero) -> str:
    parts = []
    if zero.offload_optimizer.enabled:
        parts.append("optimizer" + ("(update on host)" if zero.offload_optimizer.update_on_host
                                    else ""))
    if zero.offload_optimizer.nvme:
        parts.append("optimizer(nvme)")
    if zero.offload_param.enabled or zero.offload_param.nvme:
        parts.append("param" + ("(nvme, streamed step)" if zero.offload_param.nvme else ""))
    return "+".join(parts) or "none"
