"""``zjax tokenize`` and ``import-hf`` on hostile input (issue 50, items 2, 3, 5, 9, 10):
records written to a flat ``.npy`` hold the records' tokens (or are refused), files that are
not text are never tokenized as text, every output records its tokenizer and training refuses
another one, a tokenizer without an end-of-document token is refused until told, an
interrupted command leaves nothing behind, an unwritable output is one line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, cli_env, start_zjax, zjax_main
from sft_data import sft_example

from zjax import cli
from zjax.data import DataConfig, Encoder, load_corpus, load_tokens, read_store
from zjax.errors import ConfigError

TEXTS = [f"row {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(300)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    """A BPE tokenizer.json with a tokenizer_config.json (eos_token <|im_end|>)."""
    return sft_example.chat_tokenizer(tmp_path_factory.mktemp("tok"), TEXTS)


@pytest.fixture(scope="module")
def other_tok(tmp_path_factory) -> Path:
    """Another vocabulary."""
    return sft_example.chat_tokenizer(tmp_path_factory.mktemp("other"),
                                      [f"entirely other words {i}" for i in range(99)],
                                      vocab_size=300)


def _records(path: Path, n: int = 40) -> Path:
    rows = [{"text": TEXTS[i % len(TEXTS)], "prompt": f"q{i}", "completion": f"a{i}",
             "messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": f"n{i}"}]} for i in range(n)]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _zjax(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# item 2: records -> .npy -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["d.parquet", "d.jsonl"])
def test_text_records_to_npy_hold_the_records_tokens(tok, tmp_path, capsys, cli_logging, name):
    src = _records(tmp_path / name)
    rc, out, err = _zjax(capsys, "tokenize", str(src), "-o", str(tmp_path / "o.npy"),
                         "--tokenizer", str(tok), "--workers", "1")
    assert rc == 0, err
    data = DataConfig(tokenizer=str(tok))
    want = np.concatenate([ids for ids, _ in Encoder(data).documents(
        (str(i), {"text": TEXTS[i % len(TEXTS)]}) for i in range(40))])
    got = np.load(tmp_path / "o.npy")
    assert np.array_equal(got, want)  # the records' tokens, not the file's bytes
    assert (got == Encoder(data).eos_id).sum() == 40  # one EOS per record, as training has
    assert "of 40 records" in out
    # the same ids as the directory training reads the records from
    assert _zjax(capsys, "tokenize", str(src), "-o", str(tmp_path / "d"), "--tokenizer",
                 str(tok), "--workers", "1")[0] == 0
    assert np.array_equal(read_store(tmp_path / "d").tokens, got)
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("fmt", ["prompt_completion", "chat"])
def test_masked_records_to_npy_are_refused_naming_the_way_out(tok, tmp_path, capsys,
                                                              cli_logging, fmt):
    src = _records(tmp_path / "d.jsonl")
    rc, _, err = _zjax(capsys, "tokenize", str(src), "-o", str(tmp_path / "o.npy"),
                       "--tokenizer", str(tok), "--format", fmt)
    assert rc == 2 and "no loss mask" in err and f"-o {tmp_path / 'o'}" in err
    assert len(err.strip().splitlines()) == 1 and not list(tmp_path.glob("*o.npy*"))


def _not_text(tmp_path: Path, kind: str) -> Path:
    import bz2
    import gzip

    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20]).encode()
    made = {"json": ("d.json", lines), "csv": ("d.csv", b"text\nhello\n"),
            "tsv": ("d.TSV", b"text\nhello\n"), "bz2": ("d.jsonl.bz2", bz2.compress(lines)),
            "xz": ("d.jsonl.xz", lines), "parquet.gz": ("d.parquet.gz", gzip.compress(b"x")),
            "gzip-as-txt": ("notes.txt", gzip.compress(lines)),
            "npy-upper": ("ids.NPY", b"\x93NUMPY\x01\x00" + bytes(100)),
            "nul": ("blob.txt", b"text\x00\x01\x02")}[kind]
    (tmp_path / made[0]).write_bytes(made[1])
    return tmp_path / made[0]


@pytest.mark.parametrize("kind", ["json", "csv", "tsv", "bz2", "xz", "parquet.gz",
                                  "gzip-as-txt", "npy-upper", "nul"])
@pytest.mark.parametrize("out", ["o.npy", "o"])
def test_files_that_are_not_text_are_never_tokenized_as_text(tok, tmp_path, capsys,
                                                             cli_logging, kind, out):
    bad = _not_text(tmp_path, kind)
    rc, _, err = _zjax(capsys, "tokenize", str(bad), "-o", str(tmp_path / out),
                       "--tokenizer", str(tok))
    assert rc == 2 and repr(str(bad)) in err and ".jsonl, .jsonl.gz" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / out).exists()


def test_a_directory_of_text_reads_json_as_text_but_refuses_binary(tok, tmp_path, capsys,
                                                                   cli_logging):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("print('hi')\n")
    (corpus / "package.json").write_text('{"name": "x"}\n')
    rc, out, err = _zjax(capsys, "tokenize", str(corpus), "-o", str(tmp_path / "o.npy"),
                         "--tokenizer", str(tok))
    assert rc == 0 and "of 2 files" in out, err
    (corpus / "data.bin.txt").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(8))  # zstd
    rc, _, err = _zjax(capsys, "tokenize", str(corpus), "-o", str(tmp_path / "p.npy"),
                       "--tokenizer", str(tok))
    assert rc == 2 and "data.bin.txt' is a zstd file" in err


# item 3: the tokenizer's identity ------------------------------------------------------------

@pytest.fixture
def tokenized(tok, tmp_path, capsys, cli_logging) -> tuple[Path, Path]:
    """(a directory, a .npy) made with ``tok``."""
    src = _records(tmp_path / "d.jsonl")
    for out in ("dir", "flat.npy"):
        assert _zjax(capsys, "tokenize", str(src), "-o", str(tmp_path / out), "--tokenizer",
                     str(tok), "--workers", "1")[0] == 0
    return tmp_path / "dir", tmp_path / "flat.npy"


def test_outputs_record_their_tokenizer_and_training_refuses_another(tok, other_tok,
                                                                     tokenized, tmp_path):
    directory, flat = tokenized
    made = json.loads((directory / "zjax-tokens.json").read_text())["tokenizer_id"]
    assert made == json.loads(Path(f"{flat}.zjax-tokens.json").read_text())["tokenizer_id"]
    assert made["path"] == str(tok.resolve()) and made["eos_id"] == 2 and made["pad_id"] == 0
    from zjax.data.tokenize import id_bound, load_tokenizer

    assert made["id_bound"] == id_bound(load_tokenizer(tok))
    assert len(made["sha256"]) == len(made["vocab_sha256"]) == 64
    load_corpus(DataConfig(path=str(directory), tokenizer=str(tok)))
    load_tokens(str(flat), tokenizer=str(tok))
    with pytest.raises(ConfigError, match=r"^data.tokenizer: .*other.* is not the tokenizer "
                       r"that made .*dir \(.*tok.*\): another vocabulary"):
        load_corpus(DataConfig(path=str(directory), tokenizer=str(other_tok)))
    with pytest.raises(ConfigError, match=r"not the tokenizer that made .*flat.npy"):
        load_tokens(str(flat), tokenizer=str(other_tok))
    # the same vocabulary saved again (other bytes) is the same tokenizer
    from tokenizers import Tokenizer

    again = tmp_path / "again"
    again.mkdir()
    Tokenizer.from_file(str(tok)).save(str(again / "tokenizer.json"), pretty=False)
    (again / "tokenizer_config.json").write_bytes((tok.parent / "tokenizer_config.json")
                                                 .read_bytes())
    assert (again / "tokenizer.json").read_bytes() != tok.read_bytes()
    load_corpus(DataConfig(path=str(directory), tokenizer=str(again / "tokenizer.json")))
    # ... but not with another end-of-document token
    with pytest.raises(ConfigError, match="another end-of-document id"):
        load_corpus(DataConfig(path=str(directory), tokenizer=str(tok),
                               eos_token="<|endoftext|>"))


def test_a_mixture_of_two_tokenizers_is_refused(tok, other_tok, tokenized, tmp_path, capsys,
                                                cli_logging):
    directory, _ = tokenized
    assert _zjax(capsys, "tokenize", str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "b"),
                 "--tokenizer", str(other_tok), "--workers", "1")[0] == 0
    with pytest.raises(ConfigError, match=r"^data.path: .*dir was made with .*tok.* and .*b "
                       r"with .*other.*: another vocabulary"):
        load_corpus(DataConfig(path={str(directory): 1, str(tmp_path / "b"): 1}))
    with pytest.raises(ConfigError, match="one is byte-level"):  # records read as bytes
        load_corpus(DataConfig(path={str(directory): 1, str(tmp_path / "d.jsonl"): 1}))
    load_corpus(DataConfig(path={str(directory): 1, str(tmp_path / "d.jsonl"): 1},
                           tokenizer=str(tok)))


def test_an_output_without_a_record_is_read_with_a_warning_naming_it(tok, tokenized):
    directory, flat = tokenized
    meta = json.loads((directory / "zjax-tokens.json").read_text())
    del meta["tokenizer_id"]
    (directory / "zjax-tokens.json").write_text(json.dumps(meta))
    Path(f"{flat}.zjax-tokens.json").unlink()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("zjax")
    logger.addHandler(handler)
    try:
        load_corpus(DataConfig(path=str(directory), tokenizer=str(tok)))
        load_tokens(str(flat), tokenizer=str(tok))
    finally:
        logger.removeHandler(handler)
    assert any(str(directory) in m and "records no tokenizer" in m for m in seen), seen
    assert any(str(flat) in m and "not checked" in m for m in seen), seen


# item 5: end-of-document markers -----------------------------------------------------------

@pytest.mark.parametrize("case", ["no config", "eos not in vocab"])
@pytest.mark.parametrize("fmt", ["text", "prompt_completion"])
def test_a_tokenizer_without_an_eos_is_refused_until_told(tok, tmp_path, capsys, cli_logging,
                                                          case, fmt):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(tok.read_bytes())
    if case == "eos not in vocab":
        (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    src = _records(tmp_path / "d.jsonl")
    args = ["tokenize", str(src), "--tokenizer", str(bare / "tokenizer.json"), "--format",
            fmt, "--workers", "1"]
    rc, _, err = _zjax(capsys, *args, "-o", str(tmp_path / "o"))
    assert rc == 2 and str(bare / "tokenizer.json") in err and "--eos-token" in err
    assert ("no " if case == "no config" else "'</s>'") in err and "'<|im_end|>'" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match=r"data\.eos_token"):  # training reads them the same
        load_corpus(DataConfig(path=str(src), tokenizer=str(bare / "tokenizer.json"),
                               format=fmt))
    assert _zjax(capsys, *args, "-o", str(tmp_path / "e"), "--eos-token", "<|im_end|>")[0] == 0
    assert _zjax(capsys, *args, "-o", str(tmp_path / "n"), "--eos-token", "")[0] == 0
    with_eos, without = read_store(tmp_path / "e"), read_store(tmp_path / "n")
    assert len(with_eos.tokens) == len(without.tokens) + 40
    assert with_eos.tokens[with_eos.offsets[1] - 1] == 2  # <|im_end|> ends the document
    rc, _, err = _zjax(capsys, *args, "-o", str(tmp_path / "x"), "--eos-token", "<nope>")
    assert rc == 2 and "data.eos_token: '<nope>' is not a token" in err


# item 10: an output that cannot be written -------------------------------------------------

@pytest.mark.parametrize("out", ["file.txt/out", "file.txt/a/out.npy", "/proc/zjax-out"])
def test_an_unwritable_output_is_one_line_naming_it(tok, tmp_path, capsys, cli_logging, out):
    (tmp_path / "file.txt").write_text("x")
    out = out if out.startswith("/") else str(tmp_path / out)
    rc, _, err = _zjax(capsys, "tokenize", str(_records(tmp_path / "d.jsonl")), "-o", out,
                       "--tokenizer", str(tok), "--workers", "1")
    assert rc == 2 and err.startswith(f"zjax: error: -o: cannot write {out!r}")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("out", ["o", pytest.param("o.npy", marks=pytest.mark.slow)])
def test_a_full_disk_is_one_line_and_leaves_nothing(tok, tmp_path, out):
    # subprocess: the file-size limit (and SIGXFSZ ignored) is a process's, and its workers'
    # a process whose files may not grow past 64 KiB: its writes fail as on a full disk
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    src = _records(tmp_path / "d.jsonl", n=3000)
    r = subprocess.run([sys.executable, "-m", "zjax", "tokenize", str(src), "-o",
                        str(tmp_path / "w" / out), "--tokenizer", str(tok), "--workers", "1"],
                       cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120,
                       preexec_fn=limit)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"-o: cannot write {str(tmp_path / 'w' / out)!r}: File too large" in r.stderr
    assert "Traceback" not in r.stderr and list((tmp_path / "w").iterdir()) == []


# item 9: interrupts and leftovers ----------------------------------------------------------
# These start real processes: what is tested is the signal, delivered to a separate process,
# and what that process and its workers leave behind.

def _descendants(pid: int) -> list[int]:
    from helpers import children

    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def _running(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped by init) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(check, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"{what} never happened: {proc.communicate()}")
        time.sleep(0.05)


def _assert_stopped(proc: subprocess.Popen, sig: int, workers: list[int], parent: Path,
                    out: Path) -> None:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in err and "Traceback" not in err
    end = time.monotonic() + 10
    while any(_running(p) for p in workers) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in workers if _running(p)], "worker processes outlived the command"
    assert not out.exists() and _hidden(parent) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_tokenize_leaves_no_output_and_no_worker(tok, tmp_path, sig):
    # subprocess: the tokenize interrupted by a signal (the rerun: here)
    src = tmp_path / "big.jsonl"
    line = json.dumps({"text": " ".join(TEXTS[:4])}) + "\n"
    src.write_text(line * 60000)
    out = tmp_path / "out" / "o"
    args = ("tokenize", str(src), "-o", str(out), "--tokenizer", str(tok), "--workers", "2")
    proc = start_zjax(*args)
    workers: list[int] = []

    def started() -> bool:  # the partial output and both encoding processes are there
        workers[:] = _descendants(proc.pid)
        spawned = [p for p in workers if "spawn_main" in _cmdline(p)]
        return len(spawned) == 2 and out.parent.is_dir() and _hidden(out.parent) != []

    _wait_until(started, proc, "the workers' start")
    proc.send_signal(sig)
    _assert_stopped(proc, sig, workers, out.parent, out)
    src.write_text(line * 50)  # and a rerun works
    r = zjax_main(*args)
    assert r.returncode == 0 and len(read_store(out)) == 50, r.stderr[-2000:]


def test_a_stop_swallowed_on_the_way_is_raised_before_the_output_is_committed(tok, tmp_path):
    """A signal whose Stopped Python swallowed (raised inside a garbage collector's callback:
    "Exception ignored in: <function _xla_gc_callback>", seen once in the test above, the
    tokenize then ran to its end and exited 0) is raised again at the last stop point: the
    output is not committed and the partial one is removed."""
    from zjax.data._store import write_store
    from zjax.runtime import stop

    out = tmp_path / "o"
    with stop.stoppable(), pytest.raises(stop.Stopped):
        with contextlib.suppress(stop.Stopped):  # what a gc callback does with it
            stop._handle(signal.SIGINT, None)
        write_store(out, [(np.arange(5), np.ones(5))], vocab_size=16, meta={})
    assert not out.exists() and _hidden(tmp_path) == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# import-hf: the weights are small, so each leaf's Orbax write is slowed down by a hook
# (the signal then lands inside a write, which must not be cut: it stops at the next leaf)
_SLOW_IMPORT = """
import sys, time
import zjax.checkpoint._leaf_io as io
write = io._orbax_write
def slow(*a, **k):
    time.sleep(0.4)
    return write(*a, **k)
