"""Your own step, from purerl's stages: RLOO, the CISPO loss, an entropy bonus, a metric (tiny model, seconds)."""
import functools

from purerl.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PolicyLossSettings, make_kl_controller
from purerl.executors.local import LocalExecutor
from purerl.loop.tiny import tiny_math
from purerl.loop.train import train
from purerl.loop_settings import TrainerSettings
from purerl.optim import adamw
from purerl.state import TrainState
from purerl.step import ActorLoss, Batching, ExperienceSettings, Shaping, actor_update, make_experience, shape_rewards

loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings(clip_low=1.0)), entropy_coeff=1e-3)
shaping = Shaping(ADVANTAGE_ESTIMATORS["rloo"].bound())

def my_step(state, rollout, rewards, *, policy, value_and_grad, optimizer, kl_controller):
    experience = make_experience(state, rollout, rewards, policy=policy, settings=ExperienceSettings())
    batch, kl_state, metrics = shape_rewards(experience, state.kl, kl_controller, shaping=shaping)
    params, opt_state, actor_metrics = actor_update(state.policy, state.policy_opt, batch, policy=policy, loss=loss,
        batching=Batching(), optimizer=optimizer, rng=state.rng, value_and_grad=value_and_grad)
    metrics |= actor_metrics | {"my/solved_frac": float((experience.scores >= 1).float().mean())}
    return state.advance(policy=params, policy_opt=opt_state, kl=kl_state, rng=state.rng.next()), metrics

tiny, optimizer, kl = tiny_math(32), adamw(1e-3), make_kl_controller("fixed")
executor = LocalExecutor(functools.partial(my_step, optimizer=optimizer, kl_controller=kl), tiny.model, tiny.engine)
state = train(executor.start(TrainState.initial(tiny.params, optimizer, kl)), executor=executor, task=tiny.task,
              plan=tiny.plan, trainer=TrainerSettings(steps=3, progress=False), run_dir=(out := "runs/custom_step"))
print(f"trained {state.step} steps; metrics in {out}/metrics.jsonl")
