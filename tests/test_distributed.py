"""Multi-process runs on jax.distributed: 2 processes x 4 devices against 1 x 8, checkpoints
across process counts, `zjax launch` ending a job whose child dies, an unreachable coordinator.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    FP32,
    ROOT,
    assert_trees_close,
    children,
    cli_env,
    latest_checkpoint,
    zjax_cmd,
    zjax_main,
)

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

FAST = ["model.n_layers=2", "data.seq_len=32", "train.steps=5", "train.log_every=5",
        "train.eval_every=0", "logging.tensorboard=false", "zero.stage=3",
        "zero.gather_dtype=float32"]  # bf16 would round a 1-ulp master difference to 2^-8
TRAIN = zjax_cmd("train", "configs/tiny.yaml", *FAST)


def _run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def _launch(n: int, d: int, *cmd: str) -> list[str]:
    return zjax_cmd("launch", "-n", str(n), "--devices-per-process", str(d), "--", *cmd)


def _restore(run_dir: Path, step: int) -> dict:
    """The canonical state of ``run_dir``'s checkpoint at ``step``, on this process's devices."""
    return latest_checkpoint(run_dir, FAST, step=step)[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 5 steps as 1 process x 8 devices (this one) and as 2 processes x 4 devices
    (`zjax launch`: jax.distributed needs processes of their own)."""
    tmp = tmp_path_factory.mktemp("dist")
    one = zjax_main("train", "configs/tiny.yaml", *FAST, "--devices", "8",
                    "--run-dir", str(tmp / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    # subprocess: 2 processes of one jax.distributed job (`zjax launch`)
    two = _run(_launch(2, 4, *TRAIN, "--run-dir", str(tmp / "two")))
    assert two.returncode == 0, two.stderr[-3000:]
    return tmp, one, two


def test_two_processes_train_like_one(runs):
    # subprocess: the fixture's 2 x 4 run (jax.distributed), read here
    tmp, _, two = runs
    # only process 0 reports; both processes tag their lines with their index
    assert "[process 0] step     5" in two.stdout and "[process 1] step" not in two.stdout
    a, b = _restore(tmp / "one", 5), _restore(tmp / "two", 5)
    # not bitwise: the cross-process reductions (gloo) sum in another order than XLA's
    # in-process all-reduce, so the float32 results differ in the last bits
    assert_trees_close(b["params"], a["params"], **FP32, what="params")
    assert_trees_close(b["opt_state"], a["opt_state"], **FP32, what="optimizer state")
    lines = (tmp / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # written by process 0 alone


READ_ON_2 = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    import jax, numpy as np
    assert jax.device_count() == 2
    from helpers import latest_checkpoint
    _, state = latest_checkpoint(Path(sys.argv[1]), sys.argv[3].split(), step=5)
    leaves = [np.asarray(x) for x in jax.tree.leaves((state["params"], state["opt_state"]))]
    np.savez(sys.argv[2], *leaves)
""")


def test_checkpoints_cross_process_counts(runs, tmp_path):
    # subprocess: a reader with 2 devices, and a 2 x 4 `zjax launch` resuming a 1 x 8 run
    tmp, _, _ = runs
    want = _restore(tmp / "two", 5)  # written by 2 x 4, restored on 1 x 8
    env = cli_env(JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    r = subprocess.run([sys.executable, "-c", READ_ON_2, str(tmp / "two"), str(tmp_path / "a"),
                        " ".join(FAST)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(tmp_path / "a.npz")
    import jax

    for i, leaf in enumerate(jax.tree.leaves((want["params"], want["opt_state"]))):
        np.testing.assert_array_equal(got[f"arr_{i}"], np.asarray(leaf))  # 1 x 2: bitwise
    # the reverse: a 1 x 8 run resumed by 2 x 4 processes
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp / "one", resumed)
    r = _run(_launch(2, 4, *TRAIN, "train.steps=6", "--run-dir", str(resumed)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from the checkpoint at step 5" in r.stdout
    assert np.isfinite(_restore(resumed, 6)["params"]["embed"]).all()


def test_launch_ends_the_job_when_a_child_dies():
    # subprocess: `zjax launch` and its children, one of them killed with SIGKILL
    proc = subprocess.Popen(_launch(2, 4, *TRAIN, "train.steps=100000"), cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        kids: list[int] = []
        deadline = time.monotonic() + 60
        while len(kids) < 2 and time.monotonic() < deadline:
            kids = children(proc.pid)
            time.sleep(0.2)
        assert len(kids) == 2
        time.sleep(3)  # mid-start: imports, distributed init or compile
        os.kill(kids[1], signal.SIGKILL)
        rc = proc.wait(timeout=60)  # bounded: SIGTERM, then SIGKILL after the grace period
        assert rc == 128 + signal.SIGKILL
        assert "ending the other 1" in proc.stderr.read()
        for pid in kids:  # no process left behind
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_unreachable_coordinator_is_a_clear_error():
    # subprocess: jax.distributed.initialize cannot be undone in this process
    t0 = time.monotonic()
    env = cli_env() | {"ZJAX_COORDINATOR": "127.0.0.1:9", "ZJAX_NUM_PROCESSES": "2",
                    "ZJAX_PROCESS_ID": "1"}
    r = subprocess.run([*TRAIN, "mesh.init_timeout_s=3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the coordinator 127.0.0.1:9 could not be reached within 3 s" in r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 60


def test_model_axis_across_processes_trains_like_one(runs):
    """4 processes x 2 devices on a data=2 x model=4 mesh: each model group spans two
    processes, which load the same slice of every batch; the 5 steps match 1 x 8.

    This caught XLA:CPU's gloo reduce-scatter returning wrong values at the end of rank 0's
    chunk (jax-ml/jax#40830): the last 26 elements of one embedding shard differed between
    model replicas, by up to 10%; zjax now reduce-scatters as all-reduces there.
    """
    tmp = runs[0]
    # subprocess: 4 processes of one jax.distributed job (`zjax launch`)
    four = _run(_launch(4, 2, *TRAIN, "mesh.data=2", "mesh.model=4", "--run-dir",
                        str(tmp / "four")))
    assert four.returncode == 0, four.stderr[-3000:]
    assert "data 2 x model 4" in four.stdout and "reduce-scatters run as all-reduces" in four.stdout
    a, b = _restore(tmp / "one", 5), _restore(tmp / "four", 5)
    assert_trees_close(b["params"], a["params"], **FP32, what="params")
    assert_trees_close(b["opt_state"], a["opt_state"], **FP32, what="optimizer state")
    loss = lambda run: json.loads((tmp / run / "metrics.jsonl").read_text())["loss"]
    np.testing.assert_allclose(loss("four"), loss("one"), rtol=1e-5)


def test_hpz_with_a_node_per_process_trains_like_one(runs):
    """2 processes x 4 devices with ``zero.hpz_partition_size=4``: each process is a node of
    the hierarchical partition (the groups follow the processes). The 5 steps match plain
    stage 3 on 1 x 8, and the run's plan (link classes from the processes) has the
    backward's gathers inside a process: only the forward's quarter-size gathers cross."""
    tmp = runs[0]
    # subprocess: 2 processes of one jax.distributed job (`zjax launch`)
    two = _run(_launch(2, 4, *TRAIN, "zero.hpz_partition_size=4", "--run-dir",
                       str(tmp / "hpz")))
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _restore(tmp / "one", 5), _restore(tmp / "hpz", 5)
    assert_trees_close(b["params"], a["params"], **FP32, what="params")
    assert_trees_close(b["opt_state"], a["opt_state"], **FP32, what="optimizer state")
    links = json.loads((tmp / "hpz" / "plan.json").read_text())["collectives_by_link"]
    assert 0 < links["inter_host"]["all_gather"] < links["intra_host"]["all_gather"] / 3


@pytest.mark.parametrize("where", [[], ["zero.offload_param.device=nvme"]],
                         ids=["optimizer", "params"])
def test_nvme_optimizer_across_processes_trains_like_one(runs, tmp_path, where):
    """2 processes x 4 devices with the optimizer on NVMe (and the parameters: the streamed
    step, each process reading its own shards, the norms agreed between them), both in one
    directory (each process's swap files carry its index): the 5 steps, and the checkpoint
    both processes wrote leaf by leaf, match 1 x 8 in memory; the swap files are removed at
    the end."""
    tmp = runs[0]
    nv = tmp_path / "nvme"
    nv.mkdir()
    # subprocess: 2 processes of one jax.distributed job (`zjax launch`)
    two = _run(_launch(2, 4, *TRAIN, "zero.offload_optimizer.device=nvme",
                       f"zero.offload_optimizer.nvme_path={nv}", "zero.sub_group_size=4096",
                       *where, "--run-dir", str(tmp_path / "run")))
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _restore(tmp / "one", 5), _restore(tmp_path / "run", 5)
    assert_trees_close(b["params"], a["params"], **FP32, what="params")
    assert_trees_close(b["opt_state"], a["opt_state"], rtol=FP32["rtol"], atol=1e-9,
                       what="optimizer state")
    assert not list(nv.iterdir())


class _Dev:
    def __init__(self, process_index: int):
        self.process_index = process_index


@pytest.mark.parametrize(("shape", "expected"), [
    ((2, 4), [(0, 2), (1, 2)]),  # model within a process: one data row each
    ((4, 2), [(0, 2), (1, 2)]),  # two data rows per process
    ((1, 8), [(0, 1), (0, 1)]),  # one data row across both: the same slice
])
def test_process_batch_slice(shape, expected):
    from types import SimpleNamespace

    from zjax.runtime.mesh import process_batch_slice

    devices = np.array([_Dev(i // 4) for i in range(8)], dtype=object).reshape(shape)
    mesh = SimpleNamespace(axis_names=("data", "model"), devices=devices,
                           shape={"data": shape[0], "model": shape[1]})
    assert [process_batch_slice(mesh, p) for p in (0, 1)] == expected


def test_grpo_across_processes_saves_and_resumes_mid_rollout(tmp_path):
    """2 x 4 GRPO, two steps per rollout: the checkpoint at step 3 falls inside a rollout,
    each process saves its own untrained batch beside it (process 1 holds no lock on the run
    directory), and the job resumes from them and trains to the end."""
    sys.path.insert(0, str(ROOT / "examples"))
    import grpo_example

    grpo_example.write_tokenizer(tmp_path)
    prompts = grpo_example.write_prompts(tmp_path / "prompts.jsonl", 200)
    run = tmp_path / "run"
    args = ["configs/grpo-tiny.yaml", f"data.path={prompts}",
            f"data.tokenizer={tmp_path / 'tokenizer.json'}", "rl.steps_per_generation=2",
            "rl.group_size=8", "data.batch_size=64", "checkpoint.every=3",
            "train.log_every=1", "logging.tensorboard=false", "--run-dir", str(run)]
    cut = _run(_launch(2, 4, *zjax_cmd("train", *args, "train.steps=3")))
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["3.0.npz", "3.1.npz"]
    resumed = _run(_launch(2, 4, *zjax_cmd("train", *args, "train.steps=6")))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # step 4 trains the saved half of step 3's rollout: the same rollout's reward
    assert rows[3]["reward"] == rows[2]["reward"]
