"""The codebase's shape: the config at the bottom of the import graph, no import cycles, small
files. These read the source (ast) or a fresh interpreter's ``sys.modules``; no step compiles."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import defaultdict

import pytest
from helpers import ROOT

from zjax.config import Config, load_config
from zjax.config._loop_name import BUILTIN_LOOPS
from zjax.errors import ConfigError

PACKAGE = ROOT / "zjax"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60  # without the docstring
# the scheduled scan's custom_vjp: forward and backward share the closure that keeps them exact
LONG_FUNCTIONS = {"zjax/partition/schedule.py:scheduled_loop"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the zjax modules it imports anywhere (functions too: a lazy import is still
    an edge; so is each module a package's ``_LAZY`` / ``_EXPORTS`` table loads on first
    use), except under ``if TYPE_CHECKING``."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, tree in modules.items():
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif _lazy_table(node):
                targets = [v.value for v in node.value.values]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _lazy_table(node: ast.AST) -> bool:
    """A package's table of names -> the modules that define them, loaded on first use."""
    return (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(getattr(t, "id", "") in ("_LAZY", "_EXPORTS") for t in node.targets)
            and all(isinstance(v, ast.Constant) for v in node.value.values))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_zjax():
    graph = _import_graph()
    assert graph["zjax.training.trainer"] >= {"zjax.config", "zjax.step"}  # the reader sees edges
    assert _cycles(graph) == []
    # the checker sees one: config -> trainer would close config -> ... -> trainer -> config
    assert _cycles({**graph, "zjax.config._config": {*graph["zjax.config._config"],
                                                     "zjax.training.trainer"}})


