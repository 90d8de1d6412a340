"""``compile_decode``: the fixed-shape decoding step and the sampler after it compiled by
``torch.compile`` (inductor's C++ backend here; Triton inside the CUDA graph on a GPU,
``tests/test_gpu.py``) sample what the eager engine samples: the same tokens, log-probs to float
rounding (fused elementwise kernels, another attention order)."""

import shutil

import jaxtyping
import pytest
import torch

from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

pytestmark = [pytest.mark.slow,  # it takes seconds (BENCHMARKS.md: the suite's tiers)
              pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                 reason="inductor's CPU backend needs a C++ compiler")]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(autouse=True)
def _untyped():
    """The suite's runtime type checks off: dynamo would trace them on its fake tensors."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


def test_the_compiled_decode_step_samples_what_the_eager_engine_samples(tiny_lm):
    from torch._dynamo.utils import counters

    model, params = tiny_lm(vocab_size=96, layers=1, seed=0)
    # temperature, top-k and top-p: the sampler's sort, cumsums and search compiled with the step;
    # an EOS id outside the vocabulary: no row leaves the batch, so one shape is compiled
    sampling = SamplingParams(max_new_tokens=6, n=2, temperature=0.8, top_k=40, top_p=0.95)
    out = {}
    for compiled in (False, True):
        engine = TorchEngine(model, eos_token_ids=[999], pad_token_id=0, compile_decode=compiled)
        engine.sync(params, 0)
        assert engine.onednn == (not compiled and engine.onednn)  # the compiled step reads plain weights
        before = counters["stats"]["unique_graphs"]
        out[compiled] = engine.generate(PROMPTS, sampling, RngState(5))
        assert (counters["stats"]["unique_graphs"] > before) == compiled
    assert torch.equal(out[True].sequences.input_ids, out[False].sequences.input_ids)
    torch.testing.assert_close(out[True].behaviour_logprobs, out[False].behaviour_logprobs, rtol=0, atol=1e-5)
