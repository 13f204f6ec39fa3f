"""XLA:CPU time of a mixture-of-experts layer's forward + backward, as ratios in one run.

8 experts, top-2, SwiGLU experts ``--d-model`` -> ``--d-ff``, ``--tokens`` bfloat16 tokens, on
one CPU device:

- ``masked``: the anchor, every expert on every token, masked to its chosen ones (the plain
  reference the tests compare with; ``E / k`` = 4x the useful FLOPs);
- ``dropless``: :func:`zjax.nn.moe.moe_ffn` as trained by default off TPU, the assignments
  sorted by expert, each expert's in whole tiles through its weights (``moe_matmul: tiled``,
  a scan over the tiles with its own backward);
- ``dropless_ragged_dot``: the same through ``jax.lax.ragged_dot`` (TPU's default; XLA:CPU
  lowers it through a dense expansion);
- ``capacity``: the same with ``capacity_factor`` 1.25 (GShard's ``[E, capacity, D]`` buffers,
  1.25 x k / E of the masked FLOPs).

Medians of ``--repeats`` runs after one warm-up; the compiled temp of each. Prints one JSON
object.

Usage: ``python benchmarks/moe.py [--tokens 4096 --d-model 512 --d-ff 1408]``
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from attention import _median_time  # this directory: the benchmarks share it

E, K = 8, 2


def _masked(x, router, w):
    """Every expert on every token, masked (the tests' reference, in the layer's dtype)."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, top = jax.lax.top_k(probs, K)
    weights = weights / weights.sum(-1, keepdims=True)
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(E):
        mask = jnp.sum(jnp.where(top == e, weights, 0.0), axis=-1)
        h = jax.nn.silu(x @ w.gate[e]) * (x @ w.up[e])
        y = y + mask[:, None] * (h @ w.down[e]).astype(jnp.float32)
    return y.astype(x.dtype)


def run(tokens: int, d: int, f: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from zjax.nn.moe import Experts, moe_ffn

    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
    router = jax.random.normal(keys[1], (d, E), jnp.bfloat16)
    w = Experts(*(0.05 * jax.random.normal(kk, s, jnp.bfloat16) for kk, s in
                  zip(keys[2:], [(E, d, f), (E, d, f), (E, f, d)], strict=True)))
    layers = {
        "masked": _masked,
        "dropless": lambda x, r, w: moe_ffn(x, r, w, k=K, matmul="tiled")[0],
        "dropless_ragged_dot": lambda x, r, w: moe_ffn(x, r, w, k=K, matmul="ragged_dot")[0],
        "capacity": lambda x, r, w: moe_ffn(x, r, w, k=K, capacity_factor=1.25)[0],
    }
    rows = {}
    for name, layer in layers.items():
        def loss(x, r, w, layer=layer):
            return jnp.sum(layer(x, r, w).astype(jnp.float32))
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        temp = fn.lower(x, router, w).compile().memory_analysis().temp_size_in_bytes
        rows[name] = {"seconds": round(_median_time(fn, x, router, w, repeats=repeats), 4),
                      "temp_mib": round(temp / 2 ** 20, 1)}
    for name in ("dropless", "dropless_ragged_dot", "capacity"):
        rows[name]["over_masked"] = round(rows[name]["seconds"] / rows["masked"]["seconds"], 3)
    return {"experts": E, "top_k": K, "tokens": tokens, "d_model": d, "d_ff": f,
            "dtype": "bfloat16", "device": jax.devices()[0].device_kind, "repeats": repeats,
            "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1408)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(run(a.tokens, a.d_model, a.d_ff, a.repeats), indent=2))


if __name__ == "__main__":
    main()
