"""The stop rule (:mod:`purerl.stop_rule`) as a pure function of metric rows: what stops a run, the streaks
it carries, the lines it prints, and a failed sync check that names the setting the step was given."""

import attrs

from purerl.stop_rule import StopLimits, StopState, flagged, fold, observe, outputs_stop

LIMITS = StopLimits(max_rejected_steps=2, max_failed_reward_steps=3)
REJECTED = {"actor/rejected_updates": 1.0, "actor/nonfinite_loss": 1.0}


def _run(rows):
    """Each row's verdict, the rows observed in order from the start (rows are ``{"step": k, ...}``)."""
    state, verdicts = StopState(), []
    for row in rows:
        state, verdict = observe(LIMITS, state, row["step"], row)
        verdicts.append(verdict)
    return state, verdicts


def test_rejected_updates_stop_the_run_at_the_limit_in_a_row_and_a_good_step_resets_the_streak():
    state, verdicts = _run([{"step": 1, **REJECTED}, {"step": 2}, {"step": 3, **REJECTED}, {"step": 4, **REJECTED}])
    assert [v.stop for v in verdicts[:3]] == [None] * 3
    assert verdicts[0].lines == ("step 1: update rejected (actor/rejected_updates): non-finite loss (1 in a row)",)
    assert verdicts[1].lines == () and verdicts[3].lines[0].endswith("(2 in a row)")
    stop = verdicts[3].stop
    assert (stop.step, stop.kind, stop.bad_from) == (4, "rejected", 4)
    assert stop.reason == "2 steps in a row had their update rejected (non-finite loss: trainer.max_rejected_steps 2)"
    assert state == StopState(2, 0)


def test_steps_whose_reward_calls_all_failed_stop_the_run_at_the_limit_and_say_each_one():
    rows = [{"step": k, "reward/all_failed": 1.0} for k in (1, 2, 3)]
    _, verdicts = _run(rows)
    assert [v.stop is None for v in verdicts] == [True, True, False]
    assert verdicts[1].lines == ("step 2: warning: every reward call failed or timed out (2 step(s) in a row)",)
    assert verdicts[2].stop.reason.startswith("every reward call failed or timed out in 3 steps in a row")
    assert verdicts[2].stop.bad_from is None  # the weights are sound


def test_weights_that_diverged_stop_at_once_naming_the_first_bad_step():
    _, (diverged,) = _run([{"step": 5, "actor/diverged": 1.0, "actor/param_norm_change": 1e9}])
    assert diverged.stop.reason.startswith("the update left weights of another scale: actor's norm changed ×1e+09")
    assert diverged.stop.bad_from == 5
    rollout = outputs_stop(7, {"rollout/nonfinite_logprobs": 3.0})
    assert rollout.bad_from == 6 and "the weights after step 6 give non-finite log-probs (3 tokens" in rollout.reason
    assert outputs_stop(7, {"val/nonfinite_logprobs": 1.0}).bad_from == 7
    assert outputs_stop(7, {"rollout/nonfinite_logprobs": 0.0}) is None


def test_a_resumed_run_carries_the_streaks_of_the_rows_it_logged():
    rows = [{"step": 1, **REJECTED}, {"step": 2, "reward/all_failed": 1.0, **REJECTED}]
    assert fold(LIMITS, rows[:1]) == StopState(1, 0)
    _, verdict = observe(LIMITS, fold(LIMITS, rows[:1]), 2, rows[1])
    assert verdict.stop is not None and verdict.stop.kind == "rejected"


def test_the_report_reads_the_flags_the_rule_reads():
    row = {"actor/diverged": 1.0, "critic/rejected_updates": 0.0, "actor/sync_failed": "nan", "actor/x": 1.0}
    assert flagged(row) == ["actor/diverged"]


def test_a_custom_steps_failed_sync_check_names_the_tolerance_it_was_given():
    """A user's step with ``ActorLoss(sync_tolerance=0.005)`` on a rollout that misstates its temperature: the
    stop names that setting (the main job's ``executor.sync_canary`` only sets it there)."""
    from purerl.algo import PolicyLossSettings
    from purerl.algo.policy_loss import POLICY_LOSSES
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState
    from purerl.step import ActorLoss
    from tests.test_step import PROMPTS, _guide_step, _scores, _setup

    model, _, _, state, engine, _ = _setup()
    engine.sync(state.policy, state.step)
    rollout = attrs.evolve(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=4), RngState(1)),
                           temperature=1.0)
    loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings()), sync_tolerance=0.005)
    _, metrics = _guide_step(state, rollout, _scores(rollout), policy=model, loss=loss)
    _, verdict = observe(LIMITS, StopState(), 1, metrics)
    assert verdict.stop.kind == "sync" and verdict.stop.bad_from is None
    assert "over the step's ActorLoss(sync_tolerance=0.005)" in verdict.stop.reason
