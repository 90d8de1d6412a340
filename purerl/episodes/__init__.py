"""Multi-turn episodes: environments with explicit state (:mod:`~purerl.episodes.env`), tools
(:mod:`~purerl.episodes.tools`), token-in/token-out ids (:mod:`~purerl.episodes.codec`), steps under
deadlines (:mod:`~purerl.episodes.stepping`) and the turn-by-turn sampler that makes a rollout of
them (:mod:`~purerl.episodes.rollout`, which imports torch: import it directly). This package
imports no torch, so the reward processes that run environment steps stay light."""

from purerl.episodes.codec import ChatCodec, Message, TemplateError
from purerl.episodes.env import Env, SingleTurn, StepResult
from purerl.episodes.tools import Tool, ToolEnv, calculate

__all__ = ["ChatCodec", "Env", "Message", "SingleTurn", "StepResult", "TemplateError", "Tool", "ToolEnv", "calculate"]
