"""Compiled temp of the dropless experts' grouped matmuls on XLA:CPU and compiled for targets.

The issue's measurement, extended: the forward and backward of the experts' gated MLP
(``act(x G) * (x U) D``, 8 experts, ``--d-model`` -> ``--d-ff``, ``--tokens`` bfloat16 rows
sorted by expert) through ``lax.ragged_dot`` (``moe_matmul: ragged_dot``)
and through :func:`zjax.nn.moe.tiled_mlp` (``moe_matmul: tiled``), both by
:func:`zjax.nn.moe.grouped`, each compiled from
``ShapeDtypeStruct``s for one device of each target; and the bytes of the dense-equivalent
``[tokens, d_ff]`` hidden activation and of its dense expansion (every row against every
expert, ``[tokens, E, d_ff]``) for scale. Nothing runs: exact and repeatable.

Usage: ``python benchmarks/moe_memory.py [--targets cpu,h100:8,v5p:2x2x2]``
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

E = 8


def _loss(matmul: str):
    import jax
    import jax.numpy as jnp

    from zjax.nn.moe import grouped

    def loss(x, w, sizes):
        return jnp.sum(grouped(x, w, sizes, jax.nn.silu, matmul=matmul).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1))


def temp_bytes(matmul: str, device, *, tokens: int, d: int, f: int) -> int:
    """Compiled temp of ``matmul``'s gradient for one device."""
    import jax
    import jax.numpy as jnp

    from zjax.nn.moe import Experts

    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype,
                                                                 sharding=sharding)
    w = Experts(spec((E, d, f)), spec((E, d, f)), spec((E, f, d)))
    fn = jax.jit(_loss(matmul), in_shardings=sharding)
    compiled = fn.lower(spec((tokens, d)), w, spec((E,), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def run(targets: list[str], *, tokens: int, d: int, f: int) -> dict:
    import jax

    from zjax.runtime.targets import target

    rows = {}
    for name in targets:
        device = jax.devices("cpu")[0] if name == "cpu" else target(name).devices[0]
        rows[name] = {m: round(temp_bytes(m, device, tokens=tokens, d=d, f=f) / 1e6, 1)
                      for m in ("ragged_dot", "tiled")}
    return {"experts": E, "tokens": tokens, "d_model": d, "d_ff": f, "dtype": "bfloat16",
            "hidden_mb": round(tokens * f * 2 / 1e6, 1),
            "dense_expansion_mb": round(tokens * E * f * 2 / 1e6, 1), "temp_mb": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="cpu,h100:8,v5p:2x2x2")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=2816)
    a = p.parse_args()
    print(json.dumps(run(a.targets.split(","), tokens=a.tokens, d=a.d_model, f=a.d_ff),
                     indent=2))


if __name__ == "__main__":
    main()