def test_config_is_at_the_bottom_of_the_import_graph():
    """Reading and validating a config loads no engine, Orbax, Grain or Flax."""
    code = ("import sys, json, zjax.config\n"
            "c = zjax.config.load_config('configs/tiny.yaml', ['zero.stage=2'])\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('orbax', 'grain', 'flax', 'zjax'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    loaded = json.loads(out.stdout.splitlines()[-1])
    heavy = [m for m in loaded if m.split(".")[0] in ("orbax", "grain", "flax")]
    assert heavy == []
    engine = {"zjax.step", "zjax.training", "zjax.training.trainer", "zjax.task", "zjax.hf",
              "zjax.checkpoint._checkpointer", "zjax.data._pipeline", "zjax.runtime.targets",
              "zjax.models.gpt", "zjax.models.llama", "zjax.models.trainable", "zjax.planning",
              "zjax.export", "zjax.cli"}
    assert engine.isdisjoint(loaded), engine & set(loaded)
    # the sections come from their packages' config modules, whose packages load lazily
    assert {"zjax.config._gin", "zjax.models.config", "zjax.data.config",
            "zjax.checkpoint.config", "zjax.runtime.config"} <= set(loaded)


# zjax's top level: the public entry points and what belongs to no package
TOP_LEVEL = {"__init__.py", "__main__.py", "_lazy.py", "errors.py", "schema.py", "py.typed"}
# the packages, bottom to top: a module imports its own package and the layers below it. A
# package's ``config.py`` is its config section, in the layer under ``zjax.config`` (which
# composes them): it imports only errors, schema and other sections.
LAYERS = [
    ("zjax.errors", "zjax.schema", "zjax._lazy"),
    ("sections",),
    ("zjax.config",),
    ("zjax.runtime",),
    ("zjax.offload",),
    ("zjax.partition",),
    ("zjax.nn",),
    ("zjax.lora",),
    ("zjax.models",),
    ("zjax.preference",),
    ("zjax.rl",),
    ("zjax.generate",),
    ("zjax.step",),
    ("zjax.data",),
    ("zjax.checkpoint",),
    ("zjax.hf",),
    ("zjax.task",),
    ("zjax.planning",),
    ("zjax.training",),
    ("zjax.export",),
    ("zjax.cli",),
    ("zjax",),
]


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 3 and (parts[2] == "config" or re.fullmatch(r"_\w+_config", parts[2])):
        return "sections"  # a package's config section, or a private part of it (_gpt_config)
    return "zjax" if len(parts) == 1 or parts[1] == "__main__" else ".".join(parts[:2])


def _upward(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    out = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            if rank[_layer(target)] > rank[_layer(module)]:
                out.append(f"{module} -> {target}")
    return out


def _private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a private module (``zjax.pkg._name``) from outside its package."""
    out = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            parts = target.split(".")
            private = next((i for i, p in enumerate(parts) if p.startswith("_")
                            and p != "__main__"), None)
            if private is None:
                continue
            owner = ".".join(parts[:private])
            if module != owner and not module.startswith(owner + "."):
                out.append(f"{module} -> {target}")
    return out


def test_packages_import_down_the_layers_only():
    graph = _import_graph()
    assert {_layer(m) for m in _modules()} == {n for names in LAYERS for n in names}
    assert _upward(graph) == []
    # the checker sees one: the step reading checkpoints' tree (as it once did)
    assert _upward({**graph, "zjax.step._nvme_io": {"zjax.checkpoint._tree"}}) == [
        "zjax.step._nvme_io -> zjax.checkpoint._tree"]
    # and a section importing its package's engine
    assert _upward({"zjax.data.config": {"zjax.data._pipeline"}}) == [
        "zjax.data.config -> zjax.data._pipeline"]


def test_no_import_of_another_packages_private_module():
    graph = _import_graph()
    assert _private_imports(graph) == []
    assert _private_imports({"zjax.export._export": {"zjax.hf._safetensors"},
                             "zjax.hf._export": {"zjax.hf._safetensors"}}) == [
        "zjax.export._export -> zjax.hf._safetensors"]


def test_checkpoints_see_the_state_only_through_its_storage():
    """Where the state lives (device, host memory, NVMe swap files) is the step's business:
    the checkpoint package reads ``ZeroStep.storage``, never the NVMe engine."""
    seen = {}
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        seen[path.name] = attrs & {"nvme", "storage"}
    assert all("nvme" not in a for a in seen.values()), seen
    assert "storage" in seen["_checkpointer.py"]


def test_the_top_level_holds_only_the_entry_points():
    top = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top - packages == TOP_LEVEL
    assert {f"zjax.{p}" for p in packages} == {n for names in LAYERS[2:-1] for n in names}
    for package in packages:  # each says what it owns and what it may import
        doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert doc and "import" in doc, package


def test_no_file_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def _long_functions(tree: ast.Module, limit: int) -> dict[str, int]:
    """Top-level name of each function (nested ones under their outermost) -> the length of
    its longest function over ``limit`` lines, docstrings not counted."""
    out = {}

    def length(fn) -> int:
        doc = fn.body[0] if fn.body and isinstance(fn.body[0], ast.Expr) \
            and isinstance(fn.body[0].value, ast.Constant) else None
        skip = doc.end_lineno - doc.lineno + 1 if doc else 0
        return fn.end_lineno - fn.lineno + 1 - skip

    for top in tree.body:
        if not isinstance(top, ast.FunctionDef | ast.ClassDef):
            continue
        for fn in ast.walk(top):
            if isinstance(fn, ast.FunctionDef) and (n := length(fn)) > limit:
                out[top.name] = max(out.get(top.name, 0), n)
    return out


def test_no_function_over_the_size_limit():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, n in _long_functions(ast.parse(path.read_text()), MAX_FUNCTION_LINES).items():
            if f"{rel}:{name}" not in LONG_FUNCTIONS:
                long[f"{rel}:{name}"] = n
    assert long == {}
    # the reader counts: a function of 61 lines is too long, one of 60 is not, a docstring
    # does not count, a nested function counts under the top-level one
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    doc = '    """doc\n\n    more\n    """\n'
    assert _long_functions(ast.parse(f"def f():\n{body}"), 60) == {}
    assert _long_functions(ast.parse(f"def f():\n{body}    y = 0\n"), 60) == {"f": 61}
    assert _long_functions(ast.parse(f"def f():\n{doc}{body}"), 60) == {}
    nested = "".join(f"        x{i} = {i}\n" for i in range(60))
    assert _long_functions(ast.parse(f"class C:\n    def g():\n{nested}"), 60) == {"C": 61}


def test_builtin_loops_name_their_model_config_without_importing_them():
    from zjax.task.loop import resolve_loop

    for name, (_, model_config) in BUILTIN_LOOPS.items():
        assert resolve_loop(name).model_config is model_config


def test_validating_a_config_does_not_instantiate_the_users_loop(tmp_path, monkeypatch):
    (tmp_path / "_zjax_lazy_loop.py").write_text(
        "import dataclasses\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Shape:\n    width: int = 4\n"
        "class Lazy:\n    model_config = Shape\n"
        "    def __init__(self):\n        raise RuntimeError('instantiated')\n"
        "    def trainable(self, model): ...\n    def data(self, data, **kw): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = Config.from_dict({"loop": "_zjax_lazy_loop:Lazy", "model": {"width": 8}})
    assert cfg.model.width == 8
    with pytest.raises(ConfigError, match=r"^model\.width"):
        Config.from_dict({"loop": "_zjax_lazy_loop:Lazy", "model": {"width": "x"}})
    # the trainer is what builds it, and its failure names the key
    from zjax.task.loop import resolve_loop

    with pytest.raises(ConfigError, match=r"loop: .*Lazy'?\(\) failed: instantiated"):
        resolve_loop("_zjax_lazy_loop:Lazy")
    assert load_config(None).loop == "lm"
