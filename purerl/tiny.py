"""Tiny random models and a character tokenizer, built offline for tests, benchmarks and demos."""

import string
from typing import Any

import torch

__all__ = ["tiny_llama_config", "tiny_causal_lm", "char_tokenizer", "random_sequences"]

_SPECIALS = ["<pad>", "<eos>", "<bos>"]
_CHATML = ["<|im_start|>", "<|im_end|>"]


def char_tokenizer(chatml: bool = False) -> Any:
    """A left-padding Hugging Face fast tokenizer with one token per printable character.

    Ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, then letters, digits, punctuation, space and
    newline. It has a minimal chat template (``role: content`` lines) so chat-formatted data
    works with it; ``chatml=True`` gives SmolLM2's (ChatML) template instead, with ``<|im_start|>``
    and ``<|im_end|>`` as the last two ids and ``<|im_end|>`` as EOS, as SmolLM2-Instruct has.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    chat = _CHATML if chatml else []
    vocab = {tok: i for i, tok in enumerate(_SPECIALS + list(chars) + chat)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token=chat[1] if chatml else "<eos>", bos_token="<bos>",
        padding_side="left", additional_special_tokens=chat or None,
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}" if chatml else
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def tiny_llama_config(vocab_size: int = 128, hidden_size: int = 32, layers: int = 2, **overrides: Any) -> Any:
    """A Llama config (SmolLM2's architecture) small enough for CPU tests; tied embeddings."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_causal_lm(config: Any = None, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", activation_checkpointing: bool = False,
                   **overrides: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A randomly initialised ``(CausalLM, params)`` (deterministic in ``seed``) of the HF ``config``,
    by default the tiny Llama (:func:`tiny_llama_config` with ``overrides``): the model every test,
    benchmark and demo builds (the tests through their ``tiny_lm`` fixture). A few milliseconds."""
    from purerl.models import causal_lm_from_config

    if config is None:
        config = tiny_llama_config(**overrides)
    elif overrides:
        raise TypeError(f"tiny_causal_lm: overrides {sorted(overrides)} apply to the tiny Llama, not to a config given")
    return causal_lm_from_config(config, seed=seed, dtype=dtype, device=device,
                                 activation_checkpointing=activation_checkpointing)


def random_sequences(batch: int, prompt_len: int, response_len: int, vocab_size: int, *, seed: int = 0) -> Any:
    """Random :class:`~purerl.batch.Sequences` with left-padded prompts and right-padded responses."""
    from purerl.batch import Sequences

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, prompt_len + response_len), generator=g)
    prompt_pad = torch.randint(0, prompt_len, (batch,), generator=g)
    response_len_i = torch.randint(1, response_len + 1, (batch,), generator=g)
    pos = torch.arange(prompt_len + response_len)
    attention = (pos[None] >= prompt_pad[:, None]) & (pos[None] < prompt_len + response_len_i[:, None])
    ids = torch.where(attention, ids, torch.zeros_like(ids))
    return Sequences(ids, attention, attention[:, prompt_len:].clone())

