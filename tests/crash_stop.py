"""A dead pytest-xdist worker ends the run: its test reported as failed by name, the test not
run again, the other workers stopping after the test they are in, and a non-zero exit.

pytest-xdist replaces a crashed worker up to 8 times by default (``--max-worker-restart``),
and under ``--dist loadfile`` the dead worker's file, the crashing test included, goes back
to the queue: a test that aborts its process ran 9 times (89 s) before the run gave up, and
twice the controller never handed the requeued file out again, leaving CI idle until its
90-minute limit (docs/testing.md). Here no worker is replaced (``--max-worker-restart 0``,
set by conftest unless the command line sets it), and the controller writes a stop file that
every worker reads after each test (``session.shouldstop``: the worker's loop ends there,
and xdist's controller ends the run as interrupted, exit code 2), so the run ends as soon as
the tests in flight do, not after the other workers' whole files.

The report says where it died: each worker writes Python's fatal-error dump (``faulthandler``:
every thread's stack, the crashing one first) to a file of its own beside the stop file, and
the controller puts that dump in the crashed test's report, in the FAILURES section that ends
the run's output (on stderr, a worker's dump was cut off by the lines after it). A worker
killed outright (SIGKILL, the OOM killer) leaves no dump; its report names the test alone.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile

import pytest

__all__ = ["CrashStop", "crash_report", "dump_path"]

_KEY = "zjax_crash_stop_file"
_DUMP_CHARS = 12_000  # the crashing thread comes first; the oldest threads are cut


def dump_path(stop_file: str, worker: str) -> str:
    """Where worker ``worker`` (``gw0``...) writes its fatal-error dump."""
    return os.path.join(os.path.dirname(stop_file), f"fault-{worker}.txt")


def crash_report(message: str, dump: str) -> str:
    """xdist's crash ``message`` with the worker's fatal-error ``dump`` (faulthandler's text:
    the signal, then each thread's stack), without the list of extension modules."""
    lines = [line for line in dump.splitlines() if not line.startswith("Extension modules:")]
    text = "\n".join(lines).strip()
    if not text:
        return message
    if len(text) > _DUMP_CHARS:
        text = text[:_DUMP_CHARS] + "\n  ... (the other threads' stacks cut)"
    return f"{message}\n\nwhere it died (Python's fatal-error dump, the crashing thread " \
           f"first):\n{text}"


class CrashStop:
    """The plugin: the controller's side (the stop file, written on a crash) and the
    workers' side (read after each test)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.session: pytest.Session | None = None
        worker = getattr(config, "workerinput", None)
        self.own_dir = None
        self.dump = None
        if worker is None:  # the controller (or a run without workers)
            self.own_dir = tempfile.mkdtemp(prefix="zjax-crash-stop-")
            self.path = os.path.join(self.own_dir, "stop")
        else:
            self.path = worker.get(_KEY)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        node.workerinput[_KEY] = self.path

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report, sched) -> None:
        with open(self.path, "w") as f:
            f.write(crashitem)
        node = getattr(report, "node", None)  # xdist's WorkerController
        worker = getattr(getattr(node, "gateway", None), "id", None)
        if worker is not None:
            try:
                with open(dump_path(self.path, worker), errors="replace") as f:
                    report.longrepr = crash_report(str(report.longrepr), f.read())
            except OSError:  # killed outright: no dump
                pass

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session
        worker = getattr(self.config, "workerinput", {}).get("workerid")
        if worker is not None and self.path:
            # after pytest's own faulthandler set-up (stderr): one file at a time, and this
            # one reaches the report; kept open for the signal handler
            self.dump = open(dump_path(self.path, worker), "w")  # noqa: SIM115
            faulthandler.enable(file=self.dump, all_threads=True)

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        if self.session is not None and self.path and os.path.exists(self.path):
            with open(self.path) as f:
                crashed = f.read()
            self.session.shouldstop = (f"a worker crashed while running {crashed}: the run "
                                       "stops (no worker is replaced)")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.dump is not None:
            faulthandler.disable()
            self.dump.close()
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)


def no_worker_replacement(config: pytest.Config) -> None:
    """On the controller of an xdist run: no worker replaced unless the command line asks
    (``--max-worker-restart``). Called from ``pytest_cmdline_main``, before xdist's
    ``pytest_configure`` reads the option."""
    if getattr(config.option, "maxworkerrestart", "unset") is None:
        config.option.maxworkerrestart = "0"


def install(config: pytest.Config) -> None:
    """Register the plugin (``pytest_configure``)."""
    config.pluginmanager.register(CrashStop(config), "zjax-crash-stop")
