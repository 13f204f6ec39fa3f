"""ZeRO stages 0-3 against plain-JAX data-parallel baselines on one GPT config.

Prints one JSON object on stdout (progress goes to stderr). Rows:

- ``zjax_stage{0,1,2,3}``: :func:`zjax.make_step` (bf16 gathers, fp32 reduce, ``--prefetch``
  layers, default 1).
- ``ddp``: replicated params and optimizer state, batch split over ``data``, fp32, the GPT's
  own ``Stack`` scan with per-layer ``jax.checkpoint``.
- ``gspmd_fsdp``: params and optimizer state sharded over ``data`` with zjax's placements,
  activations constrained to batch sharding in every scanned layer, XLA inserts the gathers
  (what MaxText-style FSDP gives); per-layer ``jax.checkpoint``, fp32.
- ``gspmd_fsdp_noremat``: the same without the per-layer checkpoint.
- ``gspmd_fsdp_bf16``: ``gspmd_fsdp`` computing in bf16 as MaxText does (``weight_dtype``
  float32, ``dtype`` bfloat16): each layer's float32 weights cast to bf16 inside the scanned
  layer, the other weights where the model is merged, so XLA may gather bf16.
- ``gspmd_fsdp_bf16_merge``: the strongest GSPMD row: every weight, stacked or not, cast to
  bf16 once where the model is merged (a sharded cast), so each scanned layer gathers bf16.
  Every baseline runs the model's own ``lm_loss`` (its chunked loss), its attention under
  ``shard_map`` over the batch (:func:`batch_sharded_attention`), so ``auto`` takes the
  target's kernel, the one zjax's rows run.
- ``zjax_stage3_p{k}_{f32,bf16}`` (with ``--variants``): stage 3 at prefetch k and that reduce
  dtype.
- ``zjax_stage3_offload_{mode}`` (with ``--offload``): stage 3 with ZeRO-Offload, ``mode`` one
  of ``optimizer`` (moments in host memory, update on device), ``optimizer-host`` (update on
  the host too), ``param`` (float32 master shards in host memory), ``both`` (all of it, update
  on the host). Each reports device and host state bytes and ``offload_time_ratio`` against
  ``zjax_stage3``.

Per row: per-device argument / output / temp / peak bytes from ``compiled.memory_analysis()``,
train state bytes per device, collective bytes and the fraction overlapped with compute read
off the scheduled HLO, median step time, and ratios to ``gspmd_fsdp``. ``targets`` checks
stage 3 against ``gspmd_fsdp`` (and, where the rows exist, against ``gspmd_fsdp_bf16``). Every
row runs in a fresh process (its own memory; a runtime abort costs that row only and is retried
``--retries`` times).

With ``--target h100:8`` (or ``h200:8``, ``v5p:2x2x2``, ...) every row is compiled by that
accelerator's compiler for its compile-only devices (:mod:`zjax.runtime.targets`); nothing is timed.

Usage: ``python benchmarks/zero_step.py [--repeats 3] [--no-time] [--layers 4,8,16]
[--target h100:8 --variants]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import unittest.mock
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax import ZeroConfig, from_nnx, make_mesh, make_plan, make_step, simulate_cpu_devices
from zjax.models import gpt as gpt_module
from zjax.models.gpt import GPT, GPTConfig, lm_loss
from zjax.models.trainable import Trainable
from zjax.nn import bind_runners
from zjax.nn.attention import attention
from zjax.offload import OffloadConfig, OptimizerOffloadConfig
from zjax.partition import nbytes
from zjax.planning import collective_bytes
from zjax.runtime._backend import backend
from zjax.runtime.mesh import DATA
from zjax.runtime.targets import target
from zjax.step.optim import clip_by_global_norm

BASELINE = "gspmd_fsdp"


def log(msg: str) -> None:
    print(f"[zero_step] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Built:
    """One compiled train step, ready to measure.

    Attributes:
      name: row name.
      compiled: the AOT-compiled step ``(state, batch) -> (state, metrics)``; state donated.
      init: ``init() -> state`` placed with the step's shardings.
      abstract_state: the state as ``ShapeDtypeStruct``s with shardings.
      compile_s: seconds spent lowering and compiling.
    """

    name: str
    compiled: Any
    init: Callable[[], Any]
    abstract_state: Any
    compile_s: float


def make_tx() -> optax.GradientTransformation:
    """The optimizer of every row (zjax's clip: optax's cannot run under ``update_on: host``)."""
    return optax.chain(clip_by_global_norm(1.0), optax.adamw(3e-4))


def gpt_trainable(args: argparse.Namespace, n_layers: int) -> tuple[Trainable, Any]:
    """The zjax view of the GPT and its NNX graphdef (for the baselines' merge)."""
    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=n_layers,
                    n_heads=args.n_heads, max_seq_len=args.seq_len)
    make = lambda rngs: GPT(cfg, rngs=rngs)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))), nnx.Param)
    return from_nnx(make, lm_loss), graphdef


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)


