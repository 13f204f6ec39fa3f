"""Long trainings compiled with LLVM's optimisation (docs/testing.md, "Long trainings").

The suite compiles XLA:CPU's machine code at ``-O0`` (conftest): most of its programs are
compiled, run a few times and dropped, so a faster compile wins. A test marked
``long_training`` runs hundreds of steps of one program instead (a curve that must fall, a
reward that must rise): for it, the train step and the rollout are compiled at XLA's default
level (``xla_backend_optimization_level=2``), through the CPU backend record's
``compiler_options`` that zjax passes to their ``jax.jit``. Only the machine code changes: the
HLO, its schedule and the figures are the same, and the numbers such a test asserts are
thresholds on a curve, never a bitwise comparison with another process (a CLI subprocess
compiles at the suite's level).

GRPO's learning test, 200 steps, alone on 2 cores with an empty cache: 19.5 s with the whole
process at -O0, 14.9 s at -O2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator

import pytest

MARK = "long_training"
LEVEL = {"xla_backend_optimization_level": 2}


@contextlib.contextmanager
def optimized_cpu_steps() -> Iterator[None]:
    """Within: zjax's CPU record with the optimising level added (steps built inside)."""
    from zjax.runtime import _backend

    cpu = _backend.backend("cpu")
    options = types.MappingProxyType({**cpu.compiler_options, **LEVEL})
    _backend._BACKENDS["cpu"] = dataclasses.replace(cpu, compiler_options=options)
    try:
        yield
    finally:
        _backend._BACKENDS["cpu"] = cpu


@pytest.fixture(autouse=True)
def _long_training(request):
    """A ``long_training`` test builds its steps under :func:`optimized_cpu_steps` (a module
    fixture that trains uses the context manager itself: it is set up before this one)."""
    if request.node.get_closest_marker(MARK) is None:
        yield
        return
    with optimized_cpu_steps():
        yield
