"""Can a layer's params come from the host inside zjax's compiled step? (Why parameters on NVMe
are refused.)

Parameters on NVMe would need each layer's shard fetched from the host as the layer scan reaches
it, in the forward and again in the rematerialised backward. This probe builds the smallest
such program: a ``shard_map`` over 8 devices of the gradient of a ``lax.scan`` whose body is
under ``jax.checkpoint`` (as zjax's stage-3 loss and layer scan are) and fetches its layer's
weights through a host callback. For ``io_callback`` and ``pure_callback`` it prints whether
the gradient runs on XLA:CPU and whether it compiles for an H100 and a v5p slice (deviceless).

Usage: ``JAX_PLATFORMS=cpu python benchmarks/param_fetch_probe.py`` (with the ``targets``
extra installed for the accelerator compiles).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zjax.runtime.mesh import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import io_callback  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

L, D = 4, 64
STORE = np.random.default_rng(0).standard_normal((8, L, D)).astype(np.float32)


def _fetch(device, layer):
    return STORE[int(device), int(layer)]


def _program(mesh: Mesh, kind: str):
    shape = jax.ShapeDtypeStruct((D,), jnp.float32)

    @jax.custom_vjp
    def weights(layer):
        device = jax.lax.axis_index("data")
        if kind == "io_callback":
            return io_callback(_fetch, shape, device, layer, ordered=False)
        return jax.pure_callback(_fetch, shape, device, layer)

    weights.defvjp(lambda layer: (weights(layer), layer), lambda layer, g: (None,))

    def loss(x):
        body = jax.checkpoint(lambda x, i: (jnp.tanh(x * weights(i)), None))
        y, _ = jax.lax.scan(body, x, jnp.arange(L))
        return jax.lax.psum(y.sum(), "data")

    return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("data"),
                                 out_specs=P("data"), check_vma=False))


def main() -> None:
    from zjax.runtime.targets import target

    cpu = Mesh(np.array(jax.devices()), ("data",))
    for kind in ("io_callback", "pure_callback"):
        try:
            x = jax.device_put(jnp.ones((8, D)), NamedSharding(cpu, P("data")))
            jax.block_until_ready(_program(cpu, kind)(x))
            print(f"{kind}: XLA:CPU gradient under remat runs")
        except Exception as e:  # the probe reports what each backend says
            print(f"{kind}: XLA:CPU fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        for name in ("h100:8", "v5p:2x2x2"):
            try:
                mesh = Mesh(np.array(target(name).devices), ("data",))
                x = jax.ShapeDtypeStruct((8, D), jnp.float32,
                                         sharding=NamedSharding(mesh, P("data")))
                _program(mesh, kind).lower(x).compile()
                print(f"{kind}: {name} compiles")
            except Exception as e:
                print(f"{kind}: {name} fails: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
