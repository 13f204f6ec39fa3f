"""Test setup: 8 simulated CPU devices, set before jax creates its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from zjax.mesh import simulate_cpu_devices  # imports jax; its backends start later

# XLA_FLAGS' device count and PJRT_NPROC (room for collectives in flight), inherited by the
# subprocesses tests start.
simulate_cpu_devices(8)
