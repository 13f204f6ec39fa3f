"""The ``zjax`` command line: ``zjax train``, ``zjax config show``, ``zjax export``, ``zjax plot``.

This module reads the process environment: it may simulate CPU devices before jax starts.
Bad input ends with a one-line error and exit code 2, never a traceback.
Log lines go to stderr where stdout holds a command's result (:data:`RESULT_ON_STDOUT`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from zjax.errors import ConfigError, NonFiniteError, ZjaxError
from zjax.runtime import write_stderr
from zjax.runtime.distributed import ENV
from zjax.training import Preempted

__all__ = ["main"]

# More simulated CPU devices than this cost minutes and gigabytes to start (each is a device
# object with its own threads) and teach nothing a compile-only --target does not.
MAX_SIMULATED_DEVICES = 4096


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``zjax: error: ...``, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"zjax: error: {message} (see `{self.prog} --help`)\n")


def _count(text: str) -> int:
    """An argparse type: an integer >= 1 (a number of devices or processes)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zjax", description="ZeRO-3 training for JAX/Flax.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the reference GPT from a YAML config")
    t.add_argument("config", nargs="?", help="YAML file (default: the built-in tiny GPT)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. zero.stage=2")
    t.add_argument("--devices", type=_count, default=None,
                   help="simulate N CPU devices (default 8 when only a CPU is present)")
    t.add_argument("--run-dir", default=None,
                   help="write config.yaml, metrics.jsonl and TensorBoard events here")
    t.add_argument("--deepspeed", default=None, metavar="DS_CONFIG",
                   help="a DeepSpeed ds_config.json, applied under CONFIG's overrides")
    t.add_argument("--coordinator", default=None,
                   help="multi-process: HOST:PORT of process 0 (else ZJAX_COORDINATOR)")
    t.add_argument("--num-processes", type=int, default=None, help="multi-process: P")
    t.add_argument("--process-id", type=int, default=None, help="multi-process: this one's id")
    _launch_parser(sub)
    from zjax.cli._plan import EXIT_CODES

    pn = sub.add_parser("plan", help="exact per-device memory and communication of a config's "
                        "step, compiled ahead of time (nothing allocated); --budget autotunes",
                        epilog=EXIT_CODES)
    pn.add_argument("config", nargs="?", help="YAML or gin file (default: the tiny GPT)")
    pn.add_argument("overrides", nargs="*", help="key=value overrides")
    pn.add_argument("--devices", type=_count, default=None,
                    help="devices in the mesh (simulated on the CPU if needed); mesh.data "
                    "-1 takes what the other mesh axes leave")
    pn.add_argument("--target", default=None,
                    help="compile for an accelerator without one: h100:8, h200:8, h100:2x8 "
                    "(hosts x GPUs), or a TPU topology (v5p:2x2x2, v5e:4x4, v6e:2x4, ...)")
    pn.add_argument("--hosts", type=_count, default=None,
                    help="split collective bytes into intra- and inter-host as if the devices "
                    "were on H hosts (contiguous blocks of the mesh, replica outermost)")
    pn.add_argument("--json", action="store_true", help="print one JSON object")
    pn.add_argument("--budget", default=None,
                    help="device memory per device (e.g. 80GiB; with --target, 'device' for "
                    "its memory): search stages, offload, prefetch, micro-batches, remat, the "
                    "model degree and stage 3's saved inputs for the best config that fits")
    pn.add_argument("--write", default=None, help="with --budget: save the chosen config here")
    pn.add_argument("--base-dtypes", default=None,
                    help="with --budget and lora.rank > 0: the lora.base_dtype values the "
                    "search may choose, e.g. bfloat16,int8,nf4 (the most precise that fits is "
                    "taken); default: the config's own only")
    pn.add_argument("--longest-seq", action="store_true",
                    help="the longest sequence per device that fits the budget (a --target's "
                    "memory by default), one sequence per data rank; each length tried is "
                    "compiled")
    pn.add_argument("--seq-step", type=_count, default=1024,
                    help="with --longest-seq: the lengths tried are multiples of this")
    _export_parser(sub)
    pl = sub.add_parser("plot", help="write loss and throughput PNGs of a run")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR)")
    _config_parser(sub)
    from zjax.cli._tools import tool_parsers

    tool_parsers(sub)
    return p


def _launch_parser(sub) -> None:
    la = sub.add_parser("launch", help="run a command as P local processes of one "
                        "jax.distributed job (testing multi-process on one machine)")
    la.add_argument("-n", "--processes", type=_count, required=True,
                    help="number of processes")
    la.add_argument("--devices-per-process", type=_count, default=None,
                    help="simulated CPU devices in each process")
    la.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    la.add_argument("cmd", nargs=argparse.REMAINDER, metavar="command",
                    help="-- then the command, e.g. -- zjax train configs/tiny.yaml")


