"""Long context: the compiled step's temp at a fixed number of tokens per device, as the
sequence grows; and a config's fit on a target.

``scaling`` (default): the issue's probe model (``configs/llama3-8b.yaml`` with 2 layers,
d_model 1024, 16 heads over 4 key/value heads, d_ff 4096, vocabulary 32000) at 16384 tokens
per device, sequence lengths 2048 and 8192, ``model.attention`` auto (the new default) against
``dense`` with the plain loss (``model.loss_chunk`` = all tokens), on every target given.

``longest``: the longest single sequence per device of ``configs/llama3-8b.yaml`` that fits
each target, with and without ``zero.offload_activations``.

``fit``: ``configs/llama3-8b.yaml`` (its own settings) at ``--batch`` x ``--seq`` tokens per
device on each target, with and without ``zero.offload_activations``, and with the MLP tiled
by one sequence (``model.mlp_chunk``).

Prints one JSON object (progress on stderr). Every figure is ``memory_analysis()`` of the step
lowered from ``ShapeDtypeStruct``s: exact and repeatable.

Usage: ``python benchmarks/long_context.py scaling --targets cpu,h100:8,v5p:2x2x2``;
``python benchmarks/long_context.py fit --targets h100:8x8,v5p:4x4x4 --batch 4 --seq 8192``;
``python benchmarks/long_context.py longest --targets h100:8``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from zjax.runtime.mesh import simulate_cpu_devices

simulate_cpu_devices(8)

PROBE = ["model.n_layers=2", "model.d_model=1024", "model.n_heads=16", "model.n_kv_heads=4",
         "model.d_ff=4096", "model.vocab_size=32000", "model.max_seq_len=131072",
         "data.path=", "train.eval_every=0"]


def measure(file: str, name: str, overrides: list[str]) -> dict:
    """Per-device bytes of the compiled step (``cpu``: the simulated devices)."""
    import zjax
    from zjax.runtime.targets import target

    config = zjax.load_config(file, overrides)
    tgt = None if name == "cpu" else target(name)
    zstep = zjax.build_step(config, tgt)
    m = zstep.lower(zjax.abstract_batch(config)).compile().memory_analysis()
    state = m.argument_size_in_bytes
    out = {"temp_gb": round(m.temp_size_in_bytes / 1e9, 3),
           "state_gb": round(state / 1e9, 3),
           "host_temp_gb": round(getattr(m, "host_temp_size_in_bytes", 0) / 1e9, 3)}
    if tgt is not None:
        out["fits"] = m.temp_size_in_bytes + state + m.output_size_in_bytes \
            - m.alias_size_in_bytes <= tgt.capacity_bytes
    return out


def _devices(name: str) -> int:
    if name == "cpu":
        return 8
    from zjax.runtime.targets import target
    return len(target(name).devices)


def scaling(targets: list[str], tokens: int) -> dict:
    rows = {}
    for name in targets:
        n = _devices(name)
        for seq in (2048, 8192):
            batch = [f"data.seq_len={seq}", f"data.batch_size={tokens * n // seq}"]
            for label, extra in (("auto", []),
                                 ("dense", ["model.attention=dense",
                                            f"model.loss_chunk={tokens * n}"])):
                key = f"{name} T={seq} {label}"
                print(key, file=sys.stderr)
                rows[key] = measure("configs/llama3-8b.yaml", name, PROBE + batch + extra)
        auto = [rows[f"{name} T={s} auto"]["temp_gb"] for s in (2048, 8192)]
        rows[f"{name} ratio 8192/2048 auto"] = round(auto[1] / auto[0], 3)
    return rows


def fit(targets: list[str], batch: int, seq: int) -> dict:
    rows = {}
    for name in targets:
        n = _devices(name)
        base = [f"data.seq_len={seq}", f"data.batch_size={batch * n}",
                f"model.max_seq_len={max(seq, 8192)}"]
        for label, extra in (("default", []), ("offload", ["zero.offload_activations=true"]),
                             ("tiled mlp", [f"model.mlp_chunk={seq}"])):
            key = f"{name} {batch}x{seq} {label}"
            print(key, file=sys.stderr)
            rows[key] = measure("configs/llama3-8b.yaml", name, base + extra)
    return rows


def _fits(name: str, seq: int, extra: list[str]) -> dict:
    row = measure("configs/llama3-8b.yaml", name,
                  [f"data.seq_len={seq}", f"data.batch_size={_devices(name)}",
                   f"model.max_seq_len={seq}", *extra])
    print(f"{name} T={seq} {extra}: {row}", file=sys.stderr)
    return row


def longest(targets: list[str], step: int) -> dict:
    """The longest single sequence per device that fits (a multiple of ``step``): doubling
    from ``step``, then bisection."""
    rows = {}
    for name in targets:
        for label, extra in (("default", []), ("offload", ["zero.offload_activations=true"])):
            lo, hi = 0, step
            while _fits(name, hi, extra)["fits"]:
                lo, hi = hi, hi * 2
            while hi - lo > step:
                mid = (lo + hi) // 2 // step * step
                lo, hi = (mid, hi) if _fits(name, mid, extra)["fits"] else (lo, mid)
            rows[f"{name} {label}"] = lo
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["scaling", "fit", "longest"], nargs="?",
                    default="scaling")
    ap.add_argument("--targets", default="cpu,h100:8,v5p:2x2x2")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per device (scaling)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per device (fit)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--step", type=int, default=8192, help="granularity (longest)")
    args = ap.parse_args()
    targets = args.targets.split(",")
    if args.what == "scaling":
        rows = scaling(targets, args.tokens)
    elif args.what == "fit":
        rows = fit(targets, args.batch, args.seq)
    else:
        rows = longest(targets, args.step)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
