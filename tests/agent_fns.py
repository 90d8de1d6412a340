"""Agent functions as users write them, for tests: plain code on an OpenAI client (``openai``),
the environments of :mod:`tests.episode_envs` played from the agent's side."""

import json
import random


def guess(client, task):
    """GuessEnv from the agent's side: guess a number from 1 to 100, told higher or lower, over at
    most 3 calls; the score is 1 for a right guess."""
    target = random.Random(task["seed"]).randint(1, 100)
    messages = [{"role": "user", "content": f"Guess my number ({task['ground_truth']})."}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        digits = "".join(c for c in text if c.isdigit())
        if (int(digits) if digits else 0) == target:
            return 1.0
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "higher" if (int(digits) if digits else 0) < target else "lower"}]
    return 0.0


async def guess_async(client, task):
    """:func:`guess` on an ``AsyncOpenAI`` client."""
    target = random.Random(task["seed"]).randint(1, 100)
    messages = [{"role": "user", "content": f"Guess my number ({task['ground_truth']})."}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        digits = "".join(c for c in reply.choices[0].message.content or "" if c.isdigit())
        if (int(digits) if digits else 0) == target:
            return 1.0
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "higher" if (int(digits) if digits else 0) < target else "lower"}]
    return 0.0


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. "3*4".
    """
    from purerl.episodes import calculate as exact

    return exact(expression)


def calculator(client, task):
    """The calculator with OpenAI tool calls: run every call the model makes, answer last; None
    lets the job's reward function score the answer."""
    from transformers.utils import get_json_schema

    tools = [get_json_schema(calculate)]
    messages = list(task["prompt"])
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                output = calculate(**json.loads(call.function.arguments))
            except Exception as err:  # noqa: BLE001 - the model reads the error
                output = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None


def forgetful(client, task):
    """Drops its history after the first call (a summarising agent): a new segment."""
    first = [{"role": "user", "content": "first"}]
    reply = client.chat.completions.create(model="policy", messages=first)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "start over"}])
    return 0.5 if reply.choices else 0.0


def broken(client, task):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent's own bug")


def silent(client, task):
    return 1.0


def hangs(client, task):
    """Calls once, then never returns (a hung tool, a deadlocked agent)."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    import time

    time.sleep(1e6)
