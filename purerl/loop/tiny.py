"""A tiny job for scripts, examples and tests: a model, engine and task that train in seconds."""

from types import SimpleNamespace

from purerl.data.math_problems import math_problems
from purerl.data.records import encode_prompts
from purerl.loop.sampling import BatchPlan
from purerl.loop.task import Task
from purerl.models import causal_lm_from_config
from purerl.rewards import lenient_math_reward
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.tiny import char_tokenizer, tiny_llama_config

__all__ = ["tiny_math"]


def tiny_math(problems: int = 32, *, seed: int = 0) -> SimpleNamespace:
    """What a script or test trains in seconds: a tiny random Llama (``model``, ``params``) with its
    character ``tokenizer``, an embedded ``engine`` over it, a ``task`` of ``problems`` procedural
    math problems scored by the lenient reward, and a ``plan`` for its batches (4 prompts a step, 4
    samples of at most 8 tokens each at temperature 1): a namespace of those six."""
    tokenizer = char_tokenizer()
    model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer)), seed=seed)
    records = math_problems(problems, seed=seed)
    prompts = encode_prompts(records, tokenizer, max_prompt_tokens=160, prompt_format="chat").ids
    task = Task(prompts, records, lenient_math_reward, tokenizer.decode)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    plan = BatchPlan(SamplingParams(max_new_tokens=8, temperature=1.0), prompts_per_step=4)
    return SimpleNamespace(model=model, params=params, tokenizer=tokenizer, engine=engine, task=task, plan=plan)
