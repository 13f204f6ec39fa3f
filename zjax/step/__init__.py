"""The ZeRO train step: state layout, sharded gradients, the optax update, the jitted step.

:func:`make_step` wires the parts; each lives in its own module:

- :mod:`zjax.step._state`: :class:`TrainState`, its initialiser and where each leaf lives.
- :mod:`zjax.step._grads`: loss and gradients per replica, micro-batched, reduced over ``data``.
- :mod:`zjax.step._update`: the optax update (on the device or the host) and the next state.
- :mod:`zjax.step._step`: :class:`ZeroStep` and :func:`make_step`.
"""

from zjax.step._state import StateLayout, TrainState, state_layout
from zjax.step._step import ZeroStep, make_step

__all__ = ["StateLayout", "TrainState", "ZeroStep", "make_step", "state_layout"]
