"""XLA:CPU time of attention implementations, and of a GPT training step, as ratios in one run.

``kernels``: forward + backward of ``dense`` and ``blockwise`` causal attention (8 heads of 64,
bfloat16) at a fixed 8192 tokens, sequence length 256 .. 8192: where dense stops being faster
is ``zjax.nn.attention.DENSE_UP_TO``.

``step``: the d_model 512, 8-layer GPT's ZeRO-3 step on one CPU device at ``--tokens`` per
step, sequence lengths 2048 and 8192: the default (``model.attention=auto``, chunked loss)
against the dense path (``model.attention=dense``, one loss chunk).

Medians of ``--repeats`` runs after one warm-up. Prints one JSON object.

Usage: ``python benchmarks/attention.py kernels``; ``python benchmarks/attention.py step``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _median_time(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernels(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from zjax.nn.attention import attention

    rows = {}
    for t in (256, 512, 1024, 2048, 4096, 8192):
        b = max(1, 8192 // t)
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(ks[0], (b, t, 8, 64), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, t, 8, 64), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, t, 8, 64), jnp.bfloat16)
        row = {}
        for impl in ("dense", "blockwise"):
            def loss(q, k, v, impl=impl):
                return jnp.sum(attention(q, k, v, implementation=impl).astype(jnp.float32))
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            row[impl] = round(_median_time(fn, q, k, v, repeats=repeats), 4)
        row["blockwise_over_dense"] = round(row["blockwise"] / row["dense"], 3)
        rows[f"T={t} B={b}"] = row
        print(t, row, file=sys.stderr)
    return rows


def step(repeats: int, tokens: int) -> dict:
    import jax
    import numpy as np

    import zjax

    rows = {}
    for t in (2048, 8192):
        row = {}
        for label, extra in (("default", []),
                             ("dense", ["model.attention=dense", f"model.loss_chunk={tokens}"])):
            config = zjax.load_config("configs/tiny.yaml", [
                "model.d_model=512", "model.n_layers=8", "model.n_heads=8",
                f"model.max_seq_len={t}", f"data.seq_len={t}",
                f"data.batch_size={max(1, tokens // t)}", "mesh.data=1", *extra])
            zstep = zjax.build_step(config, jax.devices()[:1])
            state = zstep.init(jax.random.key(0))
            batch = zstep.put_batch(np.random.default_rng(0).integers(
                0, 256, (max(1, tokens // t), t + 1)).astype(np.int32))

            holder = {"state": state}

            def run(zstep=zstep, batch=batch, holder=holder):
                holder["state"], metrics = zstep.step(holder["state"], batch)
                return metrics["loss"]

            row[label] = round(_median_time(run, repeats=repeats), 3)
            print(t, label, row[label], file=sys.stderr)
        row["default_over_dense"] = round(row["default"] / row["dense"], 3)
        rows[f"T={t}"] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["kernels", "step"], nargs="?", default="kernels")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (step)")
    args = ap.parse_args()
    rows = kernels(args.repeats) if args.what == "kernels" else step(args.repeats, args.tokens)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
