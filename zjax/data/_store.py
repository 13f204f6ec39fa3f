"""Documents as flat arrays: every document's token ids end to end, its loss mask alongside,
and the offsets where each document starts.

Built in memory from a source's rows (training on an untokenized source), or written once to a
directory by ``zjax tokenize`` and memory-mapped from there (a corpus larger than memory):

    OUT/tokens.npy      token ids (uint16 or uint32, by the vocabulary)
    OUT/loss_mask.npy   uint8, 1 where the token is trained on
    OUT/offsets.npy     int64, documents + 1 entries; document i is [offsets[i], offsets[i+1])
    OUT/zjax-tokens.json  what made it (format, tokenizer, counts)

Both are built by the same encoder from the same rows, so they hold the same arrays.

``zjax-tokens.json``'s ``tokenizer_id`` is the identity of the tokenizer that made the ids
(:func:`zjax.data._tokenizer.tokenizer_identity`: the file's and the vocabulary's SHA-256, the
id bound, the EOS, BOS and pad ids; null for byte-level). A flat ``.npy`` of ids (``zjax
tokenize -o OUT.npy``) has the same record beside it, in ``OUT.npy.zjax-tokens.json``.
Training refuses a directory or ``.npy`` made with another tokenizer than ``data.tokenizer``
and a mixture of sources made with two tokenizers, naming both; an output of an older zjax,
which has no record, is read with a warning naming it.

An output is written whole or not at all: it is built beside itself, in a hidden
``.OUT.partial-PID-XXXX`` (directory or file), and renamed. A partial output is removed when
the writer fails or is stopped (SIGINT, SIGTERM); one left by a killed writer (``kill -9``)
is removed by the next write of the same output once its process is gone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from zjax.data._sources import STORE_META, is_partial
from zjax.errors import ConfigError
from zjax.runtime.stop import deferred, stop_point

__all__ = ["Documents", "build_documents", "check_npy_tokenizer", "check_same_tokenizer",
           "check_store_tokenizer", "fill_from", "is_partial", "new_output", "npy_meta_path",
           "partial_path", "read_store", "token_dtype", "write_error", "write_npy_meta",
           "write_store"]

log = logging.getLogger("zjax")

_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Documents:
    """Documents end to end.

    Attributes:
      tokens: int ``[N]`` token ids.
      loss_mask: uint8 ``[N]``.
      offsets: int64 ``[documents + 1]``.
      vocab_size: one past the largest id the tokenizer can produce.
      source: what they came from, for messages.
      meta: how they were made (format, train_on_prompt, tokenizer).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    vocab_size: int
    source: str
    meta: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, start: int, stop: int) -> Documents:
        """Documents ``start..stop`` (the arrays are shared, not copied)."""
        return dataclasses.replace(self, offsets=self.offsets[start:stop + 1])


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def build_documents(docs: Iterable[tuple[np.ndarray, np.ndarray]], *, vocab_size: int,
                    source: str, meta: dict) -> Documents:
    """The documents of ``docs`` (``(ids, mask)`` pairs) in memory."""
    ids, masks, lengths = [], [], [0]
    for i, m in docs:
        ids.append(i)
        masks.append(m)
        lengths.append(len(i))
    if len(ids) == 0:
        raise ConfigError(f"data.path: {source} holds no records")
    tokens = np.concatenate(ids).astype(token_dtype(vocab_size))
    return Documents(tokens, np.concatenate(masks), np.cumsum(lengths, dtype=np.int64),
                     vocab_size, source, meta)


def write_store(out: str | os.PathLike, docs: Iterable[tuple[np.ndarray, np.ndarray]], *,
                vocab_size: int, meta: dict,
                progress: Callable[[int], None] | None = None) -> dict:
    """Write ``docs`` to the directory ``out``, whole or not at all (built beside it and
    renamed). Returns the metadata written (counts included)."""
    out = new_output(out)
    tmp = partial_path(out, directory=True)
    try:
        counts = _spool(tmp, docs, token_dtype(vocab_size), progress)
        meta = {**meta, **counts, "vocab_size": vocab_size, "version": _VERSION}
        (tmp / STORE_META).write_text(json.dumps(meta, indent=1) + "\n")
        stop_point()  # a stop that arrived unseen (zjax.runtime.stop) still leaves nothing
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(out, e) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def write_error(out: Path, e: OSError) -> ConfigError:
    """The one-line error of an output that cannot be written (a full disk, no permission)."""
    return ConfigError(f"-o: cannot write {str(out)!r}: {e.strerror or e}")


