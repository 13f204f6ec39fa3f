"""Bytes by link class for ZeRO-3, hybrid sharding and ZeRO++ (qwZ, qgZ, hpZ).

Compiles a 7.46B GPT (``configs/gpt-7b.yaml``'s width, d_model 4096, with 36 layers to its 32)
for H hosts x D devices (simulated CPU devices; nothing allocated) and reports, per variant,
the collective bytes per
step inside a host and between hosts (``zjax plan --hosts``), and the per-device model state
and temp of the compiled step:

- ``stage3``: ZeRO-3 over all devices;
- ``hsdp``: hybrid sharding, ``mesh.replica=H`` x ``mesh.data=D`` (shards inside a host);
- ``qwz``: stage 3 with int8 weight gathers;
- ``qwz+qgz``: and int8 gradient reduce-scatters;
- ``hpz``, ``hpz+qwz``, ``hpz+qwz+qgz``: ZeRO++'s hierarchical partition over each host's D
  devices (``zero.hpz_partition_size=D``), alone and with the quantized collectives.

Prints one JSON object. Usage: ``python benchmarks/zeropp.py [--hosts 4 --per-host 8]
[--target h100:4x8] [--small] [--batch-per-device B] [--only V,V]`` (``--small``: a d_model
1024, 8-layer model that compiles in seconds; ``--target``: compiled by CUDA's compiler for H
hosts of N GPUs, ``h100:HxN``, whose devices say their host; ``--batch-per-device``: sequences
of 512 tokens per device, 1 by default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MODEL_7B = ["model.vocab_size=50304", "model.d_model=4096", "model.n_layers=36",
            "model.n_heads=32", "model.max_seq_len=2048"]
MODEL_SMALL = ["model.vocab_size=32768", "model.d_model=1024", "model.n_layers=8",
               "model.n_heads=16", "model.max_seq_len=512"]
TRAINING = ["zero.stage=3", "zero.gather_dtype=bfloat16", "zero.reduce_dtype=bfloat16",
            "zero.prefetch_layers=1", "data.seq_len=512", "optimizer.name=adamw"]
QWZ, QGZ = "zero.quantized_weights=true", "zero.quantized_gradients=true"
VARIANTS = {"stage3": [], "hsdp": ["REPLICA"], "qwz": [QWZ], "qwz+qgz": [QWZ, QGZ],
            "hpz": ["HPZ"], "hpz+qwz": ["HPZ", QWZ], "hpz+qwz+qgz": ["HPZ", QWZ, QGZ]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--small", action="store_true")
    p.add_argument("--target", default=None, help="h100:HxN (overrides --hosts, --per-host)")
    p.add_argument("--batch-per-device", type=int, default=1)
    p.add_argument("--only", default=None, help="comma-separated variants (stage3 always)")
    args = p.parse_args()
    if args.target:
        args.hosts, args.per_host = map(int, args.target.split(":")[1].split("x"))
    n = args.hosts * args.per_host
    if not args.target:
        from zjax.runtime.mesh import simulate_cpu_devices

        simulate_cpu_devices(n)  # before jax starts its backends
    from zjax.config import load_config
    from zjax.planning import plan

    rows = {}
    only = set(args.only.split(",")) | {"stage3"} if args.only else set(VARIANTS)
    for name, extra in VARIANTS.items():
        if name not in only:
            continue
        mesh = [f"mesh.replica={args.hosts}", f"mesh.data={args.per_host}"] \
            if extra == ["REPLICA"] else [f"mesh.data={n}"]
        extra = [f"zero.hpz_partition_size={args.per_host}" if x == "HPZ" else x
                 for x in extra if x != "REPLICA"]
        overrides = [*(MODEL_SMALL if args.small else MODEL_7B), *TRAINING,
                     f"data.batch_size={n * args.batch_per_device}", *mesh, *extra]
        start = time.perf_counter()
        config = load_config(None, overrides)
        report = plan(config, target=args.target) if args.target else \
            plan(config, hosts=args.hosts)
        links = report.collectives_by_link
        rows[name] = {
            "inter_host_bytes": sum(links.get("inter_host", {}).values()),
            "intra_host_bytes": sum(links.get("intra_host", {}).values()),
            "by_link": links,
            "model_state_bytes": report.per_device["model_state_bytes"],
            "temp_bytes": report.per_device["temp_bytes"],
            "total_bytes": report.per_device["total_bytes"],
            "hpz_secondary_bytes": report.formula.get("hpz_secondary_bytes"),
            "compile_s": round(time.perf_counter() - start, 1)}
        print(f"{name}: inter-host {rows[name]['inter_host_bytes'] / 2**30:.2f} GiB, "
              f"total {rows[name]['total_bytes'] / 2**30:.2f} GiB per device",
              file=sys.stderr, flush=True)
    base = rows["stage3"]["inter_host_bytes"]
    for row in rows.values():
        row["inter_host_vs_stage3"] = round(row["inter_host_bytes"] / base, 3) if base else None
        row["total_vs_stage3"] = round(row["total_bytes"] / rows["stage3"]["total_bytes"], 3)
    print(json.dumps({"hosts": args.hosts, "per_host": args.per_host, "small": args.small,
                      "batch_per_device": args.batch_per_device,
                      "target": args.target,
                      "n_params": report.n_params, "variants": rows}, indent=1))


if __name__ == "__main__":
    main()