_HOST = OffloadConfig(device="host")
OFFLOAD_MODES = {
    "optimizer": dict(offload_optimizer=OptimizerOffloadConfig(device="host")),
    "optimizer-host": dict(offload_optimizer=OptimizerOffloadConfig(device="host",
                                                                    update_on="host")),
    "param": dict(offload_param=_HOST),
    "both": dict(offload_optimizer=OptimizerOffloadConfig(device="host", update_on="host"),
                 offload_param=_HOST),
}


def build_zjax(stage: int, trainable: Trainable, mesh: Mesh, batch: jax.ShapeDtypeStruct,
               prefetch: int = 1, offload: str | None = None,
               reduce_dtype: str = "float32") -> Built:
    """zjax's step at ``stage``, compiled with its backend's options
    (:mod:`zjax.runtime._backend`)."""
    zero = ZeroConfig(stage=stage, gather_dtype="bfloat16", reduce_dtype=reduce_dtype,
                      prefetch_layers=prefetch, **OFFLOAD_MODES.get(offload, {}))
    zs = make_step(trainable, make_tx(), zero=zero, mesh=mesh)
    t0 = time.perf_counter()
    compiled = zs.lower(batch).compile()
    name = f"zjax_stage{stage}" + (f"_offload_{offload}" if offload else "")
    return Built(name, compiled, lambda: zs.init(jax.random.key(0)), zs.abstract_state,
                 time.perf_counter() - t0)


def _to(dtype, tree: Any) -> Any:
    return tree if dtype is None else jax.tree.map(
        lambda w: w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w, tree)


def _constrained_scan(layer_fn: Callable, params: Any, x: jax.Array, *,
                      sharding: NamedSharding, remat: bool, dtype=None) -> jax.Array:
    """A ``Stack`` runner: plain scan with the hidden state pinned to batch sharding (and the
    layer's weights cast to ``dtype`` at use)."""
    pin = lambda h: lax.with_sharding_constraint(h, sharding)

    def body(h, layer_params):
        return pin(layer_fn(_to(dtype, layer_params), pin(h))), None

    if remat:
        body = jax.checkpoint(body)
    return lax.scan(body, pin(x), params)[0]


@contextlib.contextmanager
def batch_sharded_attention(mesh: Mesh):
    """The model's attention under ``shard_map`` over the batch while the baselines are traced,
    as MaxText runs its kernels (splash) under GSPMD: ``auto`` then reads the target's platform
    and picks the kernel zjax's rows run (a Pallas kernel cannot be partitioned by GSPMD, and
    outside a mesh ``auto`` would take blockwise)."""
    def sharded(q, k, v, **kw):
        spec = P(DATA)
        fn = lambda q, k, v: attention(q, k, v, **kw)
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                             check_vma=False)(q, k, v)

    with unittest.mock.patch.object(gpt_module, "attention", sharded):
        yield


