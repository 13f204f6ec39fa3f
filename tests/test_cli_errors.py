"""Bad CLI input is one line, ``zjax: error: ...``, exit 2; export reads a run and changes nothing.

Covers issue 14's export, plot, launch, plan and ``--devices`` bullets. In-process (``zjax_main``,
``cli.main``) but for two subprocesses: a fresh interpreter's exit status, and a refusal that must
come before a fresh process starts its devices.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT, cli_env, run_zjax, zjax_main

import zjax
from zjax import cli
from zjax.checkpoint import _leaf_io as export_io
from zjax.cli.plot import plot_run
from zjax.config import load_config
from zjax.export import export
from zjax.planning import Candidate
from zjax.planning import search as _autotune

RUN = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
       "data.seq_len=16", "data.batch_size=8", "train.steps=2", "train.log_every=1",
       "train.eval_every=0", "logging.tensorboard=false", "checkpoint.every=1",
       "checkpoint.asynchronous=false", "zero.stage=0"]


def _zjax(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``zjax ARGS`` in this process, from ``cwd``."""
    return zjax_main(*args, cwd=cwd)


def _zjax_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``zjax ARGS`` in a fresh interpreter (a fresh shell's environment, on the CPU)."""
    return run_zjax(*args, timeout=timeout, env=cli_env(JAX_PLATFORMS="cpu"))


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    # the CUDA plugin's C++ log lines (I0000 ... cudart_stub) may come first: not zjax's
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("zjax")]
    assert len(lines) == 1 and lines[0].startswith("zjax: error: "), r.stderr[-2000:]
    assert r.stderr.strip().endswith(lines[0]) and "\n" not in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _listing(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``root``: size, mtime and content hash (files)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, digest)
    return out


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    return {k: np.frombuffer(data[m["data_offsets"][0]:m["data_offsets"][1]], np.float32)
            .reshape(m["shape"]) for k, m in header.items()}


