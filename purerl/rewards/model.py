"""A learned reward model as a scoring stage: a local HF sequence-classification model with one
label, scoring prompt + response.

:class:`RewardModel` reads the text as the tokenizer's chat template renders a user turn (the
prompt) and an assistant turn (the response) when the tokenizer has a template, else as the plain
concatenation ``prompt + response``. Sequences are right-padded (their positions start at 0 whatever
the batch, so a score does not depend on the batch it is in) and each is scored at its last real
token, without gradients. :func:`save_tiny_reward_model` writes a tiny random one for tests and docs.
"""

from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["RewardModel", "save_tiny_reward_model"]


class RewardModel:
    """A local HF ``AutoModelForSequenceClassification`` folder with ``num_labels == 1``, and its
    tokenizer. ``device``/``dtype``: where and in what precision it runs (``dtype`` also as a name,
    e.g. ``"bfloat16"``); ``max_length``: longer texts keep their last ``max_length`` tokens."""

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32, max_length: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"RewardModel: {self.path} is not a local HF model folder (no config.json)")
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"RewardModel: unknown dtype {dtype!r}")
            dtype = getattr(torch, dtype)
        labels = AutoConfig.from_pretrained(self.path).num_labels
        if labels != 1:
            raise ValueError(f"RewardModel {self.path}: the model has {labels} labels; a reward model has one "
                             "score (num_labels=1): is it a sequence-classification reward model?")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.device, self.max_length = torch.device(device), max_length
        tok = self.tokenizer
        self.pad_token_id = next((i for i in (tok.pad_token_id, tok.eos_token_id, self.model.config.pad_token_id)
                                  if i is not None), 0)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.pad_token_id
        # a token for an empty text (a sequence needs one position to be scored at)
        self.empty_id = next((i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None), self.pad_token_id)

    @property
    def templated(self) -> bool:
        """Whether texts are rendered with the tokenizer's chat template."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def text(self, prompt: str, response: str) -> str:
        """What the model reads for one (prompt, response) pair."""
        if self.templated:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return prompt + response

    def encode(self, prompt: str, response: str) -> list[int]:
        """Token ids of :meth:`text` (the template writes its own special tokens; plain text gets
        the tokenizer's), truncated on the left to ``max_length``."""
        ids = list(self.tokenizer(self.text(prompt, response), add_special_tokens=not self.templated)["input_ids"])
        if self.max_length is not None:
            ids = ids[-self.max_length:]
        return ids or [self.empty_id]

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        """The model's logit for each ``prompt + response``: a float32 CPU tensor ``[n]``, in order.
        Batches hold texts of similar length (fewer pads); the scores do not depend on the batches."""
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModel.score: {len(prompts)} prompts but {len(responses)} responses")
        if batch_size < 1:
            raise ValueError(f"RewardModel.score: batch_size must be ≥ 1, got {batch_size}")
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses)]
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
        out = torch.zeros(len(encoded), dtype=torch.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            out[rows] = self._forward([encoded[i] for i in rows])
        return out

    def _forward(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):  # right padding
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        last = mask.sum(-1) - 1
        model = self.model
        head = getattr(model, "score", None)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if isinstance(head, torch.nn.Linear) and isinstance(base, torch.nn.Module):
            # decoder-only (HF's generic *ForSequenceClassification): the head at each row's last
            # real token, found from the mask (HF's own pooling looks for the pad id, which a text
            # may contain)
            hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = head(hidden[torch.arange(len(batch), device=hidden.device), last])
        else:  # encoders and the like: the model's own pooling
            logits = model(input_ids=ids, attention_mask=mask).logits
        return logits[:, 0].float().cpu()


def save_tiny_reward_model(path: str | Path, seed: int = 0, *, chat_template: bool = True) -> Path:
    """Write a tiny random ``LlamaForSequenceClassification`` (hidden 32, 2 layers, one label) with
    :func:`~purerl.tiny.char_tokenizer` (with its chat template, or none) to the folder ``path``;
    returns it. The same ``seed`` writes the same weights; the global RNG is left as it was."""
    from transformers import LlamaForSequenceClassification

    from purerl.tiny import char_tokenizer, tiny_llama_config

    path = Path(path)
    tokenizer = char_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    config = tiny_llama_config(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, not 0.02
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