def new_output(out: str | os.PathLike) -> Path:
    """``out`` checked: it must not exist, and its parent is made (an error names ``out``)."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ConfigError(f"-o: {str(out)!r} already exists; zjax does not replace it")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"-o: cannot write {str(out)!r}: {str(above)!r} is a file, not a "
                          "directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) from None
    if not out.parent.is_dir():
        raise ConfigError(f"-o: cannot write {str(out)!r}: {str(out.parent)!r} is not a "
                          "directory")
    return out


def partial_path(out: Path, *, directory: bool) -> Path:
    """A new hidden directory (or file) beside ``out`` to build it in, named for this process;
    those of the same output whose process is gone (killed) are removed first."""
    _remove_dead(out)
    made: list[Path] = []
    try:
        with deferred():  # a signal here would lose the name of what mkdtemp made
            prefix = f".{out.name}.partial-{os.getpid()}-"
            if directory:
                made.append(Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent)))
            else:
                fd, name = tempfile.mkstemp(prefix=prefix, dir=out.parent)
                os.close(fd)
                made.append(Path(name))
        _umask_mode(made[0], directory=directory)
    except OSError as e:
        raise write_error(out, e) from None
    except BaseException:
        for p in made:
            _remove(p)
        raise
    return made[0]


def _umask_mode(path: Path, *, directory: bool) -> None:
    """The mode a plain ``open``/``mkdir`` gives (mkstemp and mkdtemp make them private)."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_dead(out: Path) -> None:
    pattern = re.compile(rf"\.{re.escape(out.name)}\.partial-(\d+)-[^/]+")
    try:
        found = list(out.parent.iterdir())
    except OSError:
        return
    for p in found:
        m = pattern.fullmatch(p.name)
        if m and not _alive(int(m.group(1))):
            _remove(p)
            log.info("removed %s, the partial output of an interrupted run", p)


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # a name of an earlier process that had this id
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _spool(tmp: Path, docs, dtype: np.dtype, progress) -> dict:
    """Stream ``docs`` into raw files, then into the three ``.npy`` arrays."""
    n_docs = n_tokens = n_loss = 0
    with (open(tmp / "tokens.raw", "wb") as tok, open(tmp / "mask.raw", "wb") as msk,
          open(tmp / "lengths.raw", "wb") as lens):
        for ids, mask in docs:
            tok.write(ids.astype(dtype).tobytes())
            msk.write(mask.astype(np.uint8).tobytes())
            lens.write(np.int64(len(ids)).tobytes())
            n_docs, n_tokens, n_loss = n_docs + 1, n_tokens + len(ids), n_loss + int(mask.sum())
            if progress is not None:
                progress(1)
    if n_docs == 0:
        raise ConfigError("tokenize: the inputs hold no records")
    _to_npy(tmp / "tokens.raw", tmp / "tokens.npy", dtype, n_tokens)
    _to_npy(tmp / "mask.raw", tmp / "loss_mask.npy", np.dtype(np.uint8), n_tokens)
    lengths = np.fromfile(tmp / "lengths.raw", np.int64)
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    (tmp / "lengths.raw").unlink()
    return {"documents": n_docs, "tokens": n_tokens, "loss_tokens": n_loss,
            "dtype": dtype.name}


def fill_from(raw, arr: np.ndarray) -> None:
    """Fill ``arr`` (a memory-mapped ``.npy``) from the binary file ``raw``, 4M items at a
    time."""
    done, chunk = 0, 1 << 22
    while done < len(arr):
        part = np.frombuffer(raw.read(chunk * arr.dtype.itemsize), dtype=arr.dtype)
        arr[done:done + len(part)] = part
        done += len(part)
    arr.flush()


def _to_npy(raw: Path, out: Path, dtype: np.dtype, n: int) -> None:
    arr = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(n,))
    with open(raw, "rb") as f:
        fill_from(f, arr)
    del arr
    raw.unlink()


def read_store(path: str | os.PathLike) -> Documents:
    """The documents of a ``zjax tokenize`` directory, memory-mapped."""
    path = Path(path)
    try:
        meta = json.loads((path / STORE_META).read_text())
        arrays = [np.load(path / f"{name}.npy", mmap_mode="r")
                  for name in ("tokens", "loss_mask", "offsets")]
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path: {str(path)!r} is not a readable zjax tokenize "
                          f"directory: {e}") from None
    tokens, mask, offsets = arrays
    if len(tokens) != len(mask) or offsets[-1] != len(tokens) or len(offsets) < 2:
        raise ConfigError(f"data.path: {str(path)!r}: tokens.npy, loss_mask.npy and "
                          "offsets.npy disagree (a damaged or partial zjax tokenize output)")
    return Documents(tokens, mask, offsets, int(meta.get("vocab_size", 0)), str(path), meta)


_NPY_META = ".zjax-tokens.json"  # OUT.npy's record, beside it: OUT.npy.zjax-tokens.json
_LEGACY = object()  # an output of an older zjax: no record of its tokenizer


