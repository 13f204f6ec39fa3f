"""A command that succeeds on a machine without accelerators prints no compiler-plugin start-up
lines, with the plugins installed (the CUDA stub's ``Could not find cuda drivers``, absl's
pre-init warning, libtpu's host-bound lines); other stderr lines still come through."""

from __future__ import annotations

import importlib.util
import logging
import os
import re

import pytest
from helpers import run_zjax

from zjax.cli._main import _accelerators
from zjax.runtime import held_stderr, write_stderr

PLUGIN_LINE = re.compile(r"(?i)cuda|libtpu|tpu_|InitializeLog|GPU will not be used")


def _plugin_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if PLUGIN_LINE.search(line)]


@pytest.fixture(scope="module", autouse=True)
def _plugins_installed_and_no_accelerator():
    for plugin in ("jax_cuda12_plugin", "libtpu"):  # the README's test install brings both
        assert importlib.util.find_spec(plugin) is not None, plugin
    if _accelerators():
        pytest.skip("an accelerator is present: the plugins' lines are not held back there")


@pytest.mark.slow  # a training run in a fresh process: about 20 s
def test_train_prints_no_plugin_start_up_lines():
    # subprocess: the plugins' start-up lines come at a fresh interpreter's jax import
    r = run_zjax("train", "configs/tiny.yaml", "train.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: loss" in r.stdout
    assert _plugin_lines(r.stderr) == [], r.stderr[-3000:]


@pytest.mark.slow  # a fresh process: the quick loop's time stays as it was
def test_config_show_prints_no_plugin_start_up_lines():
    # subprocess: the plugins' start-up lines come at a fresh interpreter's jax import
    r = run_zjax("config", "show", "configs/tiny.yaml")
    assert r.returncode == 0 and r.stdout.startswith("loop: lm"), r.stderr[-3000:]
    assert r.stderr == ""


def test_held_stderr_drops_only_the_lines_it_is_told_to(capfd):
    """fd-level writes (as the plugins' C++ makes them) are held; kept lines come back."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("zjax.runtime")
    # its own handler only: another test's CLI may leave a handler on a closed stream above
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        with held_stderr(keep=lambda line: "keep" in line):
            os.write(2, b"I0000 cudart_stub.cc:31] Could not find cuda drivers\n")
            os.write(2, b"keep this one\n")
            write_stderr("not held: an interrupt's message\n")  # before os._exit, no finally
            assert capfd.readouterr().err == "not held: an interrupt's message\n"
        assert capfd.readouterr().err == "keep this one\n"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    assert any("cudart_stub" in r.getMessage() for r in records)


def test_the_cli_log_follows_stdout_after_its_first_stream_is_closed(capsys):
    """An in-process CLI call under a capture leaves the "zjax" handler behind; once that capture
    is closed, later messages go to the stdout of the moment instead of a logging traceback."""
    import contextlib
    import io

    from zjax.cli._main import _setup_logging

    first = io.StringIO()
    with contextlib.redirect_stdout(first):
        _setup_logging()
        logging.getLogger("zjax.hf").info("first")
    first.close()
    logging.getLogger("zjax.hf").info("after the close")
    out, err = capsys.readouterr()
    assert "after the close" in out and "Logging error" not in err and "Traceback" not in err, err
