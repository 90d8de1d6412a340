"""The main job on the Ray executor losing a worker or a node mid-run, each in a process of its
own (``experiments/grpo_math.py --executor ray``): the run ends quickly with a one-line message
naming the worker and leaves no Ray process behind, or (a generator's node) carries on. A file of
its own so that these subprocess jobs run beside ``tests/test_ray_executor.py`` on another worker.
"""

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import processes

pytestmark = pytest.mark.slow  # every test here takes seconds (BENCHMARKS.md: the suite's tiers)

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def _after_first_step(proc: processes.Popen, out: Path) -> Path:
    """Wait (up to 600 s: two Ray jobs may share 2 cores with a suite beside them) until the job
    ``proc`` has recorded a step in ``out``; its metrics file."""
    deadline = time.monotonic() + 600
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the run did not finish a step"
        time.sleep(0.1)
    return metrics


def _processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (Ray's daemons name their
    session folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie is gone


@pytest.mark.parametrize("mode, victim, sig", [("sync", "train rank 1", signal.SIGKILL),
                                               ("sync", "train rank 1", signal.SIGSTOP),
                                               ("async", "rollout worker 0", signal.SIGKILL),
                                               ("async", "train rank 0", signal.SIGKILL),
                                               ("sync", "critic rank 0", signal.SIGKILL)],
                         ids=["sync-kill-rank", "sync-stop-rank", "async-kill-rollout", "async-kill-rank",
                              "sync-kill-critic"])
def test_killing_a_worker_mid_run_exits_nonzero_naming_it(tmp_path, mode, victim, sig):
    """experiments/grpo_math.py --executor ray: SIGKILL (or SIGSTOP) one worker after the first
    step (a training rank; in async mode also the generator's rollout worker, with no restarts
    allowed; a rank of the critic's own pool, PPO with ``--placement split_collocate``). The run
    ends quickly with a one-line message naming it first (a stopped rank, not the peer that timed
    out waiting for it) and leaves no Ray process behind; a checkpoint written before loads."""
    out = tmp_path / "run"
    ray_temp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must stay under 107 bytes
    cmd = [sys.executable, str(ROOT / "experiments" / "grpo_math.py"), "--tiny", "--executor", "ray",
           "--steps", "500", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
           "--eval-size", "2", "--train-size", "40", "--eval-every", "0", "--checkpoint-every", "1",
           "--no-progress", "--threads", "1", "--out-dir", str(out), "--ray-temp-dir", ray_temp,
           *(["--async", "--train-ranks", "1", "asynchronous.restarts=0"] if mode == "async" else []),
           *(["--step-timeout", "10"] if sig == signal.SIGSTOP else []),
           *(["--placement", "split_collocate", "--adv-estimator", "gae"] if victim.startswith("critic") else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = processes.Popen(cmd, env=env, merge_stderr=True)
    try:
        _after_first_step(proc, out)
        pids = json.loads((out / "workers.json").read_text())
        os.kill(pids[victim], sig)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed
        deadline = time.monotonic() + 10
        while (left := [p for p in pids.values() if _alive(p)] + _processes_mentioning(ray_temp)):
            assert time.monotonic() < deadline, f"processes left behind: {left}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert proc.returncode != 0, output
    named = f"{victim} died" if sig == signal.SIGKILL else f"{victim} did not answer (stopped or hung?)"
    assert named in output, output
    assert output.index(named) < output.find("train rank 0 failed") or "train rank 0 failed" not in output
    assert "Traceback" not in output.split(named)[-1]
    assert not (out / "summary.json").exists()  # never a "training complete"
    assert elapsed < 60
    if victim == "rollout worker 0":  # the newest checkpoint resumes (asynchronously: nothing was queued in it)
        step = int(max((out / "checkpoints").glob("step_*")).name.removeprefix("step_"))
        again = [str(step + 1) if i and cmd[i - 1] == "--steps" else arg for i, arg in enumerate(cmd)]
        again[again.index(ray_temp)] = ray_temp = tempfile.mkdtemp(prefix="ray")
        try:
            resumed = processes.run([*again, "--resume"], env=env, timeout=300)
        finally:
            shutil.rmtree(ray_temp, ignore_errors=True)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"resumed from {out / 'checkpoints'}" in resumed.stdout
        assert json.loads((out / "summary.json").read_text())["steps"] == step + 1


def test_generators_on_other_nodes_of_a_cluster_survive_losing_a_node(tmp_path):
    """The issue's command (``--tiny --async --generators 2 --executor ray``) on a simulated
    multi-node cluster (``ray.cluster_utils.Cluster``: three raylets on this machine, each a node
    with its own object store): the training rank on the head node (custom resource
    ``trainer_node``), the two generators' rollout workers spread over two other nodes
    (``generator_node``). The job joins it with ``--ray-address``; one generator node is removed
    mid-run, killing a rollout worker; the generator hands its part back, its worker is started
    again on the surviving node, and the run finishes every step with the restart counted in the
    metrics, the summary and status.json."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    # Cluster writes the head's address under Ray's default temp folder whatever temp_dir says, and
    # fails where no earlier Ray run on the machine made that folder (a fresh machine)
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    ray_temp = tempfile.mkdtemp(prefix="ray")
    node = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**node, "resources": {"trainer_node": 1}, "temp_dir": ray_temp})
    proc = None
    try:
        generator_nodes = [cluster.add_node(**node, resources={"generator_node": 2}) for _ in range(2)]
        out = tmp_path / "run"
        cmd = [sys.executable, str(ROOT / "experiments" / "grpo_math.py"), "--tiny", "--steps", "10", "--async",
               "--generators", "2", "--executor", "ray", "--ray-address", cluster.address, "--train-ranks", "1",
               "--prompts-per-step", "4", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size", "2",
               "--train-size", "40", "--eval-every", "0", "--checkpoint-every", "0", "--no-progress", "--threads", "1",
               "--out-dir", str(out), "executor.pool_resources.train.trainer_node=1",
               "executor.pool_resources.rollout.generator_node=1", "asynchronous.restart_backoff_s=0.5",
               "asynchronous.status_every_s=0.5"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        proc = processes.Popen(cmd, env=env, merge_stderr=True)
        metrics = _after_first_step(proc, out)
        assert [g["restarts"] for g in json.loads((out / "status.json").read_text())["generators"]] == [0, 0]
        cluster.remove_node(generator_nodes[1])
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        cluster.shutdown()
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert proc.returncode == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["async"]["restarts"] >= 1, output
    assert re.search(r"generator \d failed \((generate|weight sync): rollout worker \d (died|failed)", output), output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[-1]["async/generator_restarts"] == summary["async"]["restarts"]
    status = json.loads((out / "status.json").read_text())
    assert sum(g["restarts"] for g in status["generators"]) == summary["async"]["restarts"]
    assert status["trainer"]["step"] == 10 and all(g["parts"] > 0 for g in status["generators"])
