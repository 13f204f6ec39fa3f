"""Peak host memory (RSS) of ``zjax export`` against the model size.

Builds a GPT of a few hundred MB (float32 master), writes a zjax checkpoint of it (sharded init
on 8 simulated CPU devices, no training), then runs the export for each format / dtype in a
fresh process and reads that process's peak RSS. Prints one JSON object.

Usage: ``python benchmarks/export_memory.py [--d-model 1024 --n-layers 16 --vocab 32768]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _peak_rss import peak_rss


def write_checkpoint(run_dir: Path, args: argparse.Namespace) -> dict:
    from zjax.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    import jax
    import optax

    import zjax
    from zjax.checkpoint import CheckpointConfig, Checkpointer
    from zjax.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers,
                    n_heads=8, max_seq_len=128)
    trainable = zjax.from_nnx(lambda rngs: GPT(cfg, rngs=rngs), lm_loss)
    zstep = zjax.make_step(trainable, optax.adamw(1e-3), zero=zjax.ZeroConfig(stage=3),
                           mesh=zjax.make_mesh())
    state = zstep.init(jax.random.key(0))
    ckpt = Checkpointer(run_dir / "checkpoints", CheckpointConfig())
    ckpt.save(1, state, zstep)
    ckpt.close()
    leaves = [leaf.size * 4 for leaf in zstep.plan.leaves]
    return {"params": sum(leaf.size for leaf in zstep.plan.leaves),
            "model_bytes_fp32": sum(leaves), "largest_leaf_bytes_fp32": max(leaves)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        sizes = write_checkpoint(run_dir, args)
        rows = []
        for fmt, dtype in [("orbax", "bfloat16"), ("orbax", "float32"),
                           ("safetensors", "bfloat16"), ("safetensors", "float32")]:
            out = Path(tmp) / f"export-{fmt}-{dtype}"
            before, above = peak_rss("from zjax.export import export",
                                     "export(sys.argv[1], sys.argv[2], dtype=sys.argv[3], "
                                     "format=sys.argv[4])", [str(run_dir), str(out), dtype, fmt])
            rows.append({"format": fmt, "dtype": dtype, "baseline_rss_bytes": before,
                         "peak_rss_bytes": before + above, "export_rss_bytes": above,
                         "x_largest_leaf": round(above / sizes["largest_leaf_bytes_fp32"], 2),
                         "x_model": round(above / sizes["model_bytes_fp32"], 2)})
        print(json.dumps({"model": vars(args), **sizes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
