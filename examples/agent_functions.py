"""Agents as they are written, trained by purerl unchanged (README: Agents behind an endpoint).

    python experiments/grpo_math.py --tiny --env examples/agent_functions.py:second_chance --max-turns 2
    python experiments/grpo_math.py --env examples/agent_functions.py:load_environment --max-turns 2   # verifiers

``second_chance`` is a plain function on an OpenAI client: it could run against any server that
speaks the OpenAI API. ``load_environment`` makes the same task as a verifiers ``MultiTurnEnv``
(``pip install 'purerl[verifiers]'``), with its rubric as the reward. In both, a wrong answer gets
one more try ("That is not right. Check your work and answer again."). The job serves the policy
behind an endpoint on loopback, hands each episode a client, and trains on the ids it sampled.
"""

from purerl.rewards import lenient_math_reward

RETRY = "That is not right. Check your work and answer again, ending with '#### <number>'."


def second_chance(client, task):
    """Ask; if the answer is wrong, say so and ask once more. The score: 1 for a right answer."""
    messages = list(task["prompt"])
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content or ""
        if lenient_math_reward(answer, task["ground_truth"]):
            return 1.0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": RETRY}]
    return 0.0


def load_environment():
    """``second_chance`` as a verifiers ``MultiTurnEnv`` (the classic API, ``verifiers==0.3.1``)."""
    import verifiers as vf

    class SecondChance(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [vf.UserMessage(content=RETRY)]

        @vf.stop
        async def answered(self, state, **kwargs) -> bool:
            turns = state["trajectory"]
            return bool(turns) and _right(turns[-1]["completion"], state["answer"])

    def correct(completion, answer, **kwargs) -> float:
        return float(_right(completion, answer))

    from datasets import Dataset

    from purerl.data.math_problems import math_problems

    # the environment's own rows (verifiers wants some); the job trains on its data's rows
    rows = [{"prompt": [dict(m) for m in r.messages], "answer": r.ground_truth} for r in math_problems(64, seed=0)]
    return SecondChance(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[correct]), max_turns=2)


def _right(completion, answer) -> bool:
    replies = [m for m in completion if m.get("role") == "assistant"]
    return bool(replies) and bool(lenient_math_reward(replies[-1].get("content") or "", answer))
