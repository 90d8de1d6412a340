"""Every ``bench/*.py`` script runs: at its smoke size, as a subprocess, it exits 0 and prints its result.

Benchmarks run by hand, rarely, so a library change that breaks one went unseen until its next
measurement (issue 87: ``bench/bench_update.py`` failed on a field of ``Sequences`` that may be None).
Each script the glob finds is one of:

- run here (:data:`SMOKE`): most with ``--smoke``, the smallest sizes that run every step of the bench
  (seconds of work; a Ray executor takes seconds more to start), which its docstring documents; the
  job drivers with the main job's ``--tiny``; the readers on what another script here wrote (:data:`READS`);
- run at a tiny size by another test (:data:`COVERED`), not twice;
- a module that scripts import (:data:`LIBRARIES`), run through them.

A new script fails :func:`test_every_script_runs_here_or_elsewhere` until it is given a place. The scripts
run in the fork server of :mod:`tests.processes` (torch, transformers and purerl imported once). Nothing
here needs a GPU, vLLM or the network: ``--device cuda``, ``--vllm`` and ``--compile`` are left out.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import processes

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py"))

SMOKE: dict[str, list[tuple[str, str]]] = {
    "bench_agents": [("--smoke", r"throughput, endpoint / direct: \d+\.\d+ .* \d+\.\d+ \(both reusing KV caches\)")],
    "bench_async": [("--smoke", r"async / sync throughput: \d+\.\d+× \(median \d+\.\d+×\)")],
    "bench_canary": [("--smoke", r"canary / the sync plus one batch's generation: \d+\.\d+%")],
    "bench_decode": [("--smoke", r"float32 / float32 torch\.mm engine, whole: \d+\.\d+x")],
    "bench_episodes": [("--smoke", r"speed-up \d+\.\d+x \(median of 1\)")],
    "bench_fused_head": [("--smoke", r"tiny: peak resident whole \d+\.\d\d GiB, fused \d+\.\d\d GiB \(\d+\.\d\dx\); "
                                     r"train seconds of the step whole \d+\.\d, fused \d+\.\d \(\d+\.\d\dx\)")],
    "bench_grpo_step": [("--smoke", r"purerl grpo_step \(defaults\) +median +\d+\.\d ms/step +speed-up vs TRL "
                                    r"+\d+\.\d+x")],
    "bench_lora": [("--smoke", r"peak ratio full/LoRA \d+\.\d+")],
    "bench_placement": [("--smoke", r"split_collocate / split: \d+\.\d+x")],
    "bench_ray": [("--smoke", r"\| ray split \|( [\d.]+ \|){4} \d+\.\d+× \|.*\| sha256 \| \d+\.\d \|")],
    "bench_reward_deadline": [("--smoke", r"all hang, batch deadline 0\.4 s +\d+\.\d+ s +\d\.\d+×.*"
                                          r"reward children left behind: 0\n")],
    "bench_rollout": [("--smoke --bound --profile", r"purerl TorchEngine +median +\d+ new tok/s +ratio vs HF generate "
                                                    r"+\d+\.\d+")],
    "bench_sharded": [("--smoke", r"2 ranks: the lean sharded update runs \d+\.\d+x the HF-module FSDP2 "
                                  r"update's speed")],
    "bench_tinker_sampling": [("--smoke", r"\| at once \| \d+\.\d+ \| \d+\.\d \| \d+\.\d+x \|")],
    "bench_token_budget": [("--smoke", r"peak resident set of an update: fixed rows \d+ MiB")],
    "bench_update": [("--smoke --profile", r"purerl functional \+ donated fused AdamW +median +\d+\.\d+ ms +ratio vs "
                                           r"fused module +\d+\.\d+")],
    "distill_vs_grpo": [("{out}/seeds/seed_0 {out}/seeds/seed_1 --summary {out}/d.json --plot {out}/d.png",
                         r"distill +accuracy by step 0: \d+\.\d, 2: \d+\.\d.*distillation / GRPO to the target: ")],
    "routing_replay": [("--smoke", r"\| router\+0\.5 \| \d+\.\d% \| \d+\.\d% \| \d\.\d\de-\d\d \| \d\.\d\de-\d\d \| "
                                   r"\d+\.\d×")],
    "sampler_twin": [(f"--smoke --side {side} --out {{out}}/sampler", rf'"side": "{side}", "draw": 0, "responses": 16')
                     for side in ("purerl", "hf")],
    "seeds": [("--seeds 0-1 --out {out}/seeds --json {out}/seeds.json --plot {out}/seeds.png -- --tiny --steps 2 "
               "--eval-size 4 --max-new-tokens 8", r"2 seeds: gain [+-]\d+\.\d ± \d+\.\d \(SD\)")],
    "trl_twin": [("--smoke --out {out}/twin", r"seed 0: gain purerl [+-]\d+\.\d, TRL [+-]\d+\.\d points; .*"
                                              r"\(TRL / purerl \d+\.\d\dx\)")],
    "twin_summary": [("{out}/twin --json {out}/twin.json --plot {out}/twin.png",
                      r"purerl − TRL, means: [+-]\d+\.\d \(SE \d+\.\d\)")],
    "warmup_table": [("tiny:rl:0={out}/seeds/seed_0 tiny:rl:1={out}/seeds/seed_1 --json {out}/warmup.json",
                      r"\| tiny \| rl \| 1 \| [\d.e-]+ \| 0 \| \d+\.\d% → \d+\.\d% \| [+-]\d+\.\d \|.*"
                      r"tiny rl lr [\d.e-]+: 2 seed\(s\), gain [+-]\d")],
}
"""Each script's runs here: its arguments (``{out}``: this module's folder) and what its output must hold."""

READS = {"distill_vs_grpo": "seeds", "twin_summary": "trl_twin", "warmup_table": "seeds"}
"""The readers, and the script whose output each reads (two tiny GRPO runs stand in for ``distill_vs_grpo``'s
pair: it reads held-out accuracies and step times, whatever trained them; for ``warmup_table``, its ``rl`` arm)."""

COVERED = {"cookbook_curve": ("tests/test_cookbook_curve.py", "test_the_curve_is_drawn_and_its_ends_compared"),
           "panel": ("tests/test_panel.py", "test_the_panel_command_runs_a_task_and_writes_its_row_table_and_plot")}
"""Scripts another test runs at a tiny size, as a subprocess: that test."""

LIBRARIES = {"panel_tasks": ["panel"], "peak_memory": ["bench_lora", "bench_token_budget"]}
"""Modules the scripts import, and the scripts that run them (``panel`` passes ``panel_tasks``' reward to the job;
``--smoke`` measures each variant's peak memory through ``peak_memory``)."""


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """``ran(name)``: the finished runs of ``bench/<name>.py``'s :data:`SMOKE` commands, each run once in this
    module (what a reader reads first), their files in one folder."""
    out = tmp_path_factory.mktemp("bench")
    done: dict[str, list[subprocess.CompletedProcess]] = {}

    def ran_(name: str) -> list[subprocess.CompletedProcess]:
        if name not in done:
            if name in READS:
                ran_(READS[name])
            done[name] = [processes.run([sys.executable, str(BENCH / f"{name}.py"), *args.format(out=out).split()],
                                        timeout=600) for args, _ in SMOKE[name]]
        return done[name]

    return ran_


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in SCRIPTS if name not in COVERED and name not in LIBRARIES])
def test_each_script_runs_at_its_smoke_size_and_prints_its_result(name, ran):
    if name not in SMOKE:
        pytest.fail(f"bench/{name}.py has no smoke run: give it one in SMOKE (or name its test in COVERED)")
    for (args, expected), done in zip(SMOKE[name], ran(name)):
        output = f"{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
        assert done.returncode == 0, f"bench/{name}.py {args}: exit {done.returncode}\n{output}"
        assert re.search(expected, done.stdout, re.S), f"bench/{name}.py {args}: no {expected!r} printed\n{output}"


