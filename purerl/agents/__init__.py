"""Agents as they are written: an OpenAI-compatible endpoint over the rollout engine that records
token-in/token-out episodes (:mod:`purerl.agents.endpoint`, :mod:`purerl.agents.traces`), requests
batched across agents (:mod:`purerl.agents.batching`), and plain agent functions played as
environments (:mod:`purerl.agents.play`)."""

from purerl.agents.batching import EngineBatcher, Request, Sampled
from purerl.agents.endpoint import Endpoint, tool_calls_of
from purerl.agents.play import AgentEnv, is_agent_function, run_agents
from purerl.agents.traces import EPISODE_HEADER, Call, Choice, ContextError, EpisodeTraces, same_messages

__all__ = ["EPISODE_HEADER", "AgentEnv", "Call", "Choice", "ContextError", "Endpoint", "EngineBatcher", "EpisodeTraces",
           "Request", "Sampled", "is_agent_function", "run_agents", "same_messages", "tool_calls_of"]
