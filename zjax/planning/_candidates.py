"""The autotuner's search space: a :class:`Candidate` is one point (the knobs it turns),
:func:`variants` a (stage, micro-batches, model) group's candidates, most preferred first."""

from __future__ import annotations

import dataclasses

from zjax.config import Config
from zjax.offload import OffloadConfig, OptimizerOffloadConfig

__all__ = ["ACTIVATIONS", "OFFLOADS", "Candidate", "variants"]

OFFLOADS = ("none", "optimizer", "optimizer+param")

# the saved layer inputs, most preferred first: on the device; split over ``model``
# (ZeRO-R's partitioned activations: an all-gather per layer, no transfer); in host memory
ACTIVATIONS = ("device", "partition", "offload")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: the knobs the autotuner turns."""

    stage: int
    grad_accum: int
    offload: str = "none"
    prefetch: int | None = None
    remat: bool | None = None
    model: int = 1
    activations: str = "device"  # where saved layer inputs live: one of ACTIVATIONS

    def describe(self) -> str:
        """One line: ``model 1 stage 3 offload none prefetch 1 accum 1 remat -
        activations device``."""
        return (f"model {self.model} stage {self.stage} offload {self.offload} prefetch "
                f"{'-' if self.prefetch is None else self.prefetch} accum {self.grad_accum} "
                f"remat {'-' if self.remat is None else self.remat} "
                f"activations {self.activations}")

    def apply(self, config: Config) -> Config:
        """``config`` with this candidate's settings."""
        zero = dataclasses.replace(
            config.zero, stage=self.stage,
            offload_optimizer=OptimizerOffloadConfig(
                device="none" if self.offload == "none" else "host",
                update_on="host" if self.offload == "optimizer+param" else "device"),
            offload_param=OffloadConfig(
                device="host" if self.offload == "optimizer+param" else "none"),
            offload_activations=self.activations == "offload",
            partition_activations=self.activations == "partition",
            **({} if self.prefetch is None else
               {"prefetch_layers": self.prefetch, "prefetch_bucket_size": None}))
        model = config.model
        if self.remat is not None:
            model = dataclasses.replace(model, remat=self.remat)
        mesh = dataclasses.replace(config.mesh, data=-1, model=self.model)
        return dataclasses.replace(config, zero=zero, model=model, mesh=mesh,
                                   train=dataclasses.replace(config.train,
                                                             grad_accum=self.grad_accum))


def variants(stage: int, grad_accum: int, model: int, *, offloads, prefetch,
              remat, activations=("device",)) -> list[Candidate]:
    """A group's candidates, most preferred first (partitioned activations only where a
    ``model`` axis splits them). Below stage 3 the saved inputs leave the device only once
    recompute is on (ZeRO-R's kept inputs are what a recomputing layer saves)."""
    acts = [a for a in activations if a != "partition" or model > 1]
    out = []
    for off in offloads if stage else ("none",):
        if stage == 3:
            out += [Candidate(stage, grad_accum, off, p, None, model, a)
                    for a in acts for p in prefetch]
            continue
        recompute = None if remat[-1] is None else True
        out += [Candidate(stage, grad_accum, off, None, r, model) for r in remat]
        out += [Candidate(stage, grad_accum, off, None, recompute, model, a)
                for a in acts if a != "device"]
    return out
