"""The README's custom step example runs as written."""

import functools
import re
from pathlib import Path

import torch

from purerl.algo.kl_control import make_kl_controller
from purerl.executors import LocalExecutor
from purerl.model import causal_lm_from_config
from purerl.optim import adamw
from purerl.rollout.engine import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState, TrainState
from purerl.tiny import tiny_llama_config
from purerl.tree import tree_clone, tree_equal

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_custom_step_runs_on_the_local_executor_and_updates_the_policy():
    section = README.read_text().split("## Your own step function", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    my_step = namespace["my_step"]

    model, params = causal_lm_from_config(tiny_llama_config(), seed=0)
    optimizer = adamw(1e-3)
    kl_controller = make_kl_controller("fixed")
    state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(), rng=RngState(0))
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(state.policy, 0)
    rollout = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, n=4), RngState(1))
    scores = torch.arange(8, dtype=torch.float32) % 3
    before = tree_clone(state.policy)
    executor = LocalExecutor(functools.partial(my_step, optimizer=optimizer, kl_controller=kl_controller),
                             model, engine)
    new_state, metrics = executor.step(state, rollout, scores)
    assert new_state.step == 1 and not tree_equal(new_state.policy, before)
    assert "actor/entropy" in metrics and "critic/advantages/mean" in metrics
