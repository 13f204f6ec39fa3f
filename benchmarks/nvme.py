"""The NVMe optimizer engine against the disk it streams from.

1. The raw sequential write and read bandwidth of the disk holding ``--path``, measured here
   with ``O_DIRECT`` (4 MiB aligned blocks, like ``fio --direct=1``), or through the page
   cache with the file's pages evicted (``posix_fadvise(DONTNEED)``) where the filesystem
   refuses ``O_DIRECT``.
2. :class:`zjax.offload.StreamingOptimizer` (Adam) on a state of ``--params`` float32
   parameters (master and two moments: 12 bytes each): the swap files' pages evicted before
   each timed update, the achieved read and write GB/s over the update, and its time beside
   the same optax update in memory (jitted on the host, whole arrays). The stream reads and
   writes at once, so beside each direction against its own raw figure, ``disk_busy`` is
   the time the raw disk would need for both, sequentially, over the update's time, and
   ``total_vs_duplex`` the stream's read + write GB/s over the disk's own when one thread
   reads a file while another writes one.
3. With ``--train``: the train step of a GPT of ``--params`` (stage 3 on 8 simulated CPU
   devices) with the optimizer in device memory, in host memory (``offload_optimizer:
   host``) and on NVMe: median step time and the NVMe metrics of the step.

Prints one JSON object. Usage: ``python benchmarks/nvme.py [--path DIR] [--params 200e6]
[--sub-group 4194304] [--buffers 4] [--steps 3] [--train]``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

BLOCK = 4 << 20


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:  # written pages must reach the disk before they can be dropped
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_bandwidth(directory: str, nbytes: int) -> dict:
    """Sequential write then read of ``nbytes`` in 4 MiB blocks: GB/s each way."""
    path = os.path.join(directory, "zjax-bench.raw")
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(0).bytes(BLOCK))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    except OSError:
        direct, fd = 0, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, BLOCK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        write_s = time.perf_counter() - t
    finally:
        os.close(fd)
    _evict(path)
    fd = os.open(path, os.O_RDONLY | direct)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, BLOCK):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)
    out = {"o_direct": bool(direct), "bytes": nbytes, "write_gbs": nbytes / write_s / 1e9,
           "read_gbs": nbytes / read_s / 1e9}
    out.update(_duplex(directory, nbytes, direct))
    return out


def _duplex(directory: str, nbytes: int, direct: int) -> dict:
    """Read one file while writing another, each from its own thread (what the stream asks of
    the disk): GB/s each way, and over both."""
    import threading

    src, dst = (os.path.join(directory, f"zjax-bench.{n}") for n in ("src", "dst"))
    buf = mmap.mmap(-1, BLOCK)
    buf.write(np.random.default_rng(1).bytes(BLOCK))
    fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    for off in range(0, nbytes, BLOCK):
        os.pwrite(fd, buf, off)
    os.fsync(fd)
    os.close(fd)
    _evict(src)
    seconds = {}

    def read():
        rbuf = mmap.mmap(-1, BLOCK)
        fd = os.open(src, os.O_RDONLY | direct)
        t = time.perf_counter()
        for off in range(0, nbytes, BLOCK):
            os.preadv(fd, [rbuf], off)
        seconds["read"] = time.perf_counter() - t
        os.close(fd)

    def write():
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        t = time.perf_counter()
        for off in range(0, nbytes, BLOCK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        seconds["write"] = time.perf_counter() - t
        os.close(fd)

    threads = [threading.Thread(target=read), threading.Thread(target=write)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    both = time.perf_counter() - t
    os.unlink(src)
    os.unlink(dst)
    return {"duplex_read_gbs": nbytes / seconds["read"] / 1e9,
            "duplex_write_gbs": nbytes / seconds["write"] / 1e9,
            "duplex_total_gbs": 2 * nbytes / both / 1e9}


class _Grad:
    """A gradient made per sub-group (never whole in memory)."""

    def __getitem__(self, s):
        return np.full(s.stop - s.start, 1e-3, np.float32)


def engine(directory: str, n: int, sub: int, buffers: int, steps: int) -> dict:
    import optax

    from zjax.offload import StreamingOptimizer

    opt = StreamingOptimizer(optax.adam(1e-3), {"w": n}, directory, sub_group_size=sub,
                             buffer_count=buffers)
    try:
        opt.write_initial({"w": _Grad()})
        times, reads, writes = [], [], []
        for _ in range(steps):
            for name in opt.store.sizes:
                _evict(str(opt.store.file(name)))
            r0, w0 = opt.store.read_bytes, opt.store.written_bytes
            t = time.perf_counter()
            opt.update({"w": _Grad()})
            for fd in opt.store._fds.values():  # the writes on the disk, as the raw test
                os.fsync(fd)
            dt = time.perf_counter() - t
            times.append(dt)
            reads.append((opt.store.read_bytes - r0) / dt / 1e9)
            writes.append((opt.store.written_bytes - w0) / dt / 1e9)
        return {"state_bytes": opt.nbytes, "step_s": statistics.median(times),
                "read_gbs": statistics.median(reads), "write_gbs": statistics.median(writes)}
    finally:
        opt.close()


def in_memory(n: int, steps: int) -> float:
    import jax
    import optax

    tx = optax.adam(1e-3)
    params = np.zeros(n, np.float32)
    state = tx.init(params)

    @jax.jit
    def update(g, state, params):
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    g = np.full(n, 1e-3, np.float32)
    params, state = update(g, state, params)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        params, state = jax.block_until_ready(update(g, state, params))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def train_steps(directory: str, n: int, sub: int, buffers: int, steps: int) -> dict:
    """Median step time (and the NVMe step's metrics) of a ~``n``-parameter GPT."""
    import jax

    from zjax import build_step
    from zjax.config import load_config

    d_model = 1024
    n_layers = max(1, round(n / (12 * d_model**2)))
    shape = [f"model.d_model={d_model}", f"model.n_layers={n_layers}", "model.n_heads=16",
             f"model.d_ff={4 * d_model}", "model.max_seq_len=64", "data.seq_len=64",
             "data.batch_size=8", "train.steps=1000", "zero.stage=3"]
    variants = {"device": [], "host": ["zero.offload_optimizer.device=host"],
                "nvme": ["zero.offload_optimizer.device=nvme",
                         f"zero.offload_optimizer.nvme_path={directory}",
                         f"zero.offload_optimizer.buffer_count={buffers}",
                         f"zero.sub_group_size={sub}"]}
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out: dict = {"n_layers": n_layers, "d_model": d_model}
    rng = np.random.default_rng(0)
    for name, extra in variants.items():
        zstep = build_step(load_config(os.path.join(root, "configs/tiny.yaml"), [*shape, *extra]))
        try:
            state = zstep.init(jax.random.key(0))
            batch = zstep.put_batch(rng.integers(0, 256, (8, 65)).astype(np.int32))
            compiled = zstep.lower(jax.ShapeDtypeStruct(batch.shape, batch.dtype)).compile()
            state, _ = compiled(state, batch)  # warm
            times, metrics = [], []
            for _ in range(steps):
                t = time.perf_counter()
                state, m = compiled(state, batch)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t)
                metrics.append({k: float(v) for k, v in m.items() if k.startswith("nvme")})
            out[name] = {"step_s": statistics.median(times),
                         **{k: statistics.median(m[k] for m in metrics) for k in metrics[0]}}
            out["n_params"] = sum(leaf.size for leaf in zstep.plan.leaves)
            print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
        finally:
            del state
            zstep.close()
    for name in ("host", "nvme"):
        out[name]["vs_device"] = out[name]["step_s"] / out["device"]["step_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default=None, help="directory on the disk to test (default: a "
                   "temporary one)")
    p.add_argument("--params", type=float, default=200e6)
    p.add_argument("--sub-group", type=int, default=1 << 22)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train", action="store_true", help="also time the train step")
    args = p.parse_args()
    n = int(args.params)
    if args.train:  # before jax is imported
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from zjax.runtime.mesh import simulate_cpu_devices

        simulate_cpu_devices(8)
    with tempfile.TemporaryDirectory(dir=args.path) as d:
        raw = raw_bandwidth(d, min(4 << 30, 12 * n))
        print(f"raw: write {raw['write_gbs']:.2f} GB/s, read {raw['read_gbs']:.2f} GB/s",
              file=sys.stderr, flush=True)
        nvme = engine(d, n, args.sub_group, args.buffers, args.steps)
        train = train_steps(d, n, args.sub_group, args.buffers, args.steps) if args.train \
            else None
    memory_s = in_memory(n, args.steps)
    nvme["read_vs_raw"] = nvme["read_gbs"] / raw["read_gbs"]
    nvme["write_vs_raw"] = nvme["write_gbs"] / raw["write_gbs"]
    nvme["disk_busy"] = nvme["read_vs_raw"] + nvme["write_vs_raw"]
    # against the disk reading and writing at once, as the stream does
    nvme["total_vs_duplex"] = (nvme["read_gbs"] + nvme["write_gbs"]) / raw["duplex_total_gbs"]
    nvme["step_vs_in_memory"] = nvme["step_s"] / memory_s
    print(json.dumps({"params": n, "sub_group": args.sub_group, "buffers": args.buffers,
                      "raw": raw, "nvme": nvme, "in_memory_step_s": memory_s,
                      **({"train": train} if train else {})}, indent=1))


if __name__ == "__main__":
    main()