def build_baseline(kind: str, trainable: Trainable, graphdef: Any, mesh: Mesh,
                   batch: jax.ShapeDtypeStruct) -> Built:
    """Plain ``jax.jit`` baselines: ``ddp``, ``gspmd_fsdp``, ``gspmd_fsdp_noremat``,
    ``gspmd_fsdp_bf16``, ``gspmd_fsdp_bf16_merge``."""
    tx = make_tx()
    act = NamedSharding(mesh, P(DATA))
    fsdp = kind.startswith("gspmd_fsdp")
    dtype = jnp.bfloat16 if "bf16" in kind else None
    at_merge = kind.endswith("_merge")  # every weight cast once, sharded, before the scan
    runner = functools.partial(_constrained_scan, sharding=act,
                               dtype=None if at_merge else dtype,
                               remat=not kind.endswith("noremat"))

    def loss_fn(params, tokens):
        if dtype is not None:  # the non-stacked weights at the merge; the layers' at use
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            params = treedef.unflatten(
                [w if not at_merge and trainable.stacked(
                    jax.tree_util.keystr(path, simple=True, separator="/"))
                 else _to(dtype, w) for path, w in flat])
        model = nnx.merge(graphdef, params)
        if fsdp:
            bind_runners(model, lambda path, stack: runner)
        loss_sum, count = lm_loss(model, tokens)
        return loss_sum / count

    def init_fn(rng):
        params = trainable.init(rng)
        return params, tx.init(params)

    def step_fn(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    # identical placements to zjax stage 3 (largest divisible dim, never the layer dim)
    plan = make_plan(abstract[0], ZeroConfig(stage=3), mesh, stacked=trainable.stacked)
    if fsdp:
        specs = (plan.sharded_specs, plan.opt_specs(tx, abstract[1]))
    else:
        specs = jax.tree.map(lambda _: P(), abstract)
    shardings = plan.shardings(specs)
    # on an accelerator, the backend's own compiler options (on TPU MaxText's async-collective
    # flags, without which libtpu runs every collective synchronously); XLA:CPU's are zjax's
    record = backend(mesh.devices.flat[0].platform)
    options = {} if record.platform == "cpu" else dict(record.compiler_options)
    jit_step = jax.jit(step_fn, in_shardings=(shardings, act), out_shardings=(shardings, None),
                       donate_argnums=0, compiler_options=options)
    t0 = time.perf_counter()
    with batch_sharded_attention(mesh):
        lowered = jit_step.lower(_with_shardings(abstract, shardings), batch)
    compiled = lowered.compile()
    init = jax.jit(init_fn, out_shardings=shardings)
    return Built(kind, compiled, lambda: init(jax.random.key(0)),
                 _with_shardings(abstract, shardings), time.perf_counter() - t0)


def time_step(built: Built, tokens: jax.Array, repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of one step on real arrays (state donated and threaded through)."""
    state = built.init()
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        state, metrics = built.compiled(state, tokens)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del state
    return statistics.median(times)


def measure(built: Built, tokens: jax.Array | None, repeats: int) -> dict:
    """Memory, state, collective and time figures of one compiled step."""
    mem = built.compiled.memory_analysis()
    platform = jax.tree.leaves(built.abstract_state)[0].sharding.mesh.devices.flat[0].platform
    coll = collective_bytes(built.compiled.as_text(),
                            decomposed=backend(platform).decomposes_collectives)
    row = {
        "name": built.name,
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "peak_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                          + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
        "state_bytes": nbytes(built.abstract_state),
        **{f"state_{m}_bytes": nbytes(built.abstract_state, memory=m) for m in ("device", "host")},
        "total_state_bytes": nbytes(built.abstract_state, per_device=False),
        "collectives": {"all_gather": coll.all_gather, "reduce_scatter": coll.reduce_scatter,
                        "all_reduce": coll.all_reduce, "wire": coll.wire,
                        "other": coll.all_to_all + coll.collective_permute,
                        "counts": coll.counts, "overlap": coll.overlap},
        "compile_s": round(built.compile_s, 2),
    }
    if tokens is not None:
        row["step_time_s"] = time_step(built, tokens, repeats)
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _check(value: float | None, limit: float | None) -> dict:
    ok = None if value is None or limit is None else bool(value <= limit)
    return {"value": value, "limit": limit, "pass": ok}


def targets(rows: dict[str, dict], n_devices: int) -> dict:
    """The issue's targets for stage 3 against ``gspmd_fsdp``."""
    s3, base = rows["zjax_stage3"], rows[BASELINE]
    t3, tb = s3.get("step_time_s"), base.get("step_time_s")
    return {
        "state_bytes": _check(s3["state_bytes"], 1.02 * s3["total_state_bytes"] / n_devices),
        "temp_bytes": _check(s3["temp_bytes"], base["temp_bytes"]),
        "wire_bytes": _check(s3["collectives"]["wire"], 0.6 * base["collectives"]["wire"]),
        "step_time": _check(t3, None if tb is None else 1.10 * tb),
        **_bf16_targets(rows),
    }


def _bf16_targets(rows: dict[str, dict]) -> dict:
    """Stage 3 at prefetch 1 against MaxText's bf16-compute FSDP (the strongest row that
    ran: ``gspmd_fsdp_bf16_merge``, else ``gspmd_fsdp_bf16``), at the baseline's (bf16)
    reduce dtype when the variant row is there (``--variants``): temp no higher, >= 90% of
    the gathered bytes overlapped, wire bytes no higher."""
    bf16 = rows.get("gspmd_fsdp_bf16_merge") or rows.get("gspmd_fsdp_bf16", {})
    s3 = rows.get("zjax_stage3_p1_bf16") or rows.get("zjax_stage3", {})
    if "error" in s3 or "error" in bf16 or not bf16 or not s3:
        return {}
    o = s3["collectives"]["overlap"].get("all_gather", 0)
    out = {"temp_vs_bf16_baseline": _check(s3["temp_bytes"], bf16["temp_bytes"]),
           "gather_overlap": {"value": o, "limit": 0.9, "pass": o >= 0.9},
           "wire_vs_bf16_baseline": _check(s3["collectives"]["wire"],
                                           bf16["collectives"]["wire"])}
    return {k: {**v, "row": s3["name"]} for k, v in out.items()}


def sweep(args: argparse.Namespace, mesh: Mesh, batch: jax.ShapeDtypeStruct) -> list[dict]:
    """Temp bytes of stage 3 and ``gspmd_fsdp`` per layer count (compile only)."""
    out = []
    for n_layers in args.layers:
        trainable, graphdef = gpt_trainable(args, n_layers)
        log(f"sweep L={n_layers}")
        s3 = build_zjax(3, trainable, mesh, batch, args.prefetch).compiled.memory_analysis()
        base = build_baseline(BASELINE, trainable, graphdef, mesh, batch)
        out.append({"n_layers": n_layers, "zjax_stage3_temp_bytes": int(s3.temp_size_in_bytes),
                    f"{BASELINE}_temp_bytes":
                        int(base.compiled.memory_analysis().temp_size_in_bytes)})
    return out


def run_job(args: argparse.Namespace) -> Any:
    """One job in this process: a row (``zjax_stage3``, ``ddp``, ...) or ``sweep``."""
    if args.target:
        jax.config.update("jax_platforms", "cpu")  # compile-only: CUDA's checks would fail
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU to contend for
        mesh = make_mesh(devices=list(target(args.target).devices))
    else:
        simulate_cpu_devices(args.devices)  # before jax creates its backends
        mesh = make_mesh()
    batch = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, P(DATA)))
    if args.job == "sweep":
        return sweep(args, mesh, batch)
    trainable, graphdef = gpt_trainable(args, args.n_layers)
    log(f"{args.job}: compiling")
    if args.job.startswith("zjax_stage3_p"):  # zjax_stage3_p{k}_{f32,bf16}
        k, _, rd = args.job.removeprefix("zjax_stage3_p").partition("_")
        built = build_zjax(3, trainable, mesh, batch, int(k),
                           reduce_dtype={"f32": "float32", "bf16": "bfloat16"}[rd])
        built.name = args.job
    elif args.job.startswith("zjax_stage"):
        stage, _, offload = args.job.removeprefix("zjax_stage").partition("_offload_")
        built = build_zjax(int(stage), trainable, mesh, batch, args.prefetch, offload or None)
    else:
        built = build_baseline(args.job, trainable, graphdef, mesh, batch)
    log(f"{args.job}: compiled in {built.compile_s:.1f}s" + ("" if args.no_time else "; timing"))
    tokens = None
    if not args.no_time and not args.target:
        host = np.random.default_rng(0).integers(0, args.vocab, batch.shape, dtype=np.int32)
        tokens = jax.device_put(host, batch.sharding)
    row = measure(built, tokens, args.repeats)
    row["params"] = sum(int(np.prod(a.shape)) for a in
                        jax.tree.leaves(jax.eval_shape(trainable.init, jax.random.key(0))))
    return row


