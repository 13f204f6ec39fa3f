"""Issue 67's post-training paths, met through the CLI (in this process): preference pairs
that are one answer twice (as given, or once cut to ``data.seq_len``), a GRPO reward function
that returns bools or calls ``sys.exit()``, a GRPO resume with another
``rl.steps_per_generation``, the ``data`` modules' import cycle; and what zjax says of
rewards that are all None and of ``rl`` / ``preference`` keys no method reads.

One GRPO run compiles (module-scoped, shared by its three tests); the rest stop before
compiling."""

from __future__ import annotations

import ast
import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import rl_user_rewards
from helpers import ROOT, zjax_main

from zjax.rl import Rewards

sys.path.insert(0, str(ROOT / "examples"))
import grpo_example

DPO = ROOT / "configs/dpo-llama.yaml"
GRPO = ROOT / "configs/grpo-tiny.yaml"
# the DPO config's rows: data.seq_len 32, so a sequence is cut to 33 bytes (no tokenizer)
ROOM = 33


def _error_line(r) -> str:
    """The run's one ``zjax: error:`` line (exit 2, no traceback)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("zjax: error: ")]
    assert len(lines) == 1, r.stderr[-2000:]
    return lines[0]


def _pairs(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n"
                            for p, c, r in rows))
    return path


def _cut_equal(i: int, room: int = ROOM) -> tuple[str, str, str]:
    """A pair whose answers differ only past a row's ``room`` tokens (digits: one byte, one
    token each, by either tokenizer)."""
    same = "0" * room
    return f"{i}+{i}=", f"{same}1", f"{same}2"


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """A tokenizer of digits, ``+`` and ``=`` (``zjax tokenize`` needs one)."""
    return grpo_example.write_tokenizer(tmp_path_factory.mktemp("digits"))


# --- preference data: pairs that are one answer twice --------------------------------------


def test_pairs_equal_once_cut_to_seq_len_are_skipped_and_counted(digits, tmp_path):
    """Defect 10: the answers differ only past ``seq_len + 1`` tokens: before, both rows were
    kept, equal (a loss of ln 2 with no gradient); now skipped and counted as equal pairs."""
    src = _pairs(tmp_path / "p.jsonl", [("1+1=", "2", "3"), _cut_equal(1, 17),
                                        ("2+2=", "4", "5"), _cut_equal(2, 17)])
    out = tmp_path / "out"
    r = zjax_main("tokenize", src, "-o", out, "--tokenizer", digits, "--format",
                  "preference", "--seq-len", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"2 of 4 preference rows were skipped (the first: {src}, row 2): their chosen " \
        "answer is their rejected one (2 of them only once cut to fit 17 tokens, " \
        "data.seq_len + 1)" in r.stdout, r.stdout  # the log: stdout, as zjax train's
    meta = json.loads((out / "zjax-tokens.json").read_text())
    assert meta["documents"] == 4  # the two pairs that differ, chosen and rejected each


def test_a_run_on_pairs_all_equal_once_cut_stops_saying_so(tmp_path):
    """Defect 10: every pair equal once cut: before, DPO trained at ln 2 and exited 0."""
    src = _pairs(tmp_path / "p.jsonl", [_cut_equal(i) for i in range(4)])
    r = zjax_main("train", DPO, "--run-dir", tmp_path / "run", f"data.path={src}",
                  "train.steps=1", "logging.progress=false")
    line = _error_line(r)
    assert f"data.path: {src}: all 4 preference pairs were skipped as identical (the first: " \
        f"{src}, row 1): their chosen answer is their rejected one (4 of them only once cut " \
        f"to fit {ROOM} tokens" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_file_of_equal_pairs_is_refused_as_such_not_as_empty(digits, tmp_path):
    """Defect 11: before, "holds no records"; now the N pairs skipped, and why."""
    src = _pairs(tmp_path / "p.jsonl", [(f"{i}+1=", "7", "7") for i in range(3)])
    r = zjax_main("train", DPO, "--run-dir", tmp_path / "run", f"data.path={src}",
                  "train.steps=1", "logging.progress=false")
    line = _error_line(r)
    assert "holds no records" not in line
    assert f"data.path: {src}: all 3 preference pairs were skipped as identical (the first: " \
        f"{src}, row 1): their chosen answer is their rejected one, a pair the preference " \
        "loss learns nothing from" in line, line
    tok = zjax_main("tokenize", src, "-o", tmp_path / "out", "--tokenizer", digits,
                    "--format", "preference")
    assert "tokenize: all 3 preference pairs were skipped as identical" in _error_line(tok)
    assert not (tmp_path / "out").exists()


# --- GRPO: one run, its reward functions returning bools, then calling sys.exit() ----------

TINY = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.d_ff=32", "zero.stage=0", "data.batch_size=8", "rl.group_size=4",
        "train.log_every=1", "logging.progress=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    """``(data dir, run dir, the CLI's result, its arguments)``: 3 steps per rollout,
    checkpoints every 2 steps; the second rollout's ``sys.exit()`` stops it at step 4."""
    data = tmp_path_factory.mktemp("grpo")
    grpo_example.write_tokenizer(data)
    grpo_example.write_prompts(data / "prompts.jsonl", 64)
    run = data / "run"
    args = [f"data.path={data / 'prompts.jsonl'}", f"data.tokenizer={data / 'tokenizer.json'}",
            *TINY, "train.steps=6", "checkpoint.every=2", "rl.steps_per_generation=3",
            "rl.rewards=[rl_user_rewards:alternate_bools,rl_user_rewards:exits_later]"]
    rl_user_rewards.EXIT_AT.update(calls=0, at=2)
    try:
        result = zjax_main("train", GRPO, "--run-dir", run, *args)
    finally:
        rl_user_rewards.EXIT_AT.update(calls=0, at=None)
    return data, run, result, args


def _checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def test_bool_rewards_count_as_0_and_1(grpo):
    """Defect 14: TRL's ``[c == a for ...]``: before, refused ("returned False"); now 0/1."""
    _, run, result, _ = grpo
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3], result.stderr[-2000:]
    assert all(r["rewards/alternate_bools"] == 0.5 and r["reward"] == 0.5 for r in rows)
    # the first step's training time is measured at the next rollout: "-", not "nan"
    first = next(x for x in result.stdout.splitlines() if x.startswith("step     1"))
    assert "generate/score/train " in first and "/- s" in first and "nan" not in first


