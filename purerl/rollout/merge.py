"""Joining rollouts generated in shards (per rollout worker, per generator) into one batch."""

from collections.abc import Sequence

import torch

from purerl.batch import Rewards, Rollout, Sequences

__all__ = ["concat_rewards", "concat_rollouts", "prompt_shards"]


def prompt_shards(count: int, shards: int) -> list[slice]:
    """Contiguous, near-equal slices of ``range(count)`` (the first ``count % shards`` one longer);
    empty slices are left out."""
    base, extra = divmod(count, shards)
    out, start = [], 0
    for i in range(shards):
        stop = start + base + (i < extra)
        if stop > start:
            out.append(slice(start, stop))
        start = stop
    return out


def concat_rollouts(rollouts: Sequence[Rollout], pad_token_id: int, *, mixed_versions: bool = False) -> Rollout:
    """Rows of ``rollouts`` in order, re-padded to the widest prompt (on the left) and the longest
    response (on the right); group ids are offset so that groups stay distinct and prompt-major.

    All parts must carry the same weights version, unless ``mixed_versions`` (parts of one batch
    made by several generators): the result then carries the oldest, which staleness counts from
    (each row's behaviour log-probs are its own version's, so the correction stays exact). All parts
    must carry the same sampling temperature.
    """
    if not rollouts:
        raise ValueError("concat_rollouts: nothing to join")
    versions = {r.version for r in rollouts}
    if mixed_versions:
        versions = {min(versions)}
    if len(versions) != 1:
        raise ValueError(f"concat_rollouts: parts were generated with different weights versions {sorted(versions)}")
    temperatures = {r.temperature for r in rollouts}
    if len(temperatures) != 1:
        raise ValueError(f"concat_rollouts: parts were sampled at different temperatures {sorted(temperatures)}")
    if len(rollouts) == 1:
        return rollouts[0]
    widths = [r.sequences.input_ids.shape[1] - r.sequences.response_length for r in rollouts]
    prompt_width, response_width = max(widths), max(r.sequences.response_length for r in rollouts)
    ids, attention, response_mask, logprobs, groups, routing = [], [], [], [], [], []
    routed = all(r.sequences.routing is not None for r in rollouts)  # else the joined rollout carries none
    offset = 0
    for r, width in zip(rollouts, widths):
        s = r.sequences
        left, right = prompt_width - width, response_width - s.response_length
        pad = lambda x, value, lr: torch.nn.functional.pad(x, lr, value=value)  # noqa: E731
        ids.append(torch.cat([pad(s.input_ids[:, :width], pad_token_id, (left, 0)),
                              pad(s.responses(), pad_token_id, (0, right))], 1))
        attention.append(torch.cat([pad(s.attention_mask[:, :width], False, (left, 0)),
                                    pad(s.attention_mask[:, width:], False, (0, right))], 1))
        response_mask.append(pad(s.response_mask, False, (0, right)))
        if routed:  # [b, s, l, k]: padded on the positions' dim
            routing.append(torch.cat([pad(s.routing[:, :width], -1, (0, 0, 0, 0, left, 0)),
                                      pad(s.routing[:, width:], -1, (0, 0, 0, 0, 0, right))], 1))
        logprobs.append(pad(r.behaviour_logprobs, 0.0, (0, right)))
        groups.append(r.group + offset)
        offset += int(r.group.max()) + 1 if len(r.group) else 0
    return Rollout(Sequences(torch.cat(ids), torch.cat(attention), torch.cat(response_mask),
                             torch.cat(routing) if routed else None),
                   torch.cat(logprobs), torch.cat([r.finish_reasons for r in rollouts]), torch.cat(groups),
                   versions.pop(), temperatures.pop())


def concat_rewards(parts: Sequence[Rewards], width: int) -> Rewards:
    """The rewards of rollouts joined by :func:`concat_rollouts`, in order; token rewards are
    padded with 0 to the joined rollout's response ``width``."""
    if len(parts) == 1 and (parts[0].token_rewards is None or parts[0].token_rewards.shape[1] == width):
        return parts[0]
    joined = [None if values[0] is None else torch.cat(values)
              for values in zip(*((w.scores, w.baselines, w.components) for w in parts))]
    tokens = None if parts[0].token_rewards is None else torch.cat(
        [torch.nn.functional.pad(w.token_rewards, (0, width - w.token_rewards.shape[1])) for w in parts])
    return Rewards(*joined, token_rewards=tokens)
