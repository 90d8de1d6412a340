"""Huge but finite updates: a learning rate of 1e6 or 1e30 leaves finite weights that the update's
non-finite check passes; the norm guard (:data:`purerl.step.update.MAX_NORM_CHANGE`) stops the run at
that step, names a checkpoint whose weights are sane, and ``--resume`` with a smaller learning rate
continues from it."""

import pytest

from safetensors.torch import load_file

from purerl.io.checkpoint import list_checkpoints
from purerl.loop.recording import TrainingStopped
from tests.jobs import SMALL, run_job

TINY = ["--tiny", *SMALL, "--checkpoint-every", "1", "--warmup-steps", "0"]


@pytest.mark.parametrize("lr", ["1e6", "1e30"])
def test_a_huge_learning_rate_stops_at_its_first_step_and_resume_with_a_smaller_one_continues(tmp_path, lr):
    out = str(tmp_path / "run")
    run_job([*TINY, "--steps", "2", "--out-dir", out])
    with pytest.raises(TrainingStopped, match=r"step 3: the update left weights of another scale: actor's norm "
                                              r"changed ×\S+ in one step .* last good checkpoint is \S+step_00000002"):
        run_job([*TINY, "--steps", "4", "--lr", lr, "--resume", "--out-dir", out])
    saved = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [c.name for c in saved] == ["step_00000001", "step_00000002"]  # nothing of step 3 kept
    tensors = load_file(saved[-1] / "tensors.safetensors")  # params, moments, counters: all of the state
    assert max(float(t.abs().max()) for t in tensors.values() if t.is_floating_point()) < 100  # sane
    summary = run_job([*TINY, "--steps", "4", "--lr", "1e-5", "--resume", "--out-dir", out])
    assert summary["steps"] == 4


def test_a_huge_step_before_any_checkpoint_says_the_models_own_weights_are_the_good_ones(tmp_path):
    with pytest.raises(TrainingStopped, match=r"step \d: .*no checkpoint was written: the good weights are the "
                                              r"model's own; rerun with a smaller learning rate"):
        run_job([*TINY, "--steps", "3", "--lr", "1e6", "--checkpoint-every", "0", "--out-dir", str(tmp_path / "run")])
