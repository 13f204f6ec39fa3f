"""The compiler plugins' start-up lines on a machine without accelerators.

With ``zjax[targets]`` installed (the CUDA plugin and libtpu, for compile-only targets) and no
GPU or TPU present, loading them writes lines to fd 2 before any logging exists: the CUDA stub's
``cudart_stub.cc:31] Could not find cuda drivers on your machine``, absl's ``WARNING: All log
messages before absl::InitializeLog() is called are written to STDERR`` (measured: three of
each at ``import jax``, one more when JAX registers its plugins), and libtpu's ``Failed to find
host bounds`` / ``unexpected worker hostname``. None is an error: the plugins stay usable for
``--target``. Python's logging and environment variables (``TF_CPP_MIN_LOG_LEVEL``,
``TPU_MIN_LOG_LEVEL``) do not reach them, so fd 2 is held while they load: those lines go to the
``zjax.runtime`` logger at DEBUG, and every other line is written back to stderr unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["held_stderr", "quiet_plugins", "write_stderr"]

log = logging.getLogger("zjax.runtime")

# the lines the plugins print when they find no device; anything else is shown
_START_UP = re.compile(
    r"cudart_stub\.cc|All log messages before absl::InitializeLog\(\) is called"
    r"|Could not find cuda drivers|Failed to find host bounds|unexpected worker hostname"
    r"|TPU_WORKER_HOSTNAMES|libtpu")
# the real stderr's fd while held_stderr holds fd 2 (innermost last)
_real: list[int] = []


def write_stderr(text: str) -> None:
    """Write ``text`` to the process's stderr, also while :func:`held_stderr` holds fd 2: an
    interrupt's message is written before ``os._exit``, which runs no ``finally``."""
    sys.stderr.flush()
    os.write(_real[-1] if _real else 2, text.encode())


@contextlib.contextmanager
def held_stderr(*, keep: Callable[[str], bool] = lambda line: True) -> Iterator[None]:
    """Hold fd 2 on a temporary file while the block runs (process-wide).

    Afterwards each captured line goes to the ``zjax.runtime`` logger at DEBUG; the lines
    ``keep`` accepts are also written back to fd 2. If the block is stopped by something
    other than an Exception (an interrupt), everything captured is written back.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    _real.append(saved)
    replay_all = False
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        except BaseException as e:
            replay_all = not isinstance(e, Exception)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            _real.remove(saved)
            os.close(saved)
            tmp.seek(0)
            captured = tmp.read()
            if replay_all:
                os.write(2, captured)
            for line in captured.decode(errors="replace").splitlines(keepends=True):
                log.debug("start-up: %s", line.rstrip())
                if not replay_all and keep(line):
                    os.write(2, line.encode())


def quiet_plugins() -> None:
    """Import JAX and register its compiler plugins with their start-up lines held back.

    Call it before anything imports jax, on a machine without accelerators (with one, the
    plugins' lines may matter: do not call it). JAX then runs on the CPU unless
    ``JAX_PLATFORMS`` says otherwise (the CUDA plugin would fail its driver checks). Backends
    are not initialised: CPU devices can still be simulated, a ``jax.distributed`` job joined,
    and compile-only ``--target`` devices still find the plugins.
    """
    with held_stderr(keep=lambda line: not _START_UP.search(line)):
        import jax  # (the plugins' shared libraries load here)
        from jax._src import xla_bridge

        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")

        # the CUDA plugin loads more libraries when JAX registers it (first backend use)
        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:
            register()
