"""Token-in/token-out: a conversation's token ids grown turn by turn, never re-tokenised.

The ids of an episode are the chat template's rendering of its first messages, then, turn by turn,
the ids the model sampled and the *delta ids* of the messages the environment answers with.
Sampled ids are kept as sampled: decoding them and tokenising the text again can give other ids
(BPE merges across the boundary), and the log-probs would then belong to tokens never sampled.

Delta ids come from the template itself, rendered on a synthetic context (``user: x``,
``assistant: x``) with and without the new messages: the suffix is what the template adds after an
assistant turn — its closing (ChatML's ``<|im_end|>\\n``), the new messages, and the generation
prompt of the next assistant turn. When the model sampled the template's end-of-turn token itself
(it ended its turn with EOS = ``<|im_end|>``), that token is already in the ids (and in the loss)
and the delta starts after it; when the turn ended on a stop string or the length limit, the delta
closes the turn (the end-of-turn token is then an observation token, out of the loss).

A template that rewrites earlier turns when later ones are added (e.g. one that strips earlier
``<think>`` blocks) is not append-only, so no delta exists: :class:`ChatCodec` refuses it with a
:class:`TemplateError` when built, naming what differs, rather than train on ids the model
never saw.
"""

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatCodec", "Message", "TemplateError"]

Message = Mapping[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (as ``apply_chat_template`` takes it)."""

_PROBE = "x"  # the synthetic contents: one short word every tokenizer has


class TemplateError(ValueError):
    """The chat template cannot grow a conversation by appending (not append-only)."""


class ChatCodec:
    """Initial and delta ids of a conversation under ``tokenizer``'s chat template.

    ``closing``: the ids the template puts after an assistant message's content (ChatML:
    ``<|im_end|>``, ``\\n``); ``end_of_turn``: its first id, when the model can sample it (it is
    one of ``eos_token_ids``), else None.
    """

    def __init__(self, tokenizer: Any, *, eos_token_ids: Sequence[int] = ()) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(f"{type(tokenizer).__name__} has no chat template: multi-turn episodes render "
                                "their messages with one")
        self.tokenizer = tokenizer
        user, assistant = {"role": "user", "content": _PROBE}, {"role": "assistant", "content": _PROBE}
        turn = self._render([user, assistant], generation_prompt=False)
        content_end = self._content_end([user], turn)
        self.closing: list[int] = turn[content_end:]
        eos = set(eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.end_of_turn: int | None = self.closing[0] if self.closing and self.closing[0] in eos else None
        self.turn_end_id: int = self.end_of_turn if self.end_of_turn is not None else tokenizer.eos_token_id
        """What ends a turn the model finishes: the template's end-of-turn token, else EOS."""
        self._context, self._context_ids = [user, assistant], turn
        self.delta_ids([{"role": "user", "content": _PROBE}], last_sampled=None)  # append-only, or refused now

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool, **kwargs: Any) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=generation_prompt,
                                                 **kwargs)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # a BatchEncoding (newer transformers)
            ids = ids["input_ids"]
        return list(ids)

    def _content_end(self, before: list[Message], turn: list[int]) -> int:
        """Where the assistant's content ends in ``turn``: the generation prompt after ``before``,
        then the content's ids, must be how the template starts the assistant turn."""
        prompt = self._render(before, generation_prompt=True)
        content = self.tokenizer.encode(_PROBE, add_special_tokens=False)
        end = len(prompt) + len(content)
        if turn[: len(prompt)] != prompt or turn[len(prompt):end] != content:
            raise TemplateError("the chat template does not render an assistant turn as its generation prompt "
                                "followed by the content: sampled ids could not be appended to a prompt")
        return end

    def initial_ids(self, messages: Sequence[Message], **template_kwargs: Any) -> list[int]:
        """The ids of the first messages and the generation prompt (``template_kwargs``, e.g.
        ``tools=…``, go to ``apply_chat_template``)."""
        return self._render(messages, generation_prompt=True, **template_kwargs)

    def delta_ids(self, messages: Sequence[Message], *, last_sampled: int | None) -> list[int]:
        """The ids to append after an assistant turn for the environment's ``messages``, through
        the next generation prompt. ``last_sampled``: the turn's last sampled id; when it is
        :attr:`end_of_turn`, the delta starts after it. Raises :class:`TemplateError` when the
        template is not append-only."""
        full = self._render([*self._context, *messages], generation_prompt=True)
        if full[: len(self._context_ids)] != self._context_ids:
            at = next(i for i, (a, b) in enumerate(zip(full, self._context_ids)) if a != b)
            raise TemplateError(
                "the chat template is not append-only: adding messages after an assistant turn changes the ids "
                f"before them (first at position {at}: {self.tokenizer.decode(self._context_ids[at:at + 8])!r} becomes "
                f"{self.tokenizer.decode(full[at:at + 8])!r}); templates that rewrite earlier turns (e.g. strip "
                "earlier <think> blocks) cannot train multi-turn episodes token-in/token-out")
        ended = self.end_of_turn is not None and last_sampled == self.end_of_turn
        closing = self.closing[1:] if ended else self.closing
        return closing + full[len(self._context_ids):]
