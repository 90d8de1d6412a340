"""verifiers environments trained as they are: a ``vf.Environment`` played as an agent function.

``env.name`` may name a verifiers environment (``module:load_environment``, a function that makes
one, or ``module:env``, the object). Each episode is one ``env.run_rollout`` (the classic
verifiers API: ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, … — ``import verifiers as vf``,
pinned in the ``verifiers`` extra) against the job's endpoint through an ``AsyncOpenAI`` client
of its own, so the endpoint records its ids token-in/token-out; its rubric's reward is the
episode's score. The rows are the job's data: a row's messages, after the environment's
``system_prompt`` when it has one, are the rollout's prompt, its ground truth the ``answer``, its
other fields (``data_source`` among them) the ``info``. Sampling is the job's (the rollout asks
for nothing else). A rollout that ends in an error (verifiers records it in the state) is an
episode error, its message kept.
"""

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["is_verifiers", "is_verifiers_env", "verifiers_agent", "verifiers_env_of"]


def is_verifiers_env(value: Any) -> bool:
    """Whether ``value`` is a verifiers environment (an object with ``run_rollout`` and a ``rubric``
    from the ``verifiers`` package)."""
    return type(value).__module__.startswith("verifiers") or any(
        c.__module__.startswith("verifiers") for c in type(value).__mro__[1:]) and hasattr(value, "run_rollout")


def is_verifiers(found: Any) -> bool:
    """Whether ``found`` is a verifiers environment or its maker: a function named ``load_environment``
    (verifiers' convention for an environment module's entry point)."""
    return is_verifiers_env(found) or (inspect.isfunction(found) and found.__name__ == "load_environment")


def verifiers_env_of(found: Any) -> Any:
    """The verifiers environment ``found`` is, or makes (its ``load_environment``, called without
    arguments); a one-line ``ValueError`` when what it makes is not one."""
    if is_verifiers_env(found):
        return found
    made = found()
    if not is_verifiers_env(made):
        raise ValueError(f"load_environment() returned a {type(made).__name__}, not a verifiers Environment")
    return made


def verifiers_agent(env: Any, model: str = "policy") -> Callable[..., Any]:
    """The async agent function (:mod:`purerl.agents.play`) of verifiers environment ``env``."""
    import verifiers as vf

    async def run(client: Any, task: dict[str, Any]) -> float:
        prompt = list(task["prompt"])
        system = getattr(env, "system_prompt", None)
        if system and not (prompt and prompt[0].get("role") == "system"):
            prompt = [{"role": "system", "content": system}, *prompt]
        info = {k: v for k, v in task.items() if k not in ("prompt", "ground_truth", "seed")}
        row = {"prompt": prompt, "answer": task["ground_truth"], "info": info, "example_id": task["seed"]}
        output = await env.run_rollout(row, vf.OpenAIChatCompletionsClient(client), model, {})
        if output.get("error"):
            raise RuntimeError(f"verifiers rollout failed: {output['error']}")
        return output["reward"]

    run.__qualname__ = f"verifiers:{type(env).__name__}"
    return run