def npy_meta_path(npy: str | os.PathLike) -> Path:
    """Where the record of a ``.npy`` of token ids is: ``OUT.npy.zjax-tokens.json``."""
    return Path(f"{os.fspath(npy)}{_NPY_META}")


def write_npy_meta(npy: Path, meta: dict) -> None:
    """Write the record of ``npy`` (before ``npy`` itself is renamed into place)."""
    path = npy_meta_path(npy)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({**meta, "version": _VERSION}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(npy, e) from None


def _given(data_tokenizer: str, eos_token: str | None = None) -> dict:
    """The identity of ``data.tokenizer`` (its EOS as ``data.eos_token`` or its config say)."""
    from zjax.data._chat import special_token, tokenizer_config
    from zjax.data._tokenizer import load_tokenizer, tokenizer_identity

    tokenizer = load_tokenizer(data_tokenizer)
    eos = eos_token if eos_token is not None else special_token(
        tokenizer_config(data_tokenizer), "eos_token")
    eos_id = None if not eos else tokenizer.token_to_id(eos)
    return tokenizer_identity(tokenizer, data_tokenizer, eos_id=eos_id)


def _refuse_other(where: str, made: dict | None, data_tokenizer: str, given: dict,
                  why: str) -> ConfigError:
    from zjax.data._tokenizer import describe

    return ConfigError(
        f"data.tokenizer: {describe(given)} is not the tokenizer that made {where} "
        f"({describe(made)}): {why}; set data.tokenizer to the one that made it, or "
        f"tokenize again with --tokenizer {data_tokenizer}")


def _check_identity(where: str, made, data_tokenizer: str | None,
                    eos_token: str | None) -> None:
    """Refuse ``made`` (an output's record) unless it is ``data_tokenizer``'s identity."""
    from zjax.data._tokenizer import different_tokenizer

    if made is _LEGACY:
        against = ("the other sources'" if data_tokenizer is None
                   else f"data.tokenizer's ({data_tokenizer})")
        log.warning("%s records no tokenizer (made by an older zjax): whether its ids are %s "
                    "is not checked; tokenize again to record it", where, against)
        return
    if data_tokenizer is None:
        return
    if made is None:
        raise ConfigError(f"data.tokenizer: {data_tokenizer}, but {where} holds byte-level "
                          "ids (made without a tokenizer); drop data.tokenizer or tokenize "
                          "again with it")
    given = _given(data_tokenizer, eos_token)
    why = different_tokenizer(made, given)
    if why is not None:
        raise _refuse_other(where, made, data_tokenizer, given, why)


def check_store_tokenizer(docs: Documents, data_tokenizer: str | None,
                          eos_token: str | None = None) -> None:
    """Refuse a ``zjax tokenize`` directory made with another tokenizer than
    ``data_tokenizer`` (naming both); one without a record is read with a warning."""
    _check_identity(docs.source, docs.meta.get("tokenizer_id", _LEGACY), data_tokenizer,
                    eos_token)


def check_npy_tokenizer(npy: str | os.PathLike, data_tokenizer: str | None,
                        eos_token: str | None = None) -> None:
    """Refuse a ``.npy`` of ids whose record (``OUT.npy.zjax-tokens.json``) names another
    tokenizer than ``data_tokenizer``; without a record (an older zjax's, or numpy's own
    ``.npy``) there is nothing to check, said once as a warning where a tokenizer is set."""
    path = npy_meta_path(npy)
    if not path.is_file():
        if data_tokenizer is not None:
            log.warning("%s has no %s beside it: whether its ids are data.tokenizer's (%s) is "
                        "not checked", npy, path.name, data_tokenizer)
        return
    try:
        made = json.loads(path.read_text())["tokenizer_id"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"data.path: {str(path)!r}: not a readable record of the ids' "
                          f"tokenizer ({type(e).__name__}: {e}); delete it to read "
                          f"{os.fspath(npy)!r} unchecked") from None
    _check_identity(os.fspath(npy), made, data_tokenizer, eos_token)


def check_same_tokenizer(sources: Iterable[Documents]) -> None:
    """Refuse a mixture of sources whose ids were made with different tokenizers (byte-level
    included), naming two of them; sources without a record are skipped (warned of)."""
    from zjax.data._tokenizer import describe, different_tokenizer

    first = None
    for docs in sources:
        made = docs.meta.get("tokenizer_id", _LEGACY)
        if made is _LEGACY:
            continue
        if first is None:
            first = (docs.source, made)
            continue
        why = ("one is byte-level" if (made is None) != (first[1] is None)
               else None if made is None else different_tokenizer(first[1], made))
        if why is not None:
            raise ConfigError(
                f"data.path: {first[0]} was made with {describe(first[1])} and {docs.source} "
                f"with {describe(made)}: {why}; the sources of a mixture must share one "
                "tokenizer (tokenize them with the same --tokenizer)")
