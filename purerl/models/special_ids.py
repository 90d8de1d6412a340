"""The token ids that end a response and pad a batch, looked up once for every engine a model gets (the
main job's, the Tinker server's and the model check's)."""

from typing import Any

import attrs

__all__ = ["SpecialIds", "special_ids"]


@attrs.frozen
class SpecialIds:
    """``eos``: every id that ends a response (sorted; none for a model that names none); ``pad``: the id padding
    is filled with (it is masked out of every forward, so any id will do where a model has none)."""

    eos: tuple[int, ...]
    pad: int


def special_ids(config: Any, tokenizer: Any = None) -> SpecialIds:
    """The ids of a model with HF ``config`` (and its ``tokenizer``, where there is one): the tokenizer's EOS and
    each EOS the config lists (an int or a list); padding by the tokenizer's pad, else its EOS, else the config's
    pad, else the first EOS, else 0."""
    listed = getattr(config, "eos_token_id", None)
    eos = {*([listed] if isinstance(listed, int) else (listed or [])),
           *([tokenizer.eos_token_id] if tokenizer is not None else [])}
    eos = tuple(sorted(int(e) for e in eos if e is not None))
    candidates = ((tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else ()) + (
        getattr(config, "pad_token_id", None), *eos[:1], 0)
    return SpecialIds(eos, int(next(c for c in candidates if c is not None)))
