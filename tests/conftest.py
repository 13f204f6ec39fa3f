"""Test setup: 8 simulated CPU devices, set before jax creates its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# compile-only TPU targets in both pytest workers and their subprocesses (no TPU here)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from zjax.mesh import simulate_cpu_devices  # imports jax; its backends start later

# XLA_FLAGS' device count and PJRT_NPROC (room for collectives in flight), inherited by the
# subprocesses tests start.
simulate_cpu_devices(8)
