"""``zjax export`` and ``zjax sample`` against a run that rotates its checkpoints away while
they are read (``checkpoint.every=1 checkpoint.keep=1``): every export either succeeds with a
loadable result or says it found no finished checkpoint; none calls a deleted checkpoint
damaged, and nothing is moved aside. (A file of its own: it trains for tens of seconds.)"""

from __future__ import annotations

import logging
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import start_zjax

from zjax.errors import CheckpointError
from zjax.export import _pin as pin
from zjax.export import export, read_params

pytestmark = pytest.mark.slow  # races a training run

RUN = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=2",
       "data.seq_len=32", "data.batch_size=8", "train.steps=30", "train.log_every=10",
       "train.eval_every=0", "logging.tensorboard=false", "logging.progress=false",
       "checkpoint.every=1", "checkpoint.keep=1", "zero.stage=0"]


def _race(run, read, *, min_reads: int = 5) -> tuple[int, int, int]:
    """``read(i)`` in a loop until the training run ends and ``min_reads`` have succeeded
    (a read racing a rotation may find no finished checkpoint, a legitimate answer: those do
    not count): ``(succeeded, found none, reads begun while it trained)``."""
    ok = none = racing = 0
    proc = start_zjax("train", "configs/tiny.yaml", *RUN, "--run-dir", str(run))
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints").is_dir() or not any(
                p.name.isdigit() for p in (run / "checkpoints").iterdir()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        i = 0
        while proc.poll() is None or ok < min_reads:
            racing += proc.poll() is None
            try:
                read(i)
                ok += 1
            except CheckpointError as e:
                assert "found no finished checkpoint" in str(e), e
                none += 1
            i += 1
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return ok, none, racing


def _assert_untouched(run, caplog) -> None:
    assert "damaged" not in caplog.text
    assert not [p for p in run.rglob("*") if "damaged" in p.name]


def test_exports_racing_a_keep_1_run_never_call_a_checkpoint_damaged(tmp_path, caplog,
                                                                      monkeypatch):
    """One run, three readers in turn: an export pinned by hard links (the output beside the
    run: it always succeeds), ``zjax sample``'s read (no output directory: read in place), and
    an export where hard links do not work (another filesystem: read in place). A read in
    place whose checkpoint is rotated away reads the run's newest again."""
    # subprocess: the run trains in a process of its own while this one exports (see _race)
    run = tmp_path / "run"
    pinned_outs, steps = [], []

    def read(i):
        if i % 3 == 0:
            out = tmp_path / f"export-{i}"
            try:
                export(run, out, dtype="float32")
            except CheckpointError as e:  # pinned: never "found no finished checkpoint"
                raise AssertionError(f"a pinned export failed: {e}") from e
            pinned_outs.append(out)
        elif i % 3 == 1:
            step, params = read_params(run)
            steps.append(step)
            assert params["embed"].shape == (256, 64)
        else:
            with monkeypatch.context() as m:
                m.setattr(pin, "_links_work", lambda step, tmp: False)
                export(run, tmp_path / f"export-{i}", dtype="float32")

    with caplog.at_level(logging.INFO, logger="zjax"):
        ok, none, racing = _race(run, read, min_reads=9)
    _assert_untouched(run, caplog)
    assert len(pinned_outs) >= 3 and ok >= 9 and racing >= 3, (ok, none, racing, steps)
    for out in set(tmp_path.glob("export-*")):  # each one whole
        params = ocp.StandardCheckpointer().restore(out)
        assert params["embed"].shape == (256, 64) and np.isfinite(params["embed"]).all()
    assert not list(tmp_path.glob(".zjax-pinned-*"))


def test_a_killed_readers_pin_is_removed_by_the_next(tmp_path):
    """A pin left by a dead process (it holds a deleted checkpoint's files) is removed; one
    of a live process is not."""
    # subprocess: only to get the id of a process that has ended
    import os
    import socket
    import subprocess
    import sys

    from zjax.export._pin import pinned

    step = tmp_path / "run" / "checkpoints" / "3"
    (step / "state").mkdir(parents=True)
    (step / "commit_success.txt").write_text("ok")
    (step / "state" / "data").write_bytes(b"x" * 100)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    left = tmp_path / f".zjax-pinned-{host}-{dead}-3-abc"
    live = tmp_path / f".zjax-pinned-{host}-{os.getppid()}-3-def"
    left.mkdir()
    live.mkdir()
    with pinned(step / "state", tmp_path, frozenset()) as path:
        assert (path / "data").read_bytes() == b"x" * 100 and path.parent != step
    assert not left.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "run"]
