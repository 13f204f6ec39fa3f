"""XLA:CPU's fusion emitters in the suite (docs/testing.md, "Compile time").

The suite compiles its CPU steps with XLA:CPU's older fusion emitters
(``--xla_cpu_use_fusion_emitters=false``, set by conftest): most of a cold run is XLA:CPU
compiling thousands of distinct small steps, and these compile them about 2.5 times faster.
A test marked ``default_emitters`` runs in a child pytest under the compiler's default
emitters instead, the flag turned back on: the context-parallel ring step of the any-model
transform aborts its process under the older ones (jaxlib 0.10.2, XLA:CPU's in-process
collectives: "Id can't be larger than number of participating threads").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OLDER = "--xla_cpu_use_fusion_emitters=false"
DEFAULT = "--xla_cpu_use_fusion_emitters=true"
MARK = "default_emitters"


def with_older_emitters(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the older emitters, unless it names them."""
    if "xla_cpu_use_fusion_emitters" in flags:
        return flags  # the caller's choice, e.g. a default_emitters child
    return f"{flags} {OLDER}".strip()


def runs_elsewhere(item: pytest.Item) -> bool:
    """Whether ``item`` must run under the default emitters and this process has the older."""
    return (item.get_closest_marker(MARK) is not None
            and OLDER in os.environ.get("XLA_FLAGS", ""))


def run_under_default_emitters(item: pytest.Item) -> None:
    """Run ``item`` alone in a child pytest whose XLA:CPU uses its default fusion emitters
    (same cache, same device count); fail with the child's report if it fails."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(OLDER, DEFAULT)
    env.pop("PYTEST_XDIST_WORKER", None)
    root = Path(str(item.config.rootpath))
    # subprocess: XLA_FLAGS are read once per process; this test needs other ones
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         "--no-header", item.nodeid],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"under XLA:CPU's default fusion emitters (a child pytest, exit "
                    f"{result.returncode}):\n{(result.stdout + result.stderr)[-6000:]}",
                    pytrace=False)
