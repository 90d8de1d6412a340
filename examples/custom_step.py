"""Your own step, from purerl's stages: RLOO, the CISPO loss, an entropy bonus, a metric (tiny model, seconds)."""
import functools

from purerl.algo.kl_control import make_kl_controller
from purerl.config.job import ActorConfig, AlgorithmConfig, DataConfig, JobConfig, RolloutConfig, TrainerConfig
from purerl.data.cursor import DataCursor
from purerl.data.math_problems import math_problems
from purerl.data.records import encode_prompts
from purerl.executors.local import LocalExecutor
from purerl.loop.sampling import Task
from purerl.loop.train import train
from purerl.models import causal_lm_from_config
from purerl.optim import adamw
from purerl.rewards import lenient_math_reward
from purerl.rollout.backends.torch import TorchEngine
from purerl.state import RngState, TrainState
from purerl.step import actor_update, make_experience, shape_rewards
from purerl.tiny import char_tokenizer, tiny_llama_config

config = JobConfig(algorithm=AlgorithmConfig(adv_estimator="rloo"), trainer=TrainerConfig(steps=3, progress=False),
                   actor=ActorConfig(policy_loss="cispo", clip_low=1.0, entropy_coeff=1e-3),
                   rollout=RolloutConfig(max_new_tokens=8, temperature=1.0), data=DataConfig(prompts_per_step=4))

def my_step(state, rollout, rewards, *, policy, value_and_grad, optimizer, kl_controller):
    experience = make_experience(state, rollout, rewards, policy=policy, config=config)
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, config=config)
    params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy, config=config,
                                                    optimizer=optimizer, rng=state.rng, value_and_grad=value_and_grad)
    metrics |= actor_metrics | {"my/solved_frac": float((experience.scores >= 1).float().mean())}
    return state.advance(policy=params, policy_opt=opt_state, kl=kl_state, rng=state.rng.next()), metrics

tokenizer, (optimizer, kl) = char_tokenizer(), (adamw(1e-3), make_kl_controller("fixed"))
model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer)), seed=0)
task = Task(encode_prompts(records := math_problems(32, seed=0), tokenizer, max_prompt_tokens=160).ids, records,
            lenient_math_reward, tokenizer.decode)
executor = LocalExecutor(functools.partial(my_step, optimizer=optimizer, kl_controller=kl), model,
                         TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0))
state = TrainState(policy=params, policy_opt=optimizer.init(params), kl=kl.init(), rng=RngState(0), data=DataCursor(0))
state = train(executor.start(state), executor=executor, task=task, config=config, run_dir=(out := "runs/custom_step"))
print(f"trained {state.step} steps; metrics in {out}/metrics.jsonl")
