"""The compile a plan reads its figures from: a step compiled never to run.

A plan reads a compiled step's ``memory_analysis()`` and its scheduled HLO (collective bytes,
overlap), nothing else. On a compile-only target that compile is kept beside JAX's cache
(:func:`zjax.runtime.compile_for_target`). On XLA:CPU the machine code is compiled without
LLVM's optimisations (``xla_backend_optimization_level=0``): about 30% less compile time for
the same figures, since the HLO passes, the schedule and the buffer assignment do not depend on
that level (``tests/test_target_cache.py`` compares both compiles). Such an executable runs
slower, which is why training never uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FIGURES_ONLY_CPU", "compile_for_figures"]

# compiler options of a CPU compile that is only read, never run
FIGURES_ONLY_CPU = {"xla_backend_optimization_level": 0}


def compile_for_figures(lowered: Any, devices: Sequence[Any], *,
                        compile_only: bool = False) -> Any:
    """Compile ``lowered`` to read its memory figures and scheduled HLO, not to run it.

    Args:
      lowered: a step lowered for a mesh of ``devices``.
      devices: the mesh's devices, in its order.
      compile_only: the devices are a compile-only target's (``zjax.runtime.target``), not
        this process's.

    Returns:
      An object with ``memory_analysis()`` and ``as_text()`` (a step of several programs,
      ``lowered.compile_each``: their figures, with ``weighted_texts()``): a target's
      :class:`~zjax.runtime.CompiledFigures`, else the compiled executable (on XLA:CPU built
      without LLVM optimisation; do not run it for speed).

    Raises:
      jax.errors.JaxRuntimeError: the compiler refused the program.
    """
    from zjax.runtime._target_cache import compile_for_target

    devices = list(devices)
    if hasattr(lowered, "compile_each"):  # a step of several programs (parameters on NVMe)
        return lowered.compile_each(lambda one: compile_for_figures(
            one, devices, compile_only=compile_only))
    if compile_only:
        return compile_for_target(lowered, devices)
    if devices[0].platform == "cpu":
        return lowered.compile(compiler_options=FIGURES_ONLY_CPU)
    return lowered.compile()
