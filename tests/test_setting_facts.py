"""A setting's facts about resume and replay live on the setting (:mod:`purerl.setting_facts`): a section's
fact covers its keys, a key's own fact wins, and the lists resume and replay read are made of them."""

from purerl.config.job import JobConfig
from purerl.replay_settings import REPLAYABLE, WHERE
from purerl.run import MAY_CHANGE_ON_RESUME
from purerl.setting_facts import COUNTERFACTUAL, MAY_CHANGE, STATE, fact_of, keys_where


def test_a_sections_fact_covers_its_keys_and_a_keys_own_fact_wins():
    assert fact_of(JobConfig, "actor.clip_low", "replay") == COUNTERFACTUAL  # the actor section's
    assert fact_of(JobConfig, "actor.lora_rank", "replay") == STATE  # its own: the state's shape
    assert fact_of(JobConfig, "rollout.n", "replay") is None  # what was sampled: refused
    assert fact_of(JobConfig, "executor.placement", "resume") == MAY_CHANGE  # the executor section's
    assert fact_of(JobConfig, "actor.lr", "resume") == MAY_CHANGE and fact_of(JobConfig, "actor.lr", "replay")


def test_resume_and_replay_read_the_settings_facts():
    assert MAY_CHANGE_ON_RESUME == set(keys_where(JobConfig, "resume", MAY_CHANGE))
    assert {"trainer.steps", "actor.lr", "health.patience", "executor.train_ranks"} <= MAY_CHANGE_ON_RESUME
    assert "rollout.n" not in MAY_CHANGE_ON_RESUME and "data.seed" not in MAY_CHANGE_ON_RESUME
    assert REPLAYABLE == ("algorithm.", "actor.", "critic.", "distill.")
    assert set(WHERE) == {"trainer.threads", "model.device"}