def test_every_script_runs_here_or_elsewhere():
    places = {name: [table for table in (SMOKE, COVERED, LIBRARIES) if name in table] for name in SCRIPTS}
    assert {name: len(found) for name, found in places.items() if len(found) != 1} == {}, \
        "each bench/*.py script needs exactly one place: SMOKE, COVERED or LIBRARIES"
    assert set(SMOKE) | set(READS.values()) <= set(SCRIPTS), "SMOKE or READS names a script that is gone"
    for name, (path, test) in COVERED.items():
        text = (ROOT / path).read_text()
        assert f"def {test}(" in text and f'"{name}.py"' in text, f"{path}::{test} no longer runs bench/{name}.py"
    for library, importers in LIBRARIES.items():
        for importer in importers:
            text = (BENCH / f"{importer}.py").read_text()
            assert re.search(rf"^(from {library} import|import {library}\b)", text, re.M), (importer, library)
            assert importer in SMOKE or importer in COVERED, f"bench/{library}.py's importer {importer} runs nowhere"


def test_the_smoke_flag_is_in_the_docstring_of_each_script_that_takes_it():
    for name, runs in SMOKE.items():
        if any("--smoke" in args.split() for args, _ in runs):
            doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text()))
            assert "--smoke" in doc, f"bench/{name}.py's docstring does not say how to run it small (--smoke)"


def test_the_shell_scripts_parse():
    for path in sorted(BENCH.glob("*.sh")):
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"bash -n {path.name}: {done.stderr}"
