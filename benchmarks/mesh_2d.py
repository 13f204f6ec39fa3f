"""ZeRO-3 on ``data`` x tensor parallelism on ``model``: 2-D meshes against 8 x 1.

Prints one JSON object on stdout (progress on stderr). One row per mesh (``--meshes``, default
``8x1,4x2,2x4``) and prefetch depth (``--prefetch``): per-device state, argument and temp bytes
from the compiled step, collective bytes split by the mesh axes they run over (ZeRO's gathers
and reduce-scatters on ``data``, tensor parallelism's all-reduces on ``model``), wire bytes, the
median step time, and ratios against the first mesh at the same prefetch. Same GPT and optimizer
as ``zero_step.py`` (d_model 512, 16 layers, 8 heads: 50.5M params); every row in a fresh
process.

Usage: ``python benchmarks/mesh_2d.py [--repeats 5] [--no-time] [--prefetch 0,1]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from zero_step import (  # benchmarks/, the script directory
    Built,
    add_model_args,
    gpt_trainable,
    make_tx,
    measure,
)

from zjax import MeshConfig, ZeroConfig, make_mesh, make_step, simulate_cpu_devices
from zjax.planning import collective_bytes


def log(msg: str) -> None:
    print(f"[mesh_2d] {msg}", file=sys.stderr, flush=True)


def run_row(args: argparse.Namespace) -> dict:
    """One (mesh, prefetch) row, measured in this process."""
    simulate_cpu_devices(args.devices)
    data, model = (int(x) for x in args.job_mesh.split("x"))
    mesh = make_mesh(MeshConfig(data=data, model=model))
    trainable, _ = gpt_trainable(args, args.n_layers)
    zero = ZeroConfig(stage=3, gather_dtype="bfloat16", reduce_dtype="float32",
                      prefetch_layers=args.job_prefetch)
    zs = make_step(trainable, make_tx(), zero=zero, mesh=mesh)
    batch = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32)
    t0 = time.perf_counter()
    compiled = zs.lower(batch).compile()
    built = Built(f"{args.job_mesh}_prefetch{args.job_prefetch}", compiled,
                  lambda: zs.init(jax.random.key(0)), zs.abstract_state,
                  time.perf_counter() - t0)
    log(f"{built.name}: compiled in {built.compile_s:.1f}s")
    tokens = None
    if not args.no_time:
        host = np.random.default_rng(0).integers(0, args.vocab, batch.shape, dtype=np.int32)
        tokens = zs.put_batch(host)
    row = measure(built, tokens, args.repeats)
    row["mesh"] = {"data": data, "model": model}
    row["prefetch"] = args.job_prefetch
    row["collectives_by_axis"] = collective_bytes(compiled.as_text(),
                                                  mesh_axes=dict(mesh.shape)).by_axis
    row["model_split_leaves"] = sum(leaf.model_dim is not None for leaf in zs.plan.leaves)
    return row


def spawn(argv: list[str], mesh: str, prefetch: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--job-mesh", mesh,
           "--job-prefetch", str(prefetch)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write("".join(line + "\n" for line in r.stderr.splitlines()
                             if line.startswith("[mesh_2d]")))
    if r.returncode:
        return {"name": f"{mesh}_prefetch{prefetch}", "error": r.stderr.strip()[-500:]}
    return json.loads(r.stdout)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--meshes", default="8x1,4x2,2x4", help="DATAxMODEL, first is the baseline")
    p.add_argument("--prefetch", default="0,1", help="prefetch_layers values")
    p.add_argument("--job-mesh", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-prefetch", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job_mesh:
        print(json.dumps(run_row(args)))
        return
    meshes = [m for m in args.meshes.split(",") if m]
    rows: list[dict[str, Any]] = []
    for prefetch in (int(x) for x in args.prefetch.split(",") if x):
        base = None
        for mesh in meshes:
            row = spawn(argv, mesh, prefetch)
            if "error" not in row:
                base = base or row
                row["time_ratio"] = _ratio(row.get("step_time_s"), base.get("step_time_s"))
                row["wire_ratio"] = _ratio(row["collectives"]["wire"],
                                           base["collectives"]["wire"])
                row["state_ratio"] = _ratio(row["state_bytes"], base["state_bytes"])
                row["temp_ratio"] = _ratio(row["temp_bytes"], base["temp_bytes"])
            rows.append(row)
    config = {k: getattr(args, k) for k in ("d_model", "n_layers", "n_heads", "vocab", "seq_len",
                                            "batch", "devices", "repeats")}
    print(json.dumps({"config": config, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