io._orbax_write = slow
from zjax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT,
                                 pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_an_interrupted_import_hf_leaves_nothing_and_a_rerun_works(tmp_path, sig):
    # subprocess: the import-hf interrupted by a signal (the rerun: here)
    hf = tmp_path / "hf"
    sft_example.write_base(hf, TEXTS)
    out = tmp_path / "out" / "imported"
    out.parent.mkdir()
    cmd = [sys.executable, "-c", _SLOW_IMPORT, "import-hf", str(hf), str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    partial = out.parent / f".{out.name}.zjax-import"
    _wait_until(partial.is_dir, proc, "the import's first write")
    time.sleep(0.2)  # inside the first leaf's write
    workers = _descendants(proc.pid)
    proc.send_signal(sig)
    _assert_stopped(proc, sig, workers, out.parent, out)
    r = zjax_main("import-hf", str(hf), str(out))
    assert r.returncode == 0 and (out / "zjax.yaml").is_file(), r.stderr[-2000:]


def test_leftovers_of_a_killed_run_are_removed_and_never_read(tok, tmp_path, capsys,
                                                              cli_logging):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that is gone, as a kill -9'd tokenize's is
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    for name in (f".o.partial-{dead.pid}-abc", f".o.npy.partial-{dead.pid}-abc"):
        left = corpus / name  # left inside the input directory itself
        left.mkdir()
        (left / "tokens.raw").write_bytes(os.urandom(4096))
    alive = corpus / f".o.partial-{os.getppid()}-xyz"  # another run's, still working
    alive.mkdir()
    rc, out, err = _zjax(capsys, "tokenize", str(corpus), "-o", str(corpus / "o.npy"),
                         "--tokenizer", str(tok))
    assert rc == 0 and "of 1 files" in out, err  # the leftovers were not read as text
    rc, out, err = _zjax(capsys, "tokenize", str(corpus / "a.txt"), "-o", str(corpus / "o"),
                         "--tokenizer", str(tok), "--workers", "1")
    assert rc == 0 and "partial output of an interrupted run" in out
    assert _hidden(corpus) == [alive.name]  # the dead runs' removed, the live one's kept


def test_a_terminated_pool_leaves_no_thread_for_the_exit_hook():
    """After the encoding stops early, the pool's manager thread has ended (its wake-up pipe
    closed): CPython 3.11's exit hook for process pools writes to that pipe unlocked, and a
    thread still ending there printed a 'Bad file descriptor' traceback after 'stopped by
    SIGTERM' (seen once in a full run)."""
    import concurrent.futures
    import multiprocessing

    from zjax.data._parallel import _terminate

    pool = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"))
    assert pool.submit(abs, -3).result(timeout=60) == 3
    manager, wakeup = pool._executor_manager_thread, pool._executor_manager_thread_wakeup
    close = wakeup.close

    def slow_close():  # widen the window in which the exit hook wrote to a closing pipe
        time.sleep(0.5)
        close()

    wakeup.close = slow_close
    _terminate(pool)
    assert not manager.is_alive() and wakeup._closed