def _export_parser(sub) -> None:
    """``zjax export``."""
    from zjax.cli._tools import parse_size

    ex = sub.add_parser("export", help="write a run's params, unsharded, for programs without zjax")
    ex.add_argument("run_dir")
    ex.add_argument("out", help="new directory (orbax, hf) or file (safetensors)")
    ex.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    ex.add_argument("--format", default="orbax", help="orbax, safetensors, hf (Hugging "
                    "Face Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3 or GPT-2: safetensors, "
                    "config.json, tokenizer), or peft (a LoRA run's adapters: "
                    "adapter_config.json, adapter_model.safetensors)")
    ex.add_argument("--max-shard-size", type=parse_size, default=None,
                    help="hf: largest weights file, e.g. 5GB (the default), 500MB")


def _config_parser(sub) -> None:
    """``zjax config show`` and ``zjax config from-deepspeed``."""
    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="action", required=True)
    show = csub.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("config", nargs="?")
    show.add_argument("overrides", nargs="*")
    ds = csub.add_parser("from-deepspeed", help="a DeepSpeed ds_config.json as a zjax config")
    ds.add_argument("ds_config")
    ds.add_argument("config", nargs="?", help="zjax config the DeepSpeed keys apply to")
    ds.add_argument("overrides", nargs="*")
    ds.add_argument("--devices", type=_count, default=8,
                    help="devices of the run (DeepSpeed's batch sizes are per GPU; default 8)")
    ds.add_argument("-o", "--output", default=None, help="write the YAML here (not stdout)")