def _stored_params(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    import jax

    state = (run_dir / "checkpoints" / str(step) / "state").resolve()
    tree = ocp.PyTreeCheckpointer().restore(state)["params"]
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _truncate_data(run_dir: Path, step: int) -> None:
    """Damage checkpoint ``step``: cut every array data file short (a torn copy)."""
    data = [f for f in (run_dir / "checkpoints" / str(step) / "state").rglob("*")
            if f.is_file() and f.parent.name == "d"]  # OCDBT's data files, wherever merged
    assert data
    for f in data:
        os.truncate(f, f.stat().st_size // 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step run with checkpoints at steps 1 and 2 (about 10 s)."""
    root = tmp_path_factory.mktemp("cli-errors")
    tokens = root / "tokens.npy"
    np.save(tokens, (np.arange(4096) % 256).astype(np.int32))
    zjax.train("lm", load_config(ROOT / "configs/tiny.yaml", [*RUN, f"data.path={tokens}"]),
               run_dir=root / "run")
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["1", "2"]
    return root / "run"


@pytest.fixture
def warnings_():
    """The zjax logger's warnings (a handler of its own: the CLI may stop propagation)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("zjax")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ---- export ----------------------------------------------------------------------------------

def test_export_relative_run_dir(run, tmp_path):
    r = _zjax("export", run.name, str(tmp_path / "rel.safetensors"), "--format",
              "safetensors", "--dtype", "float32", cwd=run.parent)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    got = _safetensors(tmp_path / "rel.safetensors")
    want = _stored_params(run, 2)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_export_falls_back_past_a_damaged_checkpoint_and_moves_nothing(run, tmp_path, warnings_):
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged)
    _truncate_data(damaged, 2)
    before = _listing(damaged)
    out = export(damaged, tmp_path / "x.safetensors", dtype="float32", format="safetensors")
    assert _listing(damaged) == before  # nothing moved, renamed or written in the run
    assert any("step 2" in w and "damaged" in w and "falling back to step 1" in w
               for w in warnings_), warnings_
    got, want = _safetensors(out), _stored_params(run, 1)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # every checkpoint damaged: a clear refusal, nothing written
    _truncate_data(damaged, 1)
    with pytest.raises(zjax.CheckpointError, match=r"no intact checkpoint.*all 2 are damaged"):
        export(damaged, tmp_path / "y")
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob(".y*"))


def test_export_checks_checksums_and_surfaces_what_is_not_damage(run, tmp_path, monkeypatch,
                                                                 warnings_):
    flipped = tmp_path / "run"
    shutil.copytree(run, flipped)
    # step 2's arrays replaced by step 1's: readable, but not the values step 2 recorded (bit
    # flips in the zstd-compressed chunks may instead fail to decompress, depending on the layout)
    shutil.rmtree(flipped / "checkpoints" / "2" / "state")
    shutil.copytree(run / "checkpoints" / "1" / "state", flipped / "checkpoints" / "2" / "state")
    out = export(flipped, tmp_path / "v.safetensors", dtype="float32", format="safetensors")
    assert any("step 2" in w and "checksum mismatch" in w and "falling back to step 1" in w
               for w in warnings_), warnings_
    got, want = _safetensors(out), _stored_params(run, 1)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])

    # an error that is not about the checkpoint's data is a bug: it surfaces, no fallback
    def broken(state_dir, keys, leaf):
        raise TypeError("a bug")

    monkeypatch.setattr(export_io, "_verify_leaf", broken)
    with pytest.raises(TypeError, match="a bug"):
        export(run, tmp_path / "w.safetensors", dtype="float32", format="safetensors")


def test_export_output_parent_missing_or_unwritable(tmp_path):
    # checked before the run is even read (tmp_path holds no checkpoint)
    r = _zjax("export", str(tmp_path), str(tmp_path / "missing" / "out"))
    _one_error_line(r, str(tmp_path / "missing"), "does not exist")
    (tmp_path / "file").write_text("")
    with pytest.raises(zjax.CheckpointError, match=r"'.*file' is not a directory"):
        export(tmp_path, tmp_path / "file" / "out")


# ---- plot ------------------------------------------------------------------------------------

def test_plot_skips_rows_without_loss(tmp_path, warnings_):
    rows = [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0}, {"step": 2, "lr": 0.1},
            {"step": 3, "loss": 1.5}, {"step": "x", "loss": 1.0}, {"step": 4, "eval_loss": 1.7}]
    torn = '{"step": 5, "lo'  # killed mid-write: read_metrics skips it
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    paths = plot_run(tmp_path, tmp_path / "png")
    assert [p.name for p in paths] == ["loss.png", "throughput.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert any("2 of 5 rows" in w for w in warnings_), warnings_
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "acc": 0.5}\n')
    with pytest.raises(zjax.ConfigError, match=r"metrics\.jsonl.*'loss'"):
        plot_run(tmp_path)


def test_plot_unwritable_out(tmp_path, capsys, cli_logging):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "png"
    assert cli.main(["plot", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zjax: error: --out:") and str(out) in err[0]


# ---- launch, plan, --devices -----------------------------------------------------------------

def test_launch_nonexistent_command():
    _one_error_line(_zjax("launch", "-n", "2", "--", "zjax-no-such-command"),
                    "'zjax-no-such-command'", "not an executable")


def test_launch_bounds_the_process_count(capsys, cli_logging):
    assert cli.main(["launch", "-n", "100000", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zjax: error: -n: 100000 processes"), err


def test_plan_devices_beyond_simulation_limit():
    # subprocess: the refusal must come before a fresh process starts its devices (100000
    # would take minutes); in this process the 8 devices are up before the CLI runs
    start = time.monotonic()
    _one_error_line(_zjax_process("plan", "--devices", "100000"), "--devices: 100000", "4096",
                    "--target")
    assert time.monotonic() - start < 60


def test_train_devices_0_exits_2():
    # subprocess: `python -m zjax` end to end: the interpreter's exit status 2 and a stderr
    # of the one line in a fresh process (the cases above and below run in-process)
    _one_error_line(_zjax_process("train", "--devices", "0"), "--devices: must be >= 1, got 0")


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "--devices", "0"], "argument --devices: must be >= 1, got 0"),
    (["plan", "--devices", "-3"], "argument --devices: must be >= 1, got -3"),
    (["train", "--devices", "two"], "argument --devices: expected an integer >= 1, got 'two'"),
    (["launch", "-n", "0", "--", "true"], "argument -n/--processes: must be >= 1, got 0"),
    (["launch", "-n", "2", "--devices-per-process", "0", "--", "true"],
     "argument --devices-per-process: must be >= 1, got 0"),
])
def test_counts_must_be_at_least_one(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"zjax: error: {needle} (see `zjax {argv[0]}")


# ---- plan --budget progress ------------------------------------------------------------------

class _Report:
    def __init__(self, total: int, wire: int):
        self.per_device = {"total_bytes": total, "host_bytes": 0}
        self.collectives = {"wire_bytes": wire}

    def fits(self, budget: int) -> bool:
        return self.per_device["total_bytes"] <= budget


def _fake_compile(config) -> _Report:
    z, m = config.zero, config.mesh.model
    if z.stage == 0 and m == 4:
        raise zjax.ConfigError("mesh.model: 4 not buildable here")
    total = 1000 - 200 * z.stage - 50 * config.train.grad_accum + 10 * (z.prefetch_layers or 0)
    return _Report(total * m, (4 - z.stage) * 100 + 7 * config.train.grad_accum + m)


def test_budget_search_reports_each_candidate_and_keeps_its_result():
    config = load_config(None, ["data.batch_size=16"])
    calls: list = []

    def compile_report(cfg):
        calls.append(cfg)
        return _fake_compile(cfg)

    kw = dict(compile_report=compile_report, n_devices=8, budget_bytes=700)
    quiet = _autotune(config, **kw)
    lines: list[str] = []
    calls.clear()
    loud = _autotune(config, **kw, progress=lines.append)
    figures = lambda rows: [(c, r.per_device, r.collectives) for c, r in rows]
    assert loud.config == quiet.config and figures(loud.rows) == figures(quiet.rows)
    assert lines[0].startswith("searching ")
    total = int(lines[0].split()[1])
    steps = lines[1:]
    assert len(steps) == len(calls) < total  # one line per candidate compiled
    assert steps[0].startswith(f"[1/{total}] model ") and " per device, " in steps[0]
    assert any("cannot be built (mesh.model: 4" in s for s in steps)
    assert all(isinstance(c, Candidate) for c, _ in loud.rows)


def test_plan_budget_prints_progress_to_stderr(monkeypatch, capsys, cli_logging):
    import zjax.planning as planner

    class Result:
        budget_bytes, rows, config = 1, [], None
        report = type("R", (), {"table": lambda self: "best"})()

        def table(self):
            return "table"

    def autotune(config, *, budget, devices, target, progress):
        progress("[1/3] model 1 stage 3: 1 KiB per device, fits (0.1 s)")
        return Result()

    monkeypatch.setattr(planner, "autotune", autotune)
    assert cli.main(["plan", "--budget", "80GB"]) == 0
    out = capsys.readouterr()
    assert out.err == "zjax plan: [1/3] model 1 stage 3: 1 KiB per device, fits (0.1 s)\n"
    assert out.out == "table\nbest\n"


# ---- hostile values: sample, export --max-shard-size (issue 31) -------------------------------

def _refused(capsys, argv: list[str], *needles: str) -> str:
    """``zjax ARGV`` in-process: exit 2 and one line ``zjax: error: ...`` on stderr, nothing
    else (argparse's refusals end in SystemExit(2))."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zjax: error: "), err[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("args", "needles"), [
    (["--seed", str(2**70)], ["--seed: 1180591620717411303424", "[0, 4294967296)"]),
    (["--seed", str(-2**70)], ["--seed: -1180591620717411303424", "[0, 4294967296)"]),
    (["--seed", str(2**32)], ["--seed: 4294967296", "[0, 4294967296)"]),
    (["--seed", "-1"], ["--seed: -1", "[0, 4294967296)"]),
    (["--temperature", "inf"], ["--temperature: inf", "finite"]),
    (["--temperature", "nan"], ["--temperature: nan", "finite"]),
    (["--top-p", "nan"], ["--top-p: nan", "(0, 1]"]),
])
def test_sample_refuses_seeds_and_numbers_it_cannot_use(run, args, needles, capsys,
                                                        cli_logging):
    before = _listing(run)
    _refused(capsys, ["sample", str(run), "--prompt", "def ", "--max-new-tokens", "2", *args],
             *needles)
    assert _listing(run) == before


def test_sample_refuses_a_prompt_that_is_not_utf8(run, capsys, cli_logging):
    before = _listing(run)
    prompt = os.fsdecode(b"caf\xff")  # what bytes not UTF-8 in argv decode into: 'caf\udcff'
    _refused(capsys, ["sample", str(run), "--prompt", prompt], "--prompt:", "not valid UTF-8",
             "0xff")
    assert _listing(run) == before


@pytest.mark.parametrize("fmt", ["orbax", "safetensors"])
def test_export_refuses_max_shard_size_outside_hf(run, tmp_path, fmt, capsys, cli_logging):
    before = _listing(run)
    out = tmp_path / "out"
    _refused(capsys, ["export", str(run), str(out), "--format", fmt, "--max-shard-size", "1GB"],
             "--max-shard-size", "--format hf", repr(fmt))
    assert _listing(run) == before and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("text", "n"), [
    ("1B", 1), ("500B", 500), ("1b", 1), ("500b", 500), ("7", 7), ("1e3", 1000),
    ("1.5GB", 1_500_000_000), ("2GiB", 2 * 2**30), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6),
    ("1.5KiB", 1536), ("2.5e3KB", 2_500_000), (" 5 GB ", 5 * 10**9)])
def test_parse_size_reads_sizes(text, n):
    from zjax.cli._tools import parse_size

    assert parse_size(text) == n


@pytest.mark.parametrize(("text", "needle"), [
    ("inf", "is not a size"), ("infGB", "is not a size"), ("nan", "is not a size"),
    ("1e400", "is not a finite size"), ("garbage", "is not a size"), ("GB", "is not a size"),
    ("", "is not a size"), ("1G", "is not a size"), ("5XB", "is not a size"),
    ("0", "must be at least 1 byte"), ("0B", "must be at least 1 byte"),
    ("-1GB", "must be at least 1 byte"), ("0.0001KB", "must be at least 1 byte"),
    ("1.5B", "whole number of bytes")])
def test_parse_size_refuses_what_is_no_size(text, needle, tmp_path, capsys, cli_logging):
    import argparse

    from zjax.cli._tools import parse_size

    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(needle)):
        parse_size(text)
    line = _refused(capsys, ["export", str(tmp_path), str(tmp_path / "out"), "--format", "hf",
                             f"--max-shard-size={text}"], "--max-shard-size", needle)
    assert "Traceback" not in line and list(tmp_path.iterdir()) == []
