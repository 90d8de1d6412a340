"""A job's data as a run needs it: the training and held-out records, the reward function, how a
multi-turn task's episodes are played, the tasks as token ids, and the context check."""

import functools
from collections.abc import Callable
from typing import Any

import torch

from purerl.config.job import JobConfig
from purerl.data.demonstrations import Demonstration, load_demonstrations
from purerl.data.math_problems import train_eval_split
from purerl.data.records import DataError, PromptRecord, encode_prompts, load_records, prompt_ids
from purerl.environments import environment_of
from purerl.episodes import ChatCodec, TemplateError
from purerl.episodes.rollout import Episode
from purerl.loop.task import Episodes, Task
from purerl.loop.warm_up import demonstrations, file_demonstrations
from purerl.models import CausalLM
from purerl.rewards import RewardFn, math_reward, reward_function

__all__ = ["check_context", "decoder_of", "episodes_of", "load_records_of", "load_tasks", "reward_of"]


def load_records_of(config: JobConfig) -> tuple[list[PromptRecord], list[PromptRecord], dict[str, int]]:
    """Training and held-out records (before any model loads: data errors come first). With train
    files and no eval files, the held-out rows are drawn from the train files and not trained on."""
    data, seed = config.data, config.data.seed
    if not data.train_files:
        train_records, eval_records = train_eval_split(data.train_size, data.eval_size, seed=seed,
                                                       difficulties=tuple(data.difficulty))
        return train_records, eval_records, {}
    train_records = load_records(list(data.train_files))
    if data.eval_files:
        return train_records, load_records(list(data.eval_files))[: data.eval_size], {}
    if len(train_records) <= data.eval_size:
        raise DataError(f"data.train_files have {len(train_records)} rows: too few to hold out data.eval_size "
                        f"{data.eval_size} for evaluation; give data.eval_files or a smaller data.eval_size")
    order = torch.randperm(len(train_records), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = set(order[: data.eval_size])
    print(f"evaluating on {data.eval_size} rows held out of the training files (not trained on)", flush=True)
    return ([r for i, r in enumerate(train_records) if i not in held_out],
            [train_records[i] for i in sorted(held_out)], {"eval_rows_held_out_of_data": data.eval_size})


def load_sft_data(config: JobConfig) -> list[Demonstration] | None:
    """The rows of ``env.sft_data`` (:mod:`purerl.data.demonstrations`), or None where the warm-up learns from
    the task's own demonstrations."""
    env = config.env
    if not env.sft_data:
        return None
    rows = load_demonstrations(list(env.sft_data), prompt_key=env.sft_prompt_key, response_key=env.sft_response_key)
    print(f"SFT warm-up data: {len(rows)} demonstrations from {', '.join(env.sft_data)}", flush=True)
    return rows


def warm_up_demonstrations(config: JobConfig, tokenizer: Any, options: dict[str, Any], train_task: Task,
                           rows: list[Demonstration] | None) -> tuple[int, Callable[[int], Episode]]:
    """The warm-up's demonstrations, before any work: how many, and the ``i``-th one's episode. The ``rows`` of
    ``env.sft_data`` when given (each prompt rendered by ``data.prompt_format``, as the RL prompts are), else the
    training task's own (its environment's, or its rows' worked answers; a row without one is named here).
    ``options``: :func:`engine_options` (the end token)."""
    encode, end_id = (lambda text: tokenizer.encode(text, add_special_tokens=False)), options["eos_token_ids"][0]
    if not rows:
        return len(train_task.records), demonstrations(train_task, encode, end_id)
    render = functools.partial(prompt_ids, tokenizer=tokenizer, prompt_format=config.data.prompt_format)
    return len(rows), file_demonstrations(rows, render, encode, end_id)


def reward_of(config: JobConfig) -> RewardFn:
    """``reward.fn``: a built-in reward by name or a user's ``module:function``."""
    try:
        return reward_function(config.reward.fn, format_bonus=config.reward.format_bonus)
    except ValueError as err:
        raise DataError(f"reward.fn: {err}") from None


def episodes_of(config: JobConfig, tokenizer: Any, reward_fn: RewardFn, options: dict[str, Any]) -> Episodes | None:
    """How the tasks' episodes are played (``env``: its kind's environment, player and
    demonstrations, :mod:`purerl.environments`), None for single-turn answers. ``options``:
    :func:`engine_options` (EOS and padding ids)."""
    env_config = config.env
    if not env_config.multi_turn:
        return None
    try:
        kind, env = environment_of(env_config.name, answer_fn=reward_fn, tools=env_config.tools,
                                   format=env_config.format)
    except ValueError as err:
        raise DataError(f"env.name: {err}") from None
    try:
        codec = ChatCodec(tokenizer, eos_token_ids=options["eos_token_ids"])
    except TemplateError as err:
        raise DataError(f"env.name {env_config.name}: the tokenizer's chat template cannot grow episodes: "
                        f"{err}") from None
    tools = getattr(env, "chat_tools", None)
    template_kwargs = {"tools": tools} if env_config.format == "json" and tools else {}
    demonstration = None if kind.demonstration is None else functools.partial(kind.demonstration, env=env)
    return Episodes(env, codec, env_config, template_kwargs, options["pad_token_id"],  # the section is the limits
                    play=kind.play, demonstration=demonstration)


def load_tasks(config: JobConfig, train_records: list[PromptRecord], eval_records: list[PromptRecord],
               tokenizer: Any, reward_fn: RewardFn,
               episodes: Episodes | None = None) -> tuple[Task, Task, dict[str, int]]:
    """The training and held-out tasks (prompts longer than ``data.max_prompt_tokens`` skipped and
    counted), played as ``episodes`` when given. Held-out metrics: ``accuracy`` by the reward
    function, ``strict_accuracy`` by the strict math reward."""
    counts, tasks = {}, []
    decode = decoder_of(tokenizer)
    shots, train_records = few_shot_examples(train_records, config.data.few_shot)
    for name, records in (("train", train_records), ("eval", eval_records)):
        encoded = encode_prompts(records, tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                                 prompt_format=config.data.prompt_format, before=shots)
        if not encoded.ids:
            shown = f" with data.few_shot's {config.data.few_shot} worked example(s) before it" if shots else ""
            raise DataError(f"every {name} prompt{shown} is longer than data.max_prompt_tokens "
                            f"{config.data.max_prompt_tokens}")
        counts[f"{name}_prompts"] = len(encoded.ids)
        counts[f"{name}_skipped_overlong"] = encoded.skipped
        tasks.append(Task(encoded.ids, [records[i] for i in encoded.record_index], reward_fn, decode,
                          {"accuracy": reward_fn, "strict_accuracy": math_reward}, episodes))
    return tasks[0], tasks[1], counts


def few_shot_examples(records: list[PromptRecord], count: int) -> tuple[tuple[dict[str, str], ...],
                                                                          list[PromptRecord]]:
    """``data.few_shot``: the turns shown before every prompt (each of the first ``count`` records with a worked
    answer, as its messages then the answer) and the records left to train on. ``DataError`` where fewer than
    ``count`` records have a worked answer."""
    if not count:
        return (), records
    chosen = [i for i, r in enumerate(records) if isinstance(r.extra.get("answer"), str)][:count]
    if len(chosen) < count:
        raise DataError(f"data.few_shot {count}: only {len(chosen)} training rows have a worked answer "
                        "(extra_info.answer) to show")
    turns = tuple(turn for i in chosen for turn in (*records[i].messages,
                                                     {"role": "assistant", "content": records[i].extra["answer"]}))
    shown = set(chosen)
    return turns, [r for i, r in enumerate(records) if i not in shown]


def decoder_of(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def check_context(config: JobConfig, model: CausalLM) -> None:
    """Refuse prompts and responses that together exceed the model's context (``DataError``)."""
    context = getattr(model.config, "max_position_embeddings", None)
    if config.env.multi_turn and context is not None and config.env.max_tokens > context:
        raise DataError(f"env.max_tokens {config.env.max_tokens} exceeds the model's context of {context} "
                        "(max_position_embeddings)")
    needed = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    if context is not None and needed > context:
        raise DataError(f"data.max_prompt_tokens {config.data.max_prompt_tokens} + rollout.max_new_tokens "
                        f"{config.rollout.max_new_tokens} = {needed} tokens exceed the model's context of {context} "
                        "(max_position_embeddings)")
