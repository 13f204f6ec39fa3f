"""The ZeRO train step: state layout, sharded gradients, the optax update, the jitted step.

:func:`make_step` wires the parts; each lives in its own module:

- :mod:`zjax.step._state`: :class:`TrainState`, its initialiser and where each leaf lives.
- :mod:`zjax.step._grads`: loss and gradients per replica, micro-batched, reduced over ``data``.
- :mod:`zjax.step._update`: the optax update (on the device or the host) and the next state.
- :mod:`zjax.step._step`: :class:`ZeroStep` and :func:`make_step`.
- :mod:`zjax.step._storage`: :class:`StateStorage`, the state as canonical leaves wherever it
  lives (:mod:`zjax.step._nvme_io`: in NVMe swap files); what checkpoints read and write.
- :mod:`zjax.step.optim`: the optax optimizer and schedule of the ``optimizer`` section.

It imports the models' ``Trainable``, partition, offload, the runtime and the config; never
checkpoints, the task, planning or the training run.
"""

from zjax.step._state import StateLayout, TrainState, state_layout
from zjax.step._step import ZeroStep, make_step
from zjax.step._storage import MemoryStorage, StateStorage, path_keys

__all__ = ["MemoryStorage", "StateLayout", "StateStorage", "TrainState", "ZeroStep", "make_step",
           "path_keys", "state_layout"]
