"""Train-step time with ``model.fp8`` (and ``zero.fp8_gather``) against bf16, as ratios in one
run.

Builds the same Llama step three times on this process's devices: ``model.fp8: none`` (bf16
GEMMs and gathers), ``model.fp8: tensorwise`` (every decoder projection as FP8 GEMMs) and that
with ``zero.fp8_gather`` (their weights gathered in FP8), and times ``--steps`` steps of each
after two warm-up steps, on one fixed batch of random tokens; medians, and each one's time
over bf16's. Interleaves the runs (bf16, FP8, FP8 + gathers, bf16, ...) so drift in the
machine's speed hits all three.

On an H100 this is the figure to report (Hopper's FP8 GEMMs); on XLA:CPU the FP8 dots are
float32 arithmetic on rounded values, so it only shows that the program runs (and is slower).
The default shape is small enough for the CPU; ``--d-model 4096 --layers 8 --seq 4096`` is a
Llama-3-8B-wide stack for a GPU.

Prints one JSON object. Usage: ``python benchmarks/fp8.py [--d-model 256] [--layers 4]
[--seq 256] [--batch 8] [--steps 5] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args()


RUNS = {"bf16": ["model.fp8=none"], "fp8": ["model.fp8=tensorwise"],
        "fp8_gather": ["model.fp8=tensorwise", "zero.fp8_gather=true"]}


def _step(a: argparse.Namespace, overrides: list[str]):
    import jax

    import zjax

    d = a.d_model
    config = zjax.load_config(ROOT / "configs/llama-tiny.yaml", [
        f"model.d_model={d}", f"model.n_heads={max(1, d // 64)}",
        f"model.n_kv_heads={max(1, d // 256)}", f"model.d_ff={int(d * 8 / 3) // 64 * 64}",
        f"model.n_layers={a.layers}", f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
        f"data.batch_size={a.batch}", "data.path=", *overrides])
    zstep = zjax.build_step(config)
    state = zstep.init(jax.random.key(0))
    return zstep, state


def _time(zstep, state, batch, steps: int) -> tuple[object, float]:
    import jax

    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = zstep.step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    return state, statistics.median(times)


def main() -> None:
    a = _args()
    from zjax.runtime import quiet_plugins

    quiet_plugins()  # no CUDA/TPU plugin start-up noise on a machine without them
    import jax
    import numpy as np

    runs = {name: list(_step(a, overrides)) for name, overrides in RUNS.items()}
    tokens = np.random.default_rng(0).integers(0, 256, (a.batch, a.seq + 1)).astype(np.int32)
    batch = {k: runs[k][0].put_batch(tokens) for k in runs}
    for k, run in runs.items():  # compile and warm up
        run[1], _ = _time(run[0], run[1], batch[k], 2)
    medians: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for k, run in runs.items():
            run[1], seconds = _time(run[0], run[1], batch[k], a.steps)
            medians[k].append(seconds)
    step = {k: statistics.median(v) for k, v in medians.items()}
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
        "shape": {"d_model": a.d_model, "layers": a.layers, "seq": a.seq, "batch": a.batch},
        "step_s": {k: round(v, 4) for k, v in step.items()},
        "over_bf16": {k: round(v / step["bf16"], 3) for k, v in step.items() if k != "bf16"},
        "tokens_per_s": {k: round(a.batch * a.seq / v) for k, v in step.items()}}, indent=1))
    for run in runs.values():
        run[0].close()


if __name__ == "__main__":
    main()
