"""The data pipeline: per-process slices, checkpointable iterators, sources and their errors."""

from __future__ import annotations

import numpy as np
import pytest

import zjax
from zjax.data import load_tokens, stdlib_files, window_batches


def test_process_slices_are_disjoint_and_form_the_global_batch():
    tokens = np.arange(10_000, dtype=np.int32)
    whole = window_batches(tokens, global_batch=8, seq_len=9, seed=3)
    parts = [window_batches(tokens, global_batch=8, seq_len=9, seed=3, process_index=p,
                            process_count=2) for p in range(2)]
    for _ in range(5):
        full = next(whole)
        a, b = next(parts[0]), next(parts[1])
        assert a.shape == b.shape == (4, 10)
        starts = {int(r[0]) for r in full}
        assert {int(r[0]) for r in a} | {int(r[0]) for r in b} == starts
        assert not {int(r[0]) for r in a} & {int(r[0]) for r in b}


def test_iterator_state_resumes_at_the_exact_next_batch():
    tokens = np.arange(5_000, dtype=np.int32)
    it = window_batches(tokens, global_batch=4, seq_len=7, seed=0)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    fresh = window_batches(tokens, global_batch=4, seq_len=7, seed=0)
    fresh.set_state(state)
    for e in expected:
        np.testing.assert_array_equal(next(fresh), e)


def test_sources(tmp_path):
    default = load_tokens(eval_fraction=0.1, max_bytes=2**20)
    assert default.vocab_size == 256 and len(default.eval) > 0 and len(stdlib_files()) > 100
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.int32) % 50)
    arr = load_tokens(str(tmp_path / "t.npy"), eval_fraction=0.1)
    assert arr.vocab_size == 50 and len(arr.train) == 900
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world " * 50)
    assert len(load_tokens(str(tmp_path / "docs")).train) > 500
    assert len(load_tokens(str(tmp_path / "docs" / "*.txt")).train) > 500


def test_the_default_text_is_read_once_per_process_and_cannot_be_written():
    """Every run of a process (a training and its evaluation, a test session's many runs)
    shares one read-only copy of the standard library's bytes: all of them, in file order."""
    first, again = load_tokens(eval_fraction=0.1), load_tokens(eval_fraction=0.2)
    assert np.shares_memory(first.train, again.train)
    with pytest.raises(ValueError, match="read-only"):
        first.train[0] = 0
    files = stdlib_files()
    assert len(first.train) + len(first.eval) == sum(f.stat().st_size for f in files) \
        + len(files) - 1
    head = files[0].read_bytes()[:1000]
    assert bytes(first.train[:len(head)]) == head


@pytest.mark.parametrize("make, needle", [
    (lambda p: str(p / "missing"), "does not exist"),
    (lambda p: (p / "empty").mkdir() or str(p / "empty"), "holds no file"),
    (lambda p: (p / "z.txt").write_text("") or str(p / "z.txt"), "holds no data"),
    (lambda p: np.save(p / "f.npy", np.ones(5, np.float32)) or str(p / "f.npy"), "integer"),
])
def test_bad_data_paths(tmp_path, make, needle):
    with pytest.raises(zjax.ConfigError, match=r"data\.path") as e:
        load_tokens(make(tmp_path))
    assert needle in str(e.value)
