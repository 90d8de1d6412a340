"""LLM-as-judge rewards: a local causal LM reads a rubric prompt and writes a verdict.

The judge's prompt is ``template`` filled with the task's ``{question}``, the reference
``{answer}`` and the policy's ``{response}``, rendered by the judge tokenizer's chat template as
one user message. Its verdict is sampled greedily by a rollout engine (the embedded one: the same
machinery as the policy's rollouts), all of a step's responses in one batched call, under the
reward deadline (``timeout`` seconds for the call: rows still decoding then are stopped). The
verdict is the first match of ``pattern`` (its first group a number), bounded to ``[low, high]``
and mapped to ``[0, 1]``. A verdict without a match, or stopped by the deadline, is a sample
error: counted with the reward errors, its message kept, the response scored ``penalty``.
"""

import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from purerl.rewards.scoring import Scores
from purerl.rewards.verdicts import JudgeSettings, verdict_value
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["Judge"]

class Judge:
    """A judge model behind ``engine`` (synced once: its weights never change), its ``tokenizer``
    rendering the rubric; ``__call__`` scores a batch (:class:`~purerl.rewards.scoring.Scores`,
    values in ``[0, 1]``, ``penalty`` for sample errors); thread-safe."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, settings: JudgeSettings = JudgeSettings(),
                 name: str = "judge") -> None:
        for field in ("{question}", "{response}"):
            if field not in settings.template:
                raise ValueError(f"{name}: the judge's prompt has no {field} to fill")
        if settings.high <= settings.low:
            raise ValueError(f"{name}: the verdict's bounds [{settings.low}, {settings.high}] are empty")
        self.engine, self.tokenizer, self.settings, self.name = engine, tokenizer, settings, name
        self.calls = 0
        self._lock = threading.Lock()  # asynchronous generators share the judge: one call at a time

    def prompt_ids(self, question: str, response: str, answer: str) -> list[int]:
        text = fill(self.settings.template, question=question, response=response, answer=answer)
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                 add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def __call__(self, questions: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> Scores:
        settings = self.settings
        prompts = [self.prompt_ids(q, r, a) for q, r, a in zip(questions, responses, answers, strict=True)]
        sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, n=1)
        deadline = time.monotonic() + settings.timeout
        options = {"interrupt": lambda: time.monotonic() > deadline} if self.engine.kind.interruptible else {}
        with self._lock:
            rollout = self.engine.generate(prompts, sampling, RngState(0), **options)
            self.calls += 1
        tokens, masks = rollout.sequences.responses().tolist(), rollout.sequences.response_mask.tolist()
        late = time.monotonic() > deadline
        values, messages, errors, timeouts = [], [], 0, 0
        for row, (ids, mask) in enumerate(zip(tokens, masks)):
            text = self.tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
            value = verdict_value(text, settings)
            if value is None:
                if late:
                    timeouts += 1
                    messages.append(f"{self.name}: sample {row}: no verdict within the judge's {settings.timeout:g} s")
                else:
                    errors += 1
                    messages.append(f"{self.name}: sample {row}: no verdict matching {settings.pattern!r} in "
                                    f"{text[-120:]!r}")
                value = settings.penalty
            values.append(value)
        return Scores(values, errors, timeouts, messages)


def fill(template: str, **fields: str) -> str:
    """``template`` with each ``{name}`` of ``fields`` replaced, every other brace kept as written (a prompt
    may show JSON such as ``{"score": N}``; ``{{`` and ``}}`` still read as one brace)."""
    parts = re.split(r"(\{(?:" + "|".join(map(re.escape, fields)) + r")\})", template)
    return "".join(str(fields[p[1:-1]]) if i % 2 else p.replace("{{", "{").replace("}}", "}")
                   for i, p in enumerate(parts))