def spawn(job: str, argv: list[str], retries: int) -> Any:
    """Run ``job`` in a fresh process (isolates memory and XLA:CPU runtime aborts)."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--job", job]
    for attempt in range(1 + retries):
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:
            tail: collections.deque[str] = collections.deque(maxlen=3)
            for line in proc.stderr:  # progress lines through, the rest kept for errors
                if line.startswith("[zero_step]"):
                    sys.stderr.write(line)
                elif line.strip():
                    tail.append(line.strip()[:300])
            stdout = proc.stdout.read()
        if proc.returncode == 0:
            out = json.loads(stdout)
            if attempt and isinstance(out, dict):
                out["attempts"] = attempt + 1
            return out
        log(f"{job}: exit code {proc.returncode} (attempt {attempt + 1}): {' | '.join(tail)}")
    return {"name": job, "error": f"exit code {proc.returncode}: {' | '.join(tail)}"}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The GPT, batch and device options every benchmark of the engine shares."""
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--repeats", type=int, default=5, help="timed steps (after 2 warmups)")
    p.add_argument("--no-time", action="store_true", help="compile and analyse only")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--stages", default="0,1,2,3", help="zjax stages to run")
    p.add_argument("--layers", default="", help="comma-separated L sweep, e.g. 4,8,16")
    p.add_argument("--retries", type=int, default=1, help="reruns of a job whose process dies")
    p.add_argument("--prefetch", type=int, default=1, help="zjax prefetch_layers")
    p.add_argument("--offload", default="", help="stage-3 offload rows, e.g. optimizer,both "
                   f"(modes: {', '.join(OFFLOAD_MODES)})")
    p.add_argument("--target", default=None, help="compile for an accelerator (h100:8, "
                   "v5p:2x2x2, ...; zjax.runtime.targets): compile only, nothing timed")
    p.add_argument("--variants", action="store_true", help="stage-3 rows at prefetch 0/1/2 "
                   "x reduce dtype float32/bfloat16")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # internal: one job
    args = p.parse_args(argv)
    args.stages = [int(s) for s in args.stages.split(",") if s]
    args.layers = [int(n) for n in args.layers.split(",") if n]
    args.offload = [m for m in args.offload.split(",") if m]
    unknown = set(args.offload) - set(OFFLOAD_MODES)
    if unknown:
        p.error(f"--offload: unknown mode(s) {sorted(unknown)}; choose from "
                f"{', '.join(OFFLOAD_MODES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.job is not None:
        print(json.dumps(run_job(args)))
        return
    jobs = [f"zjax_stage{s}" for s in args.stages] + ["ddp", BASELINE, "gspmd_fsdp_noremat",
                                                      "gspmd_fsdp_bf16",
                                                      "gspmd_fsdp_bf16_merge"]
    if args.variants:
        jobs += [f"zjax_stage3_p{k}_{rd}" for k in (0, 1, 2) for rd in ("f32", "bf16")]
    jobs += [f"zjax_stage3_offload_{m}" for m in args.offload]
    rows = {job: spawn(job, argv, args.retries) for job in jobs}
    base = rows[BASELINE]
    n_params = None
    for row in rows.values():
        n_params = row.pop("params", n_params)
        if "error" in row or "error" in base:
            continue
        row["time_ratio"] = _ratio(row.get("step_time_s"), base.get("step_time_s"))
        row["wire_ratio"] = _ratio(row["collectives"]["wire"], base["collectives"]["wire"])
        row["temp_ratio"] = _ratio(row["temp_bytes"], base["temp_bytes"])
        s3 = rows.get("zjax_stage3", {})
        if "_offload_" in row["name"] and "error" not in s3:
            row["offload_time_ratio"] = _ratio(row.get("step_time_s"), s3.get("step_time_s"))
            row["device_state_ratio"] = _ratio(row["state_device_bytes"],
                                               s3["state_device_bytes"])
    result: dict[str, Any] = {
        "config": {k: getattr(args, k) for k in ("d_model", "n_layers", "n_heads", "vocab",
                                                  "seq_len", "batch", "devices", "repeats",
                                                  "target")},
        "params": n_params,
        "rows": list(rows.values()),
    }
    if "error" not in rows.get("zjax_stage3", {"error": ""}) and "error" not in base:
        result["targets"] = targets(rows, args.devices)
    if args.layers:
        result["sweep"] = spawn("sweep", argv, args.retries)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
