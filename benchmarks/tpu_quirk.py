"""Temp of a step compiled for a TPU target with one of the TPU record's quirks on and off.

The figures behind ``Backend.hoists_loop_casts`` and ``Backend.prefetch_before_vjp``
(``zjax/runtime/_backend.py``). Compile only; nothing runs on a TPU. Example::

    JAX_PLATFORMS=cpu python benchmarks/tpu_quirk.py prefetch_before_vjp zero.stage=3 \\
        zero.prefetch_layers=1 zero.reduce_dtype=bfloat16 model.d_model=768 model.d_ff=3072 \\
        model.n_layers=8 data.seq_len=512 model.max_seq_len=512 data.batch_size=64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU to contend for

import jax

import zjax
from zjax.runtime import _backend
from zjax.runtime.targets import target


def temp_bytes(config_file: str, overrides: list[str], name: str) -> int:
    """Temp of the config's train step compiled for ``name`` (per device)."""
    config = zjax.load_config(config_file, overrides)
    compiled = zjax.build_step(config, target(name)).lower(zjax.abstract_batch(config)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("quirk", help="a field of the TPU Backend record, e.g. prefetch_before_vjp")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--target", default="v5p:2x2x2")
    args = p.parse_args()
    jax.config.update("jax_platforms", "cpu")  # compile-only
    record = _backend.backend("tpu")
    if getattr(record, args.quirk, None) is None:
        p.error(f"the TPU record has no quirk {args.quirk!r} set")
    on = temp_bytes(args.config, args.overrides, args.target)
    _backend._BACKENDS["tpu"] = dataclasses.replace(record, **{args.quirk: None})
    off = temp_bytes(args.config, args.overrides, args.target)
    print(json.dumps({"target": args.target, "quirk": args.quirk, "overrides": args.overrides,
                      "temp_bytes_on": on, "temp_bytes_off": off}))


if __name__ == "__main__":
    main()