def _split(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    # `zjax train zero.stage=2` has no file: the first positional is an override
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


_ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def _accelerators() -> list[str]:
    """This machine's accelerator device files (NVIDIA, TPU, AMD).

    A compiler plugin alone (``zjax[targets]`` installs CUDA's and libtpu for compile-only
    targets) does not make an accelerator: without the hardware, zjax simulates CPU devices.
    """
    import glob

    return [f for pattern in _ACCELERATOR_FILES for f in glob.glob(pattern)]


def _cpu_unless_accelerator() -> None:
    """Run JAX on the CPU on a machine with no accelerator (whatever compiler plugins exist),
    with the plugins' start-up lines held back (``zjax.runtime.quiet_plugins``)."""
    if not _accelerators():
        # only a CPU here: the compiler plugins serve compile-only targets (CUDA's would fail
        # its version checks unless JAX runs on the CPU), and libtpu may be loaded by several
        # processes at once (it otherwise refuses a second one with its lockfile)
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from zjax.runtime import quiet_plugins

        quiet_plugins()


def _setup_devices(n: int | None) -> None:
    """Simulate CPU devices when asked, or by default (8) on a machine with no accelerator.

    Raises:
      ConfigError: ``n`` is more than :data:`MAX_SIMULATED_DEVICES`.
    """
    import jax

    if n is not None and n > MAX_SIMULATED_DEVICES:
        raise ConfigError(
            f"--devices: {n} is more CPU devices than zjax simulates (at most "
            f"{MAX_SIMULATED_DEVICES}: each costs memory and threads, and starting "
            f"{n} takes minutes); for a large accelerator count, plan against a compile-only "
            "target instead, e.g. `zjax plan --target h100:64x8` or `--target v5p:8x8x8`")
    if n is None:
        if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
            return
        if os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu") or _accelerators():
            return
    from zjax.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(n or 8)
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")


def _train(args) -> int:
    from zjax.config import load_config

    path, overrides = _split(args.config, args.overrides)
    config = load_config(path, overrides)  # validate before jax starts
    _setup_devices(args.devices)
    from zjax.runtime.distributed import detect, initialize
    from zjax.training.trainer import train

    initialize(config.mesh.distributed, detect(coordinator=args.coordinator,
                                               num_processes=args.num_processes,
                                               process_id=args.process_id),
               timeout_s=config.mesh.init_timeout_s)
    if args.deepspeed:  # its batch sizes are per GPU: known once every process has joined
        import jax

        from zjax.cli._tools import with_deepspeed

        config, ignored = with_deepspeed(args.deepspeed, path, overrides, jax.device_count())
        for line in ignored:
            logging.getLogger("zjax").info("%s", line)

    result = train(None, config, run_dir=args.run_dir)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    logging.getLogger("zjax").info("done: loss %.4f -> %.4f", first, last)
    return 0


def _config_show(args) -> int:
    import yaml

    from zjax.config import load_config

    path, overrides = _split(args.config, args.overrides)
    print(yaml.safe_dump(load_config(path, overrides).to_dict(), sort_keys=False), end="")
    return 0


def _launch(args) -> int:
    from zjax.runtime.launch import launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return launch(command, processes=args.processes,
                      devices_per_process=args.devices_per_process, port=args.port)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _export(args) -> int:
    if args.max_shard_size is not None and args.format != "hf":
        raise ConfigError(f"--max-shard-size: only --format hf splits its weights into "
                          f"files of at most a size; --format {args.format!r} writes them "
                          "whole (drop --max-shard-size, or use --format hf)")
    from zjax.export import export

    print(export(args.run_dir, args.out, dtype=args.dtype, format=args.format,
                 max_shard_bytes=args.max_shard_size))
    return 0


def _plot(args) -> int:
    from zjax.cli.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


# commands whose stdout is their result (text, JSON, YAML, paths a script reads): their log
# lines go to stderr. train, tokenize, import-hf and launch print a report, which is their log
RESULT_ON_STDOUT = frozenset({"sample", "plan", "config", "export", "plot"})


class _LogHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` (``sys.stderr``) of the moment, not of the first CLI call: a
    caller that redirected it then (a test's capture) may have closed that stream since."""

    def __init__(self):
        logging.Handler.__init__(self)
        self.to = "stdout"

    @property
    def stream(self):
        return getattr(sys, self.to)


def _setup_logging(command: str | None = None) -> None:
    """The "zjax" logger's one handler, on stderr for a command in :data:`RESULT_ON_STDOUT`
    (its stdout holds only its result), else on stdout."""
    # our own handler: libraries imported on the way (absl, grain) may configure the root logger
    logger = logging.getLogger("zjax")
    handler = next((h for h in logger.handlers if getattr(h, "_zjax_cli", False)), None)
    if handler is None:
        handler = _LogHandler()
        rank = os.environ.get(ENV["process_id"]) or os.environ.get("SLURM_PROCID")
        handler.setFormatter(logging.Formatter(f"[process {rank}] %(message)s" if rank
                                               else "%(message)s"))
        handler._zjax_cli = True
        logger.addHandler(handler)
    handler.to = "stderr" if command in RESULT_ON_STDOUT else "stdout"
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _interrupted(signum, frame) -> None:
    write_stderr("zjax: interrupted\n")  # the real stderr, even while the plugins' is held
    sys.stdout.flush()
    os._exit(130)  # see main()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zjax`` console script.

    Exit codes: 0 done, 1 training failed (a non-finite step), 2 bad input, 128 + N stopped by
    signal N after saving a checkpoint, 130 interrupted before training began.
    """
    # until training starts (its loop stops at a step and saves it), Ctrl-C ends the process at
    # once: there is nothing to save, and libraries being imported or compiling may swallow a
    # KeyboardInterrupt
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _interrupted) if main_thread else None
    try:
        return _main(argv)
    except KeyboardInterrupt:  # a second Ctrl-C while a stop is saving
        print("zjax: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # not sys.exit: XLA may still be compiling in its own threads, and tearing the
        # interpreter down under them crashes (SIGSEGV). Nothing is left half-written: zjax
        # writes files under a temporary name and renames them (checkpoints, config.yaml,
        # exports), or appends whole lines (metrics.jsonl, whose torn last line is dropped).
        os._exit(130)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> int:
    # a user's own modules (loop: module:Class, rl.rewards: [module:function]) import from
    # the working directory, as under `python -m zjax` (the console script's path lacks it)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides after an option (`plan CONFIG --target T a.b=1`) are still overrides
    if extra and all("=" in x and not x.startswith("-") for x in extra) and hasattr(
            args, "overrides") and args.command != "launch":
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.command)
    if args.command not in ("plot", "launch"):  # the others start JAX
        _cpu_unless_accelerator()
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "export":
            return _export(args)
        if args.command == "plan":
            from zjax.cli._plan import run_plan

            return run_plan(args, *_split(args.config, args.overrides), _setup_devices)
        if args.command == "launch":
            return _launch(args)
        if args.command in ("tokenize", "import-hf", "sample"):
            from zjax.cli._tools import run_tool

            return run_tool(args)
        if args.action == "from-deepspeed":
            from zjax.cli._tools import config_from_deepspeed

            return config_from_deepspeed(args.ds_config, *_split(args.config, args.overrides),
                                         devices=args.devices, output=args.output)
        return _config_show(args)
    except Preempted as e:
        print(f"zjax: {e}", file=sys.stderr)
        return 128 + e.signum
    except NonFiniteError as e:
        print(f"zjax: error: {e}", file=sys.stderr)
        return 1
    except ZjaxError as e:
        print(f"zjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
