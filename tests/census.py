"""The suite's census: how many checks the tests make, and how long each test file takes.

``python tests/census.py`` counts the checks in ``tests/`` from the source: ``assert``
statements, calls of ``assert*`` functions (``np.testing.assert_allclose``, the helpers'
``assert_trees_close``...) and ``pytest.raises``/``pytest.warns`` blocks. A change that speeds
the suite up must not lower these counts (nor ``pytest --co -q``'s count of tests).

``python tests/census.py --seconds REPORT.xml`` writes ``tests/test_seconds.json`` from a
JUnit report of a whole run (``pytest --junitxml=REPORT.xml``): each test's seconds, which
conftest adds up per file, over the tests selected, to hand the slowest files to the workers
first (docs/testing.md).
"""

from __future__ import annotations

import ast
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def count_checks(root: Path = TESTS) -> dict[str, int]:
    """The checks written in ``root``'s Python files, by kind, and their total."""
    counts = {"assert": 0, "assert_calls": 0, "raises_warns": 0}
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Assert):
                counts["assert"] += 1
            elif isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("raises", "warns"):
                    counts["raises_warns"] += 1
                elif name.startswith("assert"):
                    counts["assert_calls"] += 1
    counts["total"] = sum(counts.values())
    return counts


def test_seconds(report: Path) -> dict[str, float]:
    """Seconds per test (set-up, call and tear-down) in a JUnit report, by pytest node id."""
    seconds = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
        at = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        node = "/".join(parts[:at + 1]) + ".py"
        seconds["::".join([node, *parts[at + 1:], case.get("name", "")])] = round(
            float(case.get("time", 0)), 2)
    return seconds


def file_seconds(report: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report, the slowest first."""
    files: dict[str, float] = defaultdict(float)
    for node, seconds in test_seconds(report).items():
        files[node.split("::")[0]] += seconds
    return dict(sorted(files.items(), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--seconds"] and len(argv) == 2:
        seconds = dict(sorted(test_seconds(Path(argv[1])).items()))
        (TESTS / "test_seconds.json").write_text(json.dumps(seconds, indent=0) + "\n")
        print(f"{len(seconds)} tests, {sum(seconds.values()):.0f} s in all")
        for name, s in list(file_seconds(Path(argv[1])).items())[:10]:
            print(f"{s:8.1f} s  {name}")
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    counts = count_checks()
    print(", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
