"""Checkpoints: identical round trip, atomic writes, keep-last-N, clear errors, HF export."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from purerl.io.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from purerl.models import response_logits
from purerl.models.hf import export_hf
from purerl.state import RngState, TrainState
from purerl.tiny import random_sequences, tiny_causal_lm, tiny_llama_config
from purerl.tree import pytree, tree_clone, tree_equal, tree_map


@pytree
class _Moments:
    count: torch.Tensor
    mu: dict


def _state(seed=0):
    config = tiny_llama_config()
    _, params = tiny_causal_lm(config, seed=seed)
    opt = _Moments(torch.tensor(3.0), tree_map(torch.randn_like, params))
    return TrainState(policy=params, policy_opt=opt, kl=torch.tensor(0.001, dtype=torch.float64),
                      rng=RngState(seed=7, counter=11), data={"epoch": 2, "index": 5}, step=42,
                      reference=tree_map(torch.clone, params))


def test_a_checkpoint_written_behind_the_training_holds_the_state_as_it_was_saved(tmp_path):
    state, writer = _state(), CheckpointWriter()
    expected = tree_clone(state)
    path = writer.save(tmp_path, state, step=1)
    for leaf in state.policy.values():
        leaf.add_(1.0)  # the next update, in place, while the write may still run
    assert writer.wait() == path and writer.wait() == path
    assert tree_equal(load_checkpoint(path, state), expected)


def test_a_failed_write_behind_the_training_raises_at_the_next_wait_and_keeps_the_ones_before(tmp_path, monkeypatch):
    import purerl.io.checkpoint as checkpoint

    writer = CheckpointWriter()
    first = writer.save(tmp_path, _state(), step=1)
    writer.wait()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write", full_disk)
    writer.save(tmp_path, _state(), step=2)
    with pytest.raises(CheckpointError, match="step_00000002: could not write the checkpoint.*No space left"):
        writer.wait()
    assert writer.wait() == first and list_checkpoints(tmp_path) == [first]
    assert not list(tmp_path.glob(".tmp*"))


def test_round_trip_gives_an_identical_tree(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, state, step=42)
    loaded = load_checkpoint(path, _state(seed=1))
    assert tree_equal(loaded, state)
    assert loaded.rng.counter == 11 and loaded.data == {"epoch": 2, "index": 5} and loaded.step == 42


def test_writes_are_atomic_and_only_the_newest_are_kept(tmp_path):
    state = _state()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, state, step=step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_truncated_tensor_file_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, _state(), step=1)
    tensors = path / "tensors.safetensors"
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path, _state())


def test_corrupted_tensor_file_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, _state(), step=1)
    tensors = path / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(path, _state())


def test_shape_mismatch_names_the_key(tiny_lm, tmp_path):
    path = save_checkpoint(tmp_path, _state(), step=1)
    config = tiny_llama_config(hidden_size=48)
    _, params = tiny_lm(config)
    other = TrainState(policy=params, policy_opt=_Moments(torch.tensor(0.0), tree_map(torch.zeros_like, params)),
                       kl=torch.tensor(0.0, dtype=torch.float64), rng=RngState(0), data={"epoch": 0, "index": 0},
                       reference=params)
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight"):
        load_checkpoint(path, other)


def test_a_tensor_reshaped_in_the_file_with_a_manifest_rewritten_to_match_is_refused_naming_it(tmp_path):
    import hashlib

    from safetensors.torch import load_file, save_file

    path = save_checkpoint(tmp_path, _state(), step=1)
    tensors_path, manifest_path = path / "tensors.safetensors", path / "manifest.json"
    tensors = load_file(tensors_path)
    key = ".policy['model.layers.0.mlp.down_proj.weight']"  # [32, 64]
    tensors[key] = tensors[key].reshape(-1, 8).contiguous()  # same bytes, another shape
    save_file(tensors, str(tensors_path))
    manifest = json.loads(manifest_path.read_text())
    data = tensors_path.read_bytes()
    manifest["tensor_file"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"tensor \.policy\['model\.layers\.0\.mlp\.down_proj\.weight'\] is "
                                              r"\[256, 8\] torch\.float32 in the file but \[32, 64\]"):
        load_checkpoint(path, _state())


def test_layout_mismatch_and_missing_manifest_are_named(tmp_path):
    path = save_checkpoint(tmp_path, _state(), step=1)
    without_reference = TrainState(policy=_state().policy, policy_opt=_state().policy_opt,
                                   kl=torch.tensor(0.0, dtype=torch.float64), rng=RngState(0),
                                   data={"epoch": 0, "index": 0})
    with pytest.raises(CheckpointError, match="reference"):
        load_checkpoint(path, without_reference)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest"):
        load_checkpoint(path, _state())


def test_manifest_records_every_leaf(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, state, step=1, metadata={"model": "tiny"})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["metadata"] == {"model": "tiny"}
    kinds = {e["path"]: e["kind"] for e in manifest["leaves"]}
    assert kinds[".step"] == "int" and kinds[".rng.seed"] == "int"
    assert kinds[".policy['model.embed_tokens.weight']"] == "tensor"


def test_exported_hf_directory_reloads_with_identical_logits(tiny_lm, tmp_path):
    config = tiny_llama_config()
    model, params = tiny_lm(config, seed=3)
    params = {k: v + 0.05 * torch.randn_like(v) for k, v in params.items()}  # not the init weights
    export_hf(model, params, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    seqs = random_sequences(3, 4, 4, config.vocab_size)
    with torch.no_grad():
        expected = reloaded(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(),
                            position_ids=seqs.position_ids(), use_cache=False).logits[:, -5:-1]
        got = response_logits(model, params, seqs)
    mask = seqs.response_mask  # padding positions' logits are never used (and differ)
    torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=1e-6)  # lean vs module rounding


def test_a_loaded_folder_gives_params_of_their_own_aligned_for_the_cpu_products(tiny_lm, tmp_path):
    from purerl.models import load_causal_lm

    model, params = tiny_lm(seed=0)
    export_hf(model, params, tmp_path / "m")
    on_disk = (tmp_path / "m" / "model.safetensors").read_bytes()
    _, loaded = load_causal_lm(tmp_path / "m")
    assert all(p.data_ptr() % 64 == 0 and p.untyped_storage().resizable() for p in loaded.values())
    assert tree_equal(loaded, params)
    for p in loaded.values():
        p.add_(1.0)  # an in-place update (the donated AdamW) must not reach the file
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == on_disk
