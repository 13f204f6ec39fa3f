"""Sequence parallelism (``mesh.context``): the longest single sequence of the 8B template
per target, and the step time of a context split on XLA:CPU.

``longest``: ``configs/llama3-8b.yaml`` with one sequence split over every device of the target
(``mesh.context`` = devices unless ``--context``; the attention as ``model.context_attention:
auto`` picks it), with and without ``zero.offload_activations``: the longest multiple of
``--step`` whose compiled step fits the device (doubling, then bisection; each length compiled
from ``ShapeDtypeStruct``s, nothing allocated), with its per-device memory, host memory per
host, the attention method, and the compile time at that length.

``cpu``: median step time on 8 simulated CPU devices of a d512, 8-layer Llama (8 heads over 8
key/value heads, d_ff 1376, byte vocabulary, stage 3, bfloat16 gathers) over 8192 tokens a
step: one 8192-token sequence split 8 ways by Ulysses and by the ring, against no context
split (8 sequences of 1024 tokens over ``data``); ratios to the unsplit run in the same run,
with the model FLOPs ratio beside them (the split runs attend over a sequence 8 x longer).

Prints one JSON object (progress on stderr).

Usage: ``python benchmarks/context_parallel.py longest --targets h100:8,h100:8x8,v5p:4x4x4``;
``python benchmarks/context_parallel.py cpu --repeats 3``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from zjax.runtime.mesh import simulate_cpu_devices

simulate_cpu_devices(8)

TEMPLATE = "configs/llama3-8b.yaml"
# processes (hosts) per target: 8 GPUs per H100 host, 4 chips per v5p host
CHIPS_PER_HOST = {"h100": 8, "v5p": 4}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _devices(name: str) -> int:
    from zjax.runtime.targets import target

    return len(target(name).devices)


def longest(name: str, *, context: int | None, offload: bool, step: int) -> dict:
    """The longest one-sequence step of the template that fits ``name``."""
    import zjax
    from zjax.planning import longest_sequence, plan

    c = context or _devices(name)
    overrides = [f"mesh.context={c}", "model.max_seq_len=16777216", "data.path=",
                 "train.eval_every=0", f"zero.offload_activations={str(offload).lower()}"]
    config = zjax.load_config(TEMPLATE, overrides)
    result = longest_sequence(config, target=name, step=step, progress=log)
    row = {"context": c, "seq_len": result.seq_len, "tried": len(result.tried)}
    if result.report is None:
        return row
    d = result.report.per_device
    per_host = CHIPS_PER_HOST[name.split(":")[0]]
    t0 = time.perf_counter()  # the compile at the answer's length, timed on its own
    plan(_at(config, result.seq_len), target=name)
    row |= {"device_total_gb": round(d["total_bytes"] / 1e9, 2),
            "temp_gb": round(d.get("temp_bytes", 0) / 1e9, 2),
            "host_gb_per_host": round((d["host_bytes"] + d.get("host_temp_bytes", 0))
                                      * per_host / 1e9, 2),
            "context_per_layer": result.report.context_per_layer,
            "compile_s": round(time.perf_counter() - t0, 1)}
    return row


def _at(config, seq_len: int):
    """``config`` at one sequence of ``seq_len`` (what ``longest`` compiled last)."""
    import dataclasses

    return dataclasses.replace(config, data=dataclasses.replace(
        config.data, seq_len=seq_len, batch_size=1), model=dataclasses.replace(
        config.model, max_seq_len=max(config.model.max_seq_len, seq_len)))


CPU_MODEL = ["loop=llama", "model.vocab_size=256", "model.d_model=512", "model.n_layers=8",
             "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=1376",
             "model.max_seq_len=8192", "zero.stage=3", "zero.gather_dtype=bfloat16",
             "zero.param_persistence_threshold=4096", "data.path=", "train.eval_every=0"]


def cpu_step(overrides: list[str], repeats: int) -> dict:
    """Median step time of the CPU model with ``overrides`` on the 8 simulated devices."""
    import jax
    import numpy as np

    import zjax

    config = zjax.load_config(None, [*CPU_MODEL, *overrides])
    zstep = zjax.build_step(config)
    shape = (config.data.batch_size, config.data.seq_len + 1)
    tokens = np.random.default_rng(0).integers(0, 256, shape).astype(np.int32)
    batch = zstep.put_batch(tokens)
    state = zstep.init(jax.random.key(0))
    times = []
    for i in range(repeats + 1):  # the first call compiles
        t0 = time.perf_counter()
        state, metrics = zstep.step(state, batch)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - t0)
        log(f"{overrides}: step {i} {time.perf_counter() - t0:.2f} s")
    from zjax.planning import plan

    report = plan(config)
    return {"step_s": round(statistics.median(times), 3),
            "flops_per_step": report.flops.get("per_step"),
            "context_per_layer": report.context_per_layer,
            "temp_mb": round(report.per_device.get("temp_bytes", 0) / 1e6, 1)}


def cpu(repeats: int) -> dict:
    runs = {
        "none (8 x 1024 over data)": ["data.batch_size=8", "data.seq_len=1024"],
        "ulysses (1 x 8192, context 8)": ["data.batch_size=1", "data.seq_len=8192",
                                          "mesh.context=8",
                                          "model.context_attention=ulysses"],
        "ring (1 x 8192, context 8)": ["data.batch_size=1", "data.seq_len=8192",
                                       "mesh.context=8", "model.context_attention=ring"],
    }
    rows = {name: cpu_step(o, repeats) for name, o in runs.items()}
    base = rows["none (8 x 1024 over data)"]
    for row in rows.values():
        row["time_ratio"] = round(row["step_s"] / base["step_s"], 3)
        if row["flops_per_step"] and base["flops_per_step"]:
            row["flops_ratio"] = round(row["flops_per_step"] / base["flops_per_step"], 3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["longest", "cpu"])
    ap.add_argument("--targets", default="h100:8,h100:8x8,v5p:4x4x4")
    ap.add_argument("--context", type=int, default=None,
                    help="mesh.context (default: every device of the target)")
    ap.add_argument("--step", type=int, default=65536, help="granularity (longest)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (cpu)")
    ap.add_argument("--offload", choices=["both", "default", "offload"], default="both",
                    help="with and/or without zero.offload_activations (longest)")
    args = ap.parse_args()
    if args.what == "cpu":
        rows = cpu(args.repeats)
    else:
        rows = {}
        offloads = {"both": (False, True), "default": (False,), "offload": (True,)}
        for name in args.targets.split(","):
            for off in offloads[args.offload]:
                key = f"{name} {'offload' if off else 'default'}"
                rows[key] = longest(name, context=args.context, offload=off, step=args.step)
                log(json.dumps({key: rows[key]}))  # kept should a later target be cut short
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
