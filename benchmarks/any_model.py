"""ZeRO-3 for models zjax does not own: memory of the compiled step against depth.

For each model of ``tests/any_models.py`` (plain JAX, Flax Linen, Equinox; unrolled loops and
scans over stacked layers) at L = 4, 8, 16, compiled for 8 devices (simulated CPU devices, or
an accelerator's compiler with ``--target``), three rows:

- ``before``: every sharded leaf gathered at the start of the loss
  (:func:`zjax.partition.gather.gather_on_access`, what ``from_pytree`` did before the
  gather-on-use transform);
- ``after``: :func:`zjax.from_pytree` (the gather-on-use transform);
- ``gspmd``: plain GSPMD FSDP on the same model: params and Adam state sharded by
  ``NamedSharding`` with zjax's placements, the batch over ``data``, each layer under
  ``jax.checkpoint`` (the model's own remat option), weights cast to bf16 at the loss's start.

zjax rows gather in bf16 and reduce in fp32 (stage 3, prefetch 1, persistence threshold 0).
Per row: temp bytes from ``compiled.memory_analysis()``, all-gather / reduce-scatter bytes and
the fraction of all-gather bytes overlapped (``zjax.planning``). Per model: temp growth per added
layer against one bf16 layer of weights. Prints one JSON object.

Usage: ``python benchmarks/any_model.py [--d 512] [--layers 4,8,16] [--target h100:8]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from any_models import MODELS

from zjax import ZeroConfig, from_pytree, make_mesh, make_plan, make_step
from zjax.models.trainable import Trainable
from zjax.partition.gather import gather_on_access
from zjax.planning import collective_bytes
from zjax.runtime._backend import backend
from zjax.runtime.mesh import DATA
from zjax.runtime.targets import target

SCANNED = ("stack", "blocks")


def _stacked(name: str):
    return (lambda path: path.startswith(SCANNED)) if name.endswith("_scan") else \
        (lambda path: False)


def _zero() -> ZeroConfig:
    return ZeroConfig(stage=3, param_persistence_threshold=0, gather_dtype="bfloat16",
                      prefetch_layers=1)


def _whole(init, loss) -> Trainable:
    """``from_pytree`` as it was: every sharded leaf gathered at the loss's start."""

    def run(params, batch, plan):
        return gather_on_access(loss, plan.dims, comm=plan.comm,
                                join=plan.join_gathers)(params, batch)

    return Trainable(init=init, loss=run)


def _measure(compiled, t0: float, mesh) -> dict:
    mem = compiled.memory_analysis()
    platform = mesh.devices.flat[0].platform
    coll = collective_bytes(compiled.as_text(),
                            decomposed=backend(platform).decomposes_collectives)
    return {"temp": int(mem.temp_size_in_bytes), "all_gather": coll.all_gather,
            "reduce_scatter": coll.reduce_scatter,
            "gather_overlap": coll.overlap.get("all_gather"),
            "compile_s": round(time.perf_counter() - t0, 1)}


def zjax_row(trainable: Trainable, mesh, batch) -> dict:
    t0 = time.perf_counter()
    zs = make_step(trainable, optax.adam(1e-3), zero=_zero(), mesh=mesh)
    return _measure(zs.lower(batch).compile(), t0, mesh)


def gspmd_row(name: str, args, n_layers: int, mesh, batch) -> dict:
    init, loss = MODELS[name](n_layers=n_layers, d=args.d, f=4 * args.d, vocab=args.vocab,
                              remat=True)
    tx = optax.adam(1e-3)

    def step(state, tokens):
        params, opt = state

        def mean(p):
            p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)  # bf16 compute
            s, c = loss(p, tokens)
            return s / c

        grads = jax.grad(mean)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    abstract = jax.eval_shape(lambda r: (init(r), tx.init(init(r))), jax.random.key(0))
    plan = make_plan(abstract[0], _zero(), mesh, stacked=_stacked(name))
    shardings = plan.shardings((plan.sharded_specs, plan.opt_specs(tx, abstract[1])))
    record = backend(mesh.devices.flat[0].platform)
    options = {} if record.platform == "cpu" else dict(record.compiler_options)
    fn = jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P(DATA))),
                 out_shardings=shardings, donate_argnums=0, compiler_options=options)
    spec = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
    t0 = time.perf_counter()
    return _measure(fn.lower(spec, batch).compile(), t0, mesh)


def run(args) -> dict:
    if args.target:
        jax.config.update("jax_platforms", "cpu")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        mesh = make_mesh(devices=list(target(args.target).devices))
    else:
        mesh = make_mesh()
    batch = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, P(DATA)))
    out: dict = {"setting": {"d": args.d, "f": 4 * args.d, "batch": args.batch,
                             "seq_len": args.seq_len, "devices": mesh.size,
                             "target": args.target or f"cpu:{mesh.size}"}, "models": {}}
    layers = [int(x) for x in args.layers.split(",")]
    for name in args.models.split(","):
        rows: dict = {"before": {}, "after": {}, "gspmd": {}}
        for n_layers in layers:
            init, loss = MODELS[name](n_layers=n_layers, d=args.d, f=4 * args.d,
                                      vocab=args.vocab)
            print(f"[any_model] {name} L={n_layers}", file=sys.stderr, flush=True)
            if not args.skip_before:
                rows["before"][n_layers] = zjax_row(_whole(init, loss), mesh, batch)
            rows["after"][n_layers] = zjax_row(from_pytree(init, loss), mesh, batch)
            rows["gspmd"][n_layers] = gspmd_row(name, args, n_layers, mesh, batch)
        one = _bytes(MODELS[name](n_layers=1, d=args.d, f=4 * args.d, vocab=args.vocab)[0])
        two = _bytes(MODELS[name](n_layers=2, d=args.d, f=4 * args.d, vocab=args.vocab)[0])
        layer_bf16 = (two - one) // 2
        growth = {kind: _growth(r) for kind, r in rows.items() if r}
        out["models"][name] = {"rows": rows, "layer_bf16_bytes": layer_bf16,
                               "growth_per_layer": growth,
                               "flat": None if growth["after"] is None
                               else growth["after"] < layer_bf16}
    return out


def _bytes(init) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(jax.eval_shape(init, jax.random.key(0))))


def _growth(rows: dict) -> float | None:
    ls = sorted(rows)
    if len(ls) < 2:
        return None
    return (rows[ls[-1]]["temp"] - rows[ls[0]]["temp"]) / (ls[-1] - ls[0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", default="4,8,16")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--target", default=None, help="compile for h100:8, v5p:2x2x2, ...")
    p.add_argument("--skip-before", action="store_true", help="no gather-everything rows")
    args = p.parse_args(argv)
    if not args.target:
        from zjax import simulate_cpu_devices
        simulate_cpu_devices(args.devices)
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