def test_a_reward_function_calling_sys_exit_stops_the_run_by_name(grpo):
    """Defect 12: before, the run ended with sys.exit's code, no message; now exit 2 naming
    the function, the checkpoints intact."""
    _, run, result, _ = grpo
    line = _error_line(result)
    assert line == ("zjax: error: reward function rl_user_rewards:exits_later called "
                    "sys.exit(): a reward function returns its rewards, it does not end the run")
    assert _checkpoints(run) == [2]
    assert (run / "rollouts" / "2.0.npz").is_file()  # the rollout's last batch, for a resume


def test_a_resume_with_other_steps_per_generation_names_the_key_whole(grpo):
    """Defect 13: before, "does not fit this run's data (data.*)" and the reason cut at 200
    characters; now the key, both values, the checkpoint left as it is."""
    _, run, _, args = grpo
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    r = zjax_main("train", GRPO, "--run-dir", run, *args, "rl.steps_per_generation=1")
    line = _error_line(r)
    assert line.startswith("zjax: error: rl.steps_per_generation: 1, but the checkpoint at "
                           "step 2 was saved with 1 batch of its rollout still to train (in "), line
    assert line.endswith("by a run with rl.steps_per_generation 3; that checkpoint was left "
                         "as it is: resume with the setting it was saved with, or train in a "
                         "new run directory"), line
    assert "data.*" not in line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


# --- what zjax says: all-None rewards, keys no method reads, the import cycle --------------


def test_rewards_all_none_are_warned_of_once(caplog):
    """TRL warns where every reward function returns None; so does zjax, once."""
    rewards = Rewards(["rl_user_rewards:only_some"], [1.0])
    with caplog.at_level(logging.WARNING, logger="zjax"):
        for _ in range(2):
            total, _ = rewards(["a", "b"], ["1", "2"], {"answer": [None, None]})
            assert total.tolist() == [0.0, 0.0]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        "rl.rewards: every reward function (rl_user_rewards:only_some) returned None for 2 "
        "of 2 completions (the first: completion 0, of prompt 'a')"), said


def test_rl_and_preference_keys_no_method_reads_are_warned_of(tmp_path):
    """Said once each, before anything else: here, before the refusal of prompts to train
    on without rl.method (a GRPO config with the method left out)."""
    r = zjax_main("train", ROOT / "configs/tiny.yaml", "--run-dir", tmp_path / "run",
                  "data.format=prompt", "rl.kl_beta=0.1", "rl.group_size=4",
                  "preference.beta=0.5", "logging.progress=false")
    assert "rl.method: empty, but data.format prompt" in _error_line(r)
    said = [x for x in r.stdout.splitlines() if "method is empty" in x]
    assert said == ["rl.group_size, rl.kl_beta: set, but rl.method is empty, so nothing reads "
                    "them; set rl.method to use them, or remove them",
                    "preference.beta: set, but preference.method is empty, so nothing reads "
                    "them; set preference.method to use them, or remove them"], r.stdout


def test_no_import_cycle_even_through_typing_only_imports():
    """Defect 18: ``zjax.data._documents`` imported ``_preference``, which imported it back
    under ``if TYPE_CHECKING`` (the architecture test does not count those edges)."""
    from test_architecture import _cycles, _lazy_table, _modules

    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif _lazy_table(node):
                targets = [v.value for v in node.value.values]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    assert _cycles(graph) == []
