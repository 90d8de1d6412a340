"""What crosses process boundaries: numpy round trips, weight buckets, checksums, versions."""

import pytest
import torch

from purerl.batch import Rollout
from purerl.executors.wire import (
    WeightSyncError,
    from_wire,
    load_weight_buckets,
    params_digest,
    to_wire,
    weight_buckets,
)
from purerl.tiny import random_sequences
from purerl.tree import tree_equal


def _params():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g),
            "c": torch.randn(8, 8, generator=g).to(torch.bfloat16), "d": torch.randn(3, generator=g)}


def test_trees_round_trip_through_numpy_bit_exactly_bfloat16_included():
    seqs = random_sequences(3, 4, 5, vocab_size=20)
    rollout = Rollout(seqs, torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1]), 4, 0.85)
    tree = {"rollout": rollout, "params": _params(), "note": "x"}
    back = from_wire(to_wire(tree))
    assert tree_equal(back, tree)
    assert back["params"]["c"].dtype == torch.bfloat16 and back["rollout"].version == 4
    back["params"]["a"].add_(1)  # arrived tensors are writable copies
    assert not torch.equal(back["params"]["a"], tree["params"]["a"])


def test_buckets_respect_the_size_and_carry_every_param_once():
    params = _params()
    buckets = weight_buckets(params, version=3, bucket_bytes=1000, checksum=True)
    # 'a' (8 KB, over the size: never split) alone; 'b' (400 B), 'c' (128 B), 'd' (12 B) share one
    assert [list(b.arrays) for b in buckets] == [["a"], ["b", "c", "d"]]
    loaded = load_weight_buckets(buckets, 3, set(params))
    assert params_digest(loaded) == params_digest(params)
    assert tree_equal(loaded, params)


def test_a_corrupted_bucket_fails_its_checksum_naming_it():
    buckets = weight_buckets(_params(), version=1, bucket_bytes=1000, checksum=True)
    buckets[0].arrays["a"][0, 0] += 1e-3  # one flipped value in flight
    with pytest.raises(WeightSyncError, match="bucket 0 of version 1 .*checksum"):
        load_weight_buckets(buckets, 1)


def test_wrong_version_and_missing_params_are_refused():
    params = _params()
    buckets = weight_buckets(params, version=2)
    assert all(b.sha256 is None for b in buckets)  # checksums only on request
    with pytest.raises(WeightSyncError, match="version 2, expected 3"):
        load_weight_buckets(buckets, 3)
    with pytest.raises(WeightSyncError, match=r"missing \['e'\]"):
        load_weight_buckets(buckets, 2, set(params) | {"e"})
