"""Your own step, from purerl's stages: RLOO, the CISPO loss, an entropy bonus, a metric (tiny model, seconds)."""
import functools

from purerl.algo.kl_control import make_kl_controller
from purerl.assembly.stages import advantage_estimator, policy_loss
from purerl.assembly.tiny import tiny_math
from purerl.config.sections import RolloutConfig, TrainerConfig
from purerl.executors.local import LocalExecutor
from purerl.loop.sampling import BatchPlan
from purerl.loop.train import train
from purerl.optim import adamw
from purerl.state import TrainState
from purerl.step import ActorLoss, Batching, ExperienceSettings, Shaping, actor_update, make_experience, shape_rewards

loss, shaping = ActorLoss(policy_loss("cispo", clip_low=1.0), entropy_coeff=1e-3), Shaping(advantage_estimator("rloo"))

def my_step(state, rollout, rewards, *, policy, value_and_grad, optimizer, kl_controller):
    experience = make_experience(state, rollout, rewards, policy=policy, settings=ExperienceSettings())
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, shaping=shaping)
    params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy, loss=loss,
        batching=Batching(), optimizer=optimizer, rng=state.rng, value_and_grad=value_and_grad)
    metrics |= actor_metrics | {"my/solved_frac": float((experience.scores >= 1).float().mean())}
    return state.advance(policy=params, policy_opt=opt_state, kl=kl_state, rng=state.rng.next()), metrics

tiny, optimizer, kl = tiny_math(32), adamw(1e-3), make_kl_controller("fixed")
executor = LocalExecutor(functools.partial(my_step, optimizer=optimizer, kl_controller=kl), tiny.model, tiny.engine)
plan = BatchPlan(RolloutConfig(max_new_tokens=8, temperature=1.0), prompts_per_step=4)
state = train(executor.start(TrainState.initial(tiny.params, optimizer, kl)), executor=executor, task=tiny.task,
              plan=plan, trainer=TrainerConfig(steps=3, progress=False), run_dir=(out := "runs/custom_step"))
print(f"trained {state.step} steps; metrics in {out}/metrics.jsonl")
