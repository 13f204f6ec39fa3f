"""libtpu flags against zjax's stage-3 step: which ones raise the overlap of the ZeRO collectives.

Compiles ``benchmarks/zero_step.py``'s stage-3 rows for a TPU topology (deviceless) with the
TPU record's compiler options (:mod:`zjax.runtime._backend`) plus, per variant, extra libtpu
flags, and
prints per row: temp bytes (``memory_analysis()``), wire bytes and the fraction of all-gather
bytes whose async start..done encloses compute (``zjax.planning``). The record keeps a flag only if
a row here shows it helps.

Usage: ``JAX_PLATFORMS=cpu python benchmarks/tpu_flags.py [--target v5p:2x2x2] [--jobs
zjax_stage3_p1_bf16,zjax_stage3_p0_bf16] [--d-model 1024 --n-layers 16 --batch 64 --seq-len
512]``; results of a run are in ``benchmarks/results/tpu_flags_v5p_2x2x2_d1024.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_step

import zjax.runtime._backend as _backend

_ALL_REDUCE = {"xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
               "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": True,
               "xla_enable_async_all_reduce": True}
# each variant: flags set on top of the record's (True, or the value given); "-" removes
VARIANTS = {
    "record": {},
    "record - all-reduce fusion": {k: "-" for k in _ALL_REDUCE},
    "+ ag_backward_pipelining": {"xla_tpu_enable_ag_backward_pipelining": True},
    "+ fusion_while_loops": {"xla_tpu_enable_async_collective_fusion_while_loops": True},
    "+ data_parallel_all_reduce_opt": {"xla_tpu_enable_data_parallel_all_reduce_opt": True,
                                       "xla_tpu_data_parallel_opt_different_sized_ops": True},
    "+ collective_pipeliner": {"xla_tpu_enable_collective_pipeliner": True},
    "+ scheduler memory limit 100%": {"xla_tpu_scheduler_percent_shared_memory_limit": 100},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="v5p:2x2x2")
    p.add_argument("--jobs", default="zjax_stage3_p1_bf16,zjax_stage3_p0_bf16")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    p.add_argument("--d-model", default="1024")
    p.add_argument("--n-layers", default="16")
    p.add_argument("--batch", default="64")
    p.add_argument("--seq-len", default="512")
    args = p.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    record = _backend.backend("tpu")
    for name in args.variants.split(","):
        opts = dict(record.compiler_options)
        for flag, value in VARIANTS[name].items():
            if value == "-":
                opts.pop(flag, None)
            else:
                opts[flag] = value
        _backend._BACKENDS["tpu"] = dataclasses.replace(
            record, compiler_options=types.MappingProxyType(opts))
        for job in args.jobs.split(","):
            row = zero_step.run_job(zero_step.parse_args([
                "--target", args.target, "--d-model", args.d_model, "--n-layers", args.n_layers,
                "--batch", args.batch, "--seq-len", args.seq_len, "--no-time", "--job", job]))
            c = row["collectives"]
            print(f"{name:32s} {job:22s} temp {row['temp_bytes'] / 1e6:7.1f} MB  wire "
                  f"{c['wire'] / 1e6:7.1f} MB  all-gather overlap "
                  f"{c['overlap'].get('all_gather', 0):.2f}", flush=True)
    _backend._BACKENDS["tpu"] = record


if __name__ == "__main__":
    main()
