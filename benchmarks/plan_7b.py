"""`zjax plan` on a 7.5B-parameter GPT over 64 simulated devices against the ZeRO paper.

The ZeRO paper's Figure 1 gives the model-state memory per device (parameters + gradients +
optimizer state, mixed-precision Adam: bf16 params and gradients, fp32 master and moments) of a
7.5B model on 64 devices: 120 GB (stage 0 / DDP), 31.4 GB (stage 1), 16.6 GB (stage 2) and
1.9 GB (stage 3). This script compiles zjax's real train step for each stage from
``ShapeDtypeStruct``s (nothing is allocated) and prints one JSON object with the plan's figures
beside the paper's.

Usage: ``python benchmarks/plan_7b.py [--devices 64] [--stages 0,1,2,3]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
# d_model 4096, 36 blocks, GPT-2 BPE vocabulary: 7.46B parameters
MODEL = ["model.vocab_size=50304", "model.d_model=4096", "model.n_layers=36",
         "model.n_heads=32", "model.max_seq_len=2048", "model.tie_embeddings=true"]
# mixed-precision Adam as in the paper; one 512-token sequence per device (activations do
# not enter the model-state figure)
TRAINING = ["zero.gather_dtype=bfloat16", "zero.reduce_dtype=bfloat16",
            "zero.param_persistence_threshold=100000", "zero.prefetch_layers=1",
            "data.seq_len=512", "optimizer.name=adamw"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--stages", default="0,1,2,3")
    args = p.parse_args()
    from zjax.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)  # before jax starts its backends
    import zjax

    rows, t_all = [], time.perf_counter()
    for stage in (int(s) for s in args.stages.split(",")):
        config = zjax.load_config(None, [*MODEL, *TRAINING, f"zero.stage={stage}",
                                         f"data.batch_size={args.devices}"])
        t0 = time.perf_counter()
        report = zjax.plan(config, devices=args.devices)
        seconds = time.perf_counter() - t0
        gb = report.per_device["model_state_bytes"] / 1e9
        rows.append({
            "stage": stage,
            "model_state_gb": round(gb, 3),
            "paper_gb": PAPER_GB[stage],
            "ratio_to_paper": round(gb / PAPER_GB[stage], 4),
            "formula_gb": round(report.formula["model_state_bytes"] / 1e9, 3),
            "per_device": report.per_device,
            "collectives": report.collectives,
            "seconds": round(seconds, 1),
        })
        print(f"[plan_7b] stage {stage}: {gb:.2f} GB per device (paper {PAPER_GB[stage]}), "
              f"{seconds:.0f}s", file=sys.stderr, flush=True)
    print(json.dumps({"n_params": report.n_params, "devices": args.devices, "rows": rows,
                      "total_seconds": round(time.perf_counter() - t_all, 1)}, indent=1))


if __name__ == "__main__":
    main()
