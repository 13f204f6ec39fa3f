"""Parameters and optimizer state on NVMe (the streamed step): a model whose float32 master
and Adam moments are larger than this machine's memory, trained.

1. The disk holding ``--path``: its duplex throughput, one thread reading a file while another
   writes one (``benchmarks/nvme.py``'s measure, ``O_DIRECT``).
2. A byte-level GPT of ``--layers`` x ``--d-model`` (default 39 x 2560: 3.07e9 parameters,
   36.8 GB of float32 master and Adam moments, 12.3 GB of gradients' swap files) on
   ``--devices`` simulated CPU devices, ``zero.offload_param.device: nvme`` and
   ``zero.offload_optimizer.device: nvme`` under ``--path``, the saved layer inputs in host
   memory, float32 gathers (XLA:CPU's bfloat16 matmuls are slow; the stream reads the float32
   master either way): init (one layer at a time), then ``--steps`` steps of Adam (lr 2e-6,
   no warmup: 3e-5 raises the loss of 4 such layers, in memory as streamed, and 1e-5 that
   of 39) on one batch of Python's standard library source, the same each step (three steps of
   different text need not lower the loss; one batch seen again must). Before each step the
   swap files' pages are written back and evicted, so its reads come from the disk.
3. Per step: loss, seconds, bytes the step moved through the swap files and their rate
   against the disk's duplex figure (measured before the model is built and again after the
   steps: the higher of the two), and what the disk itself read and wrote (its block
   device's sectors) until the step's writes were on it; the process's peak resident memory
   (VmHWM) at the end.

Prints one JSON object. Usage: ``python benchmarks/nvme_params.py [--path DIR] [--layers 39]
[--d-model 2560] [--devices 2] [--steps 3] [--seq 16] [--raw-bytes 2147483648]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="/work/nvme_bench")
    p.add_argument("--layers", type=int, default=39)
    p.add_argument("--d-model", type=int, default=2560)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--raw-bytes", type=float, default=2 * 2**30)
    p.add_argument("--clip-norm", type=float, default=1.0,
                   help="global-norm clip; 0: none (the update overlaps the backward)")
    return p.parse_args()


def _text_batches(rows: int, seq: int):
    """Consecutive ``[rows, seq + 1]`` windows of the standard library's source, as bytes."""
    import numpy as np

    data = bytearray()
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += f.read_bytes()
        if len(data) > 4 << 20:
            break
    tokens = np.frombuffer(bytes(data), np.uint8).astype(np.int32)
    n = rows * (seq + 1)
    for start in range(0, len(tokens) - n, n):
        yield tokens[start:start + n].reshape(rows, seq + 1)


def _evict(paths: list[Path]) -> None:
    """Write the swap files back and drop their pages: the next reads come from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _config(a: argparse.Namespace):
    import zjax

    d = a.d_model
    return zjax.load_config(Path(__file__).parents[1] / "configs/tiny.yaml", [
        f"model.d_model={d}", f"model.n_heads={d // 128}", f"model.d_ff={4 * d}",
        f"model.n_layers={a.layers}", f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
        f"data.batch_size={a.devices}", "data.path=", "optimizer.warmup_steps=0",
        "zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={a.path}",
        "zero.offload_optimizer.buffer_count=2", "zero.sub_group_size=4194304",
        "zero.offload_param.device=nvme", "zero.offload_param.buffer_count=2",
        "zero.offload_activations=true", "zero.gather_dtype=float32", "optimizer.lr=2e-6",
        f"optimizer.clip_norm={a.clip_norm or ''}"])


def _disk_bytes(path: str) -> int:
    """Bytes the block device holding ``path`` has read and written so far (its sectors
    in ``/sys/dev/block/MAJ:MIN/stat``)."""
    dev = os.stat(path).st_dev
    fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    return 512 * (int(fields[2]) + int(fields[6]))


def _step_row(zstep, state, batch, stores, *, path: str) -> tuple:
    """One step, the swap files' pages written back and evicted first: ``(state, row)``.
    ``gbs``: the bytes the step moved through the swap files over its time; ``disk_gbs``:
    what the disk itself read and wrote from the step's start until the step's writes were
    on it (fsync), over that time (the page cache serves some reads, and holds writes)."""
    files = [s.file(n) for s in stores for n in s.sizes]
    _evict(files)
    before = [(s.read_bytes, s.written_bytes) for s in stores]
    disk0, t = _disk_bytes(path), time.perf_counter()
    state, m = zstep.step(state, zstep.put_batch(batch))
    loss = float(m["loss"])
    seconds = time.perf_counter() - t
    _evict(files)
    disk_s, disk = time.perf_counter() - t, _disk_bytes(path) - disk0
    moved = sum(s.read_bytes - b[0] + s.written_bytes - b[1]
                for s, b in zip(stores, before, strict=True))
    return state, {"loss": loss, "seconds": round(seconds, 1), "moved_gb": moved / 1e9,
                   "gbs": moved / seconds / 1e9, "disk_gb": disk / 1e9,
                   "disk_s": round(disk_s, 1), "disk_gbs": disk / disk_s / 1e9,
                   "update_s": round(float(m["nvme_update_s"]), 1)}


def main() -> None:
    a = _args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).parent))
    import jax
    import nvme as disk

    import zjax

    Path(a.path).mkdir(parents=True, exist_ok=True)
    raw = disk.raw_bandwidth(a.path, int(a.raw_bytes))
    config = _config(a)
    zstep = zjax.build_step(config)
    n_params = sum(leaf.size for leaf in zstep.plan.leaves)
    t = time.perf_counter()
    state = zstep.init(jax.random.key(0))
    init_s = time.perf_counter() - t
    engine = zstep.nvme
    stores = [engine.opt.store, engine.grads.store]
    rows, batch = [], next(_text_batches(a.devices, a.seq))  # one batch: the loss must fall
    for _ in range(a.steps):
        state, row = _step_row(zstep, state, batch, stores, path=a.path)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    swap_gb = sum(s.nbytes for s in stores) / 1e9
    zstep.close()
    # the disk's duplex measured again after the steps: the step's share is of the higher
    after = disk.raw_bandwidth(a.path, int(a.raw_bytes))
    duplex = max(raw["duplex_total_gbs"], after["duplex_total_gbs"])
    for row in rows:
        row.update(vs_duplex=row["gbs"] / duplex, disk_vs_duplex=row["disk_gbs"] / duplex)
    out = {"params": n_params, "state_gb": 12 * n_params / 1e9,
           "swap_gb": swap_gb, "devices": a.devices,
           "tokens_per_step": a.devices * a.seq, "init_s": round(init_s, 1), "disk": raw,
           "disk_after": after, "duplex_gbs": duplex, "steps": rows, "peak_rss_gib": _hwm() / 2**30,
           "machine_memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
           / 2**30}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
