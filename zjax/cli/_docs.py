"""The config reference (README) generated from the schema dataclasses."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

__all__ = ["config_reference"]

BEGIN = "<!-- config-reference: `python -m zjax.cli.docs --write README.md` regenerates it -->"
END = "<!-- /config-reference -->"


def _attribute_docs(cls: type) -> dict[str, str]:
    doc = inspect.getdoc(cls) or ""
    m = re.search(r"Attributes:\n(.*?)(?:\n\S|\Z)", doc, re.S)
    out: dict[str, str] = {}
    if not m:
        return out
    current = None
    for line in m.group(1).splitlines():
        item = re.match(r"\s{2}(\w+): (.*)", line)
        if item:
            current = item.group(1)
            out[current] = item.group(2).strip()
        elif current and line.strip():
            out[current] += " " + line.strip()
    return out


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    text = getattr(tp, "__name__", None) or str(tp)
    return text.replace("typing.", "").replace("NoneType", "empty")


def _rows(prefix: str, cls: type) -> list[str]:
    """One table row per field; a nested section's fields get rows of their own."""
    hints = typing.get_type_hints(cls)
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # a subclass documents only the fields it adds
        if dataclasses.is_dataclass(base):
            docs.update(_attribute_docs(base))
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += _rows(f"{prefix}.{f.name}", hints[f.name])
            continue
        default = f.default if f.default is not dataclasses.MISSING else "-"
        allowed = f.metadata.get("choices")
        meaning = docs.get(f.name, "").replace("``", "`")
        if allowed:
            meaning = (meaning + f" One of {', '.join(map(str, allowed))}.").strip()
        bounds = f.metadata.get("bounds")
        if bounds is not None:
            meaning = (meaning + f" Must be {bounds.describe()}.").strip()
        rows.append(f"| `{prefix}.{f.name}` | {_type_name(hints[f.name])} | `{default}` "
                    f"| {meaning} |")
    return rows


def config_reference() -> str:
    """A markdown table per config section: key, type, default, meaning."""
    from zjax.config import BUILTIN_LOOPS, section_types

    sections = section_types()
    lines = [BEGIN, "", "`loop` (top level): `lm` (the built-in GPT loop), `llama` (the "
             "built-in Llama loop) or `package.module:Name` (your `zjax.Loop`).", ""]
    for name, cls in sections.items():
        lines += [f"**`{name}`** ({cls.__name__})", "", "| key | type | default | meaning |",
                  "|---|---|---|---|", *_rows(name, cls), ""]
    for loop, (_, cls) in BUILTIN_LOOPS.items():
        if cls is not sections["model"]:  # the model sections of the other built-in loops
            lines += [f"**`model`** with `loop: {loop}` ({cls.__name__})", "",
                      "| key | type | default | meaning |", "|---|---|---|---|",
                      *_rows("model", cls), ""]
    lines.append(END)
    return "\n".join(lines)
