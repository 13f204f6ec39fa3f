"""Train-step time with ``model.fp8`` against bf16, as ratios in one run.

Builds the same Llama step twice on this process's devices, ``model.fp8: none`` (bf16 GEMMs,
``zero.gather_dtype: bfloat16``) and ``model.fp8: tensorwise`` (every decoder projection as
FP8 GEMMs), and times ``--steps`` steps of each after two warm-up steps, on one fixed batch
of random tokens; medians, and FP8's time over bf16's. Interleaves the runs (bf16, FP8, bf16,
FP8, ...) so drift in the machine's speed hits both.

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


def _step(a: argparse.Namespace, fp8: str):
    import jax

    import zjax

    d = a.d_model
    config = zjax.load_config(ROOT / "configs/llama-tiny.yaml", [
        f"model.d_model={d}", f"model.n_heads={max(1, d // 64)}",
        f"model.n_kv_heads={max(1, d // 256)}", f"model.d_ff={int(d * 8 / 3) // 64 * 64}",
        f"model.n_layers={a.layers}", f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
        f"data.batch_size={a.batch}", "data.path=", f"model.fp8={fp8}"])
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

    runs = {fp8: list(_step(a, fp8)) for fp8 in ("none", "tensorwise")}
    tokens = np.random.default_rng(0).integers(0, 256, (a.batch, a.seq + 1)).astype(np.int32)
    batch = {k: runs[k][0].put_batch(tokens) for k in runs}
    for k, run in runs.items():  # compile and warm up
        run[1], _ = _time(run[0], run[1], batch[k], 2)
    medians: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for k, run in runs.items():
            run[1], seconds = _time(run[0], run[1], batch[k], a.steps)
            medians[k].append(seconds)
    bf16, fp8 = (statistics.median(medians[k]) for k in ("none", "tensorwise"))
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
        "shape": {"d_model": a.d_model, "layers": a.layers, "seq": a.seq, "batch": a.batch},
        "step_s": {"bf16": round(bf16, 4), "fp8": round(fp8, 4)},
        "fp8_over_bf16": round(fp8 / bf16, 3),
        "tokens_per_s": {"bf16": round(a.batch * a.seq / bf16),
                         "fp8": round(a.batch * a.seq / fp8)}}, indent=1))
    for run in runs.values():
        run[0].close()


if __name__ == "__main__":
    main()
