"""XLA:CPU's collective thread pool on simulated devices: the hang, and ``PJRT_NPROC``.

Runs, in a fresh process per setting, a ``shard_map`` scan whose iterations each hold three
independent collectives over 8 simulated devices (the shape of a ZeRO-3 layer loop with
prefetch: a gather ahead, a reduce-scatter behind), with XLA's collective terminate timeout
cut to ``--timeout`` seconds so that a hang ends as an abort. Prints one JSON object: per
``PJRT_NPROC`` setting, how many of ``--tries`` runs finished, and their median wall time.

XLA:CPU sizes its pool to max(cores, devices): on a machine with <= 8 cores, ``default`` is
one thread per device, and a device that starts a second collective can leave none for the
last device of the first. ``zjax.runtime.mesh.simulated_device_env`` sets 4 threads per device.

Usage: ``python benchmarks/cpu_collectives.py [--tries 3] [--nproc default,32]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROGRAM = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("d",))

def body(c, _):
    a, b = c
    g1 = jax.lax.all_gather(a, "d", tiled=True)
    g2 = jax.lax.psum_scatter(b, "d", tiled=True)
    g3 = jax.lax.all_gather(b[:8], "d", tiled=True)
    return (a + g1[:a.shape[0]] * 1e-3 + g3[:a.shape[0]].sum() * 0,
            b * 0.999 + jnp.tile(g2, 8) * 1e-3), None

@jax.jit
@jax.shard_map(mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), P("d")))
def f(a, b):
    return jax.lax.scan(body, (a, b), None, length=200)[0]

s = NamedSharding(mesh, P("d"))
a, b = jax.device_put(jnp.ones(512), s), jax.device_put(jnp.ones(4096), s)
for _ in range(100):
    a, b = f(a, b)
jax.block_until_ready(a)
"""


def run(nproc: str, timeout_s: int) -> tuple[bool, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout_s}")
    env["JAX_PLATFORMS"] = "cpu"
    if nproc != "default":
        env["PJRT_NPROC"] = nproc
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True)
    return r.returncode == 0, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--nproc", default="default,32", help="PJRT_NPROC settings, comma-separated")
    p.add_argument("--timeout", type=int, default=8, help="XLA's collective terminate timeout")
    args = p.parse_args()
    rows = {}
    for nproc in args.nproc.split(","):
        results = [run(nproc, args.timeout) for _ in range(args.tries)]
        print(f"PJRT_NPROC={nproc}: {[ok for ok, _ in results]}", file=sys.stderr)
        rows[nproc] = {"finished": sum(ok for ok, _ in results), "tries": args.tries,
                       "median_s": round(statistics.median(t for _, t in results), 2)}
    print(json.dumps({"cores": os.cpu_count(), "devices": 8, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
