"""Peak resident memory of one call in a fresh process: VmHWM (per address space, so it starts
afresh in the child) read before the call, with the imports done, and after it. The method of
``export_memory.py`` and ``hf_memory.py``."""

from __future__ import annotations

import os
import subprocess
import sys

_HWM = '''
def hwm_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
'''


def peak_rss(imports: str, call: str, args: list[str]) -> tuple[int, int]:
    """``(baseline bytes, bytes above it)`` of ``call`` (Python source reading ``sys.argv``)
    after ``imports``, run on the CPU in a fresh interpreter with ``args``."""
    code = f"import sys\n{_HWM}\n{imports}\nbefore = hwm_kb()\n{call}\nprint(before, hwm_kb())\n"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, check=True)
    before_kb, peak_kb = map(int, r.stdout.split()[-2:])
    return before_kb * 1024, (peak_kb - before_kb) * 1024
