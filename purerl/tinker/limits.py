"""The most one request may cost the Tinker server: settings of ``python3 -m purerl.tinker``, one flag each.

- ``max_samples`` (``--max-samples``): ``num_samples`` of one ``sample`` request;
- ``max_tokens`` (``--max-tokens``): a ``sample`` request's prompt length and its ``max_tokens``,
  each (``max_tokens`` None: the room left in the context, at most this), and the tokens of one
  ``forward_backward`` datum;
- ``lora_rank`` (``--lora-rank``): ``lora_config.rank`` of a new model, and the rank of a
  checkpoint loaded into one;
- ``max_batch_tokens`` (``--max-batch-tokens``): the tokens of one ``forward_backward`` call, its
  datums together (its logits, tokens × vocabulary, are what a training call costs);
- ``queue_depth`` (``--queue-depth``): calls waiting or running at once; the next is answered 429,
  which the SDK retries after a pause.

Each is a whole number, at least 1 (``ValueError`` at construction naming the flag). A request past
one raises :class:`OverLimit` naming the limit and its flag: answered 400 at once where the call is
answered at once, else (a training call, which must keep its turn in its model's call order) as
that call's failed future.
"""

import attrs

__all__ = ["Limits", "OverLimit", "flag"]


class OverLimit(ValueError):
    """A request past one of the server's :class:`Limits`, or outside what any server takes (one line)."""


def flag(setting: str) -> str:
    """The command-line flag of the :class:`Limits` field ``setting``."""
    return "--" + setting.replace("_", "-")


@attrs.frozen
class Limits:
    """The bounds (module docstring), checked at construction."""

    max_samples: int = 128
    max_tokens: int = 8192
    lora_rank: int = 128
    queue_depth: int = 256
    max_batch_tokens: int = 32768

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(Limits):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag(field.name)} must be a whole number of at least 1, got {value!r}")

    def check_samples(self, n: int) -> None:
        """``n`` samples of one request: 1 to ``max_samples``."""
        if n < 1:
            raise OverLimit(f"num_samples must be at least 1, got {n}")
        if n > self.max_samples:
            raise OverLimit(f"num_samples {n}: this server samples at most {self.max_samples} per request "
                            f"(--max-samples)")

    def check_tokens(self, what: str, n: int) -> None:
        """``what`` (a prompt's length, ``max_tokens``, a datum's length) of ``n`` tokens: at most ``max_tokens``."""
        if n > self.max_tokens:
            raise OverLimit(f"{what} {n}: this server takes at most {self.max_tokens} tokens (--max-tokens)")

    def check_batch(self, n: int) -> None:
        """A ``forward_backward`` call of ``n`` tokens, its datums together: at most ``max_batch_tokens``."""
        if n > self.max_batch_tokens:
            raise OverLimit(f"forward_backward of {n} tokens: this server takes at most {self.max_batch_tokens} "
                            f"tokens a call (--max-batch-tokens); send the batch in smaller calls")

    def check_rank(self, what: str, rank: int) -> None:
        """A LoRA ``rank`` (of ``what``): 1 to ``lora_rank``."""
        if rank < 1:
            raise OverLimit(f"{what} must be at least 1, got {rank}")
        if rank > self.lora_rank:
            raise OverLimit(f"{what} {rank}: this server serves LoRA ranks up to {self.lora_rank} (--lora-rank)")
