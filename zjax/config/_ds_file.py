"""A DeepSpeed ``ds_config.json`` read as DeepSpeed reads it.

DeepSpeed parses its config with ``hjson.load(f, object_pairs_hook=...)`` that raises on a
duplicated key (``deepspeed/runtime/config.py``), so real configs may carry ``//``, ``#`` and
``/* */`` comments and trailing commas: zjax reads them with hjson too. A key given twice, at
any depth, is refused naming its path (not "the last one wins"). Every file hjson cannot read,
and every file that is not one JSON object (empty, binary, a list, a number, text), is one
ConfigError naming the file, and the line and column where hjson gives them.

hjson reads a word that is not JSON (``NaN``, ``Infinity``) as a quoteless string running to
the end of its line, comma included: ``"a": NaN,`` is the string ``'NaN,'``, which the mapping
(``_deepspeed._number``) refuses as not a finite number; when the rest of the line swallowed
the closing braces, the syntax error here says so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import hjson

from zjax.errors import ConfigError

__all__ = ["read_deepspeed"]

# NaN or Infinity as a JSON value: hjson reads it (and the rest of its line) as text
_NON_FINITE = re.compile(r"[:\[,]\s*[-+]?(NaN|Infinity)\b")
_KINDS = {list: "a list", str: "text", int: "a number", float: "a number", bool: "a boolean",
          type(None): "null"}


def _parse(text: str) -> tuple[object, dict[int, tuple[dict, str]]]:
    """hjson's value of ``text`` and, by ``id`` of each object with a key given twice, the
    object (held, so that no id is reused) and its first such key."""
    duplicated: dict[int, tuple[dict, str]] = {}

    def pairs(items: list[tuple[str, object]]) -> dict:
        obj: dict = {}
        for key, value in items:
            if key in obj and id(obj) not in duplicated:
                duplicated[id(obj)] = (obj, key)
            obj[key] = value
        return obj

    return hjson.loads(text, object_pairs_hook=pairs), duplicated


def _duplicate(node: object, duplicated: dict[int, tuple[dict, str]], path: str = "") -> str:
    """The path (``a.b[0].c``) of a key given twice under ``node``; "" when none is."""
    if isinstance(node, dict):
        if id(node) in duplicated:
            return path + duplicated[id(node)][1]
        children = [(f"{path}{key}.", value) for key, value in node.items()]
    elif isinstance(node, list):
        children = [(f"{path.removesuffix('.')}[{i}].", v) for i, v in enumerate(node)]
    else:
        return ""
    for child_path, child in children:
        if found := _duplicate(child, duplicated, child_path):
            return found
    return ""


def _load(name: str, text: str) -> tuple[object, dict[int, tuple[dict, str]]]:
    """:func:`_parse`, or a ConfigError for what hjson could not read."""
    try:
        return _parse(text)
    except hjson.HjsonDecodeError as e:
        why = f"is not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        if m := _NON_FINITE.search(text):
            line = text.count("\n", 0, m.start(1)) + 1
            why += (f" (line {line} has {m.group(1)}: NaN and Infinity are not JSON numbers, "
                    "and DeepSpeed's hjson reads them as text to the end of the line)")
    except OverflowError:  # hjson makes int(1e400)
        why = "holds a number too large for a float (such as 1e400)"
    except IndexError:  # hjson's scanner runs off the end
        why = "ends inside a /* comment or a ''' string"
    except RecursionError:
        why = "is nested too deeply"
    except (ValueError, TypeError) as e:  # nothing else hjson raises is known
        why = f"cannot be read by hjson: {e}"
    raise ConfigError(f"{name} {why}") from None


def read_deepspeed(path: str | os.PathLike) -> dict:
    """The JSON object of a DeepSpeed config file, read as DeepSpeed reads it (hjson).

    Raises:
      ConfigError: naming the file, when it cannot be read, is empty, is not UTF-8, is not
        one JSON object (hjson's syntax) or gives a key twice (naming the key's path).
    """
    path = Path(path)
    name = f"--deepspeed: {str(path)!r}"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"--deepspeed: cannot read {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); a DeepSpeed config is JSON") from None
    data, duplicated = _load(name, text)
    if data == {} and "{" not in text:  # hjson reads nothing, or only comments, as {}
        raise ConfigError(f"{name} is empty (or holds only comments); expected a JSON object "
                          "of DeepSpeed keys")
    if not isinstance(data, dict):
        shown = "" if data is None else f" ({repr(data)[:40]}{'...' * (len(repr(data)) > 40)})"
        raise ConfigError(f"{name} holds {_KINDS.get(type(data), type(data).__name__)}{shown}, "
                          "expected a JSON object of DeepSpeed keys")
    if key := _duplicate(data, duplicated):
        raise ConfigError(f"{name}: key {key} appears more than once; DeepSpeed refuses a "
                          "duplicated key (keep one)")
    return data
