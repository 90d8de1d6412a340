"""LoRA: low-rank adapters as the only trained leaves of a policy.

A LoRA policy is a :class:`~purerl.models.CausalLM` whose frozen base weights are part of the
*resource* (``model.frozen``, like its buffers: they never change and are never checkpointed)
while the train state's ``policy`` tree holds only the adapters, ``{module}.lora_A.weight``
``[r, in]`` and ``{module}.lora_B.weight`` ``[out, r]`` for every adapted linear layer (PEFT's
names without its ``base_model.model.`` prefix). So gradients, AdamW moments, gradient clipping,
checkpoints and weight sync cover the adapters and nothing else, with no masks anywhere.

An adapted layer computes ``x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ`` with ``s = alpha / r`` (unmerged, in the
lean forward and the HF module alike); ``B`` starts at zero, so step 0 is the base exactly.
The reference policy is the same base with the adapters off: the params tree ``{}`` (no copy of
the model). Rollout engines decode with the adapters merged once per weights version
(:func:`merged`), at the base model's speed.

:func:`export_peft` writes an adapter folder that ``peft.PeftModel.from_pretrained`` loads.
"""

import contextlib
import contextvars
import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from purerl.files import make_readable, whole_folder
from purerl.models.lora_spec import DEFAULT_TARGETS, LoraSpec

__all__ = ["DEFAULT_TARGETS", "LoraLinear", "LoraSpec", "adapted_layers", "adapters_off", "apply_lora",
           "export_peft", "is_adapter", "layer_names", "merged"]

_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("purerl_lora_off", default=False)


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight``/``bias`` names) with a low-rank update ``lora_B·lora_A``.

    Adapters of rank 0 (what :meth:`CausalLM.bound` gives when the params tree has none) or an
    :func:`adapters_off` block make it the plain base layer."""

    def __init__(self, base: nn.Linear, rank: int, scale: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.scale = base.in_features, base.out_features, scale
        self.weight, self.bias = base.weight, base.bias
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        a = self.lora_A.weight
        if a.shape[0] == 0 or _OFF.get():
            return out
        return out + self.scale * F.linear(F.linear(x, a), self.lora_B.weight)


@contextlib.contextmanager
def adapters_off() -> Iterator[None]:
    """Within the block, every :class:`LoraLinear` computes its base layer only (the reference
    policy on a module that holds its adapters, as under FSDP)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def adapted_layers(module: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The names of the ``nn.Linear`` layers of ``module`` whose last name part is a target,
    in module order."""
    return [name for name, sub in module.named_modules()
            if isinstance(sub, nn.Linear) and name.rpartition(".")[2] in targets]


def _kaiming_uniform(rows: int, cols: int, generator: torch.Generator) -> Tensor:
    """``nn.init.kaiming_uniform_(a=√5)`` of a ``[rows, cols]`` matrix (PEFT's and nn.Linear's
    init of ``lora_A``): uniform in ±1/√cols."""
    bound = 1.0 / math.sqrt(cols)
    return torch.rand(rows, cols, generator=generator, dtype=torch.float64).mul_(2 * bound).sub_(bound)


def apply_lora(
    model: Any, params: dict[str, Tensor], spec: LoraSpec, *, seed: int = 0
) -> tuple[Any, dict[str, Tensor]]:
    """``(model', adapters)``: a copy of the causal LM ``model`` whose target layers are
    :class:`LoraLinear` and whose ``frozen`` weights are ``params``, and the adapter tree
    (``lora_A`` uniform in ±1/√in from ``seed``, ``lora_B`` zero; dtype and device of each base
    weight). Raises ``ValueError`` when no layer matches ``spec.targets`` or ``spec.rank < 1``."""
    if spec.rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {spec.rank}")
    module = copy.deepcopy(model.module)
    names = adapted_layers(module, spec.targets)
    if not names:
        raise ValueError(f"LoRA targets {list(spec.targets)} match no linear layer of {type(module).__name__}")
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    tied = [name for name in names if f"{name}.weight" not in params]
    if tied:
        raise ValueError(f"LoRA targets {', '.join(tied)}: tied to {model.aliases.get(f'{tied[0]}.weight', '?')} "
                         "(one weight, two uses); leave them out of the targets")
    for name in names:
        base = module.get_submodule(name)
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, LoraLinear(base, spec.rank, spec.scale))
        weight = params[f"{name}.weight"]
        a = _kaiming_uniform(spec.rank, base.in_features, generator)
        adapters[f"{name}.lora_A.weight"] = a.to(device=weight.device, dtype=weight.dtype)
        adapters[f"{name}.lora_B.weight"] = weight.new_zeros(base.out_features, spec.rank)
    for p in module.parameters():
        p.requires_grad_(False)
    frozen = {name: p.detach() for name, p in params.items()}
    return attrs.evolve(model, module=module, lora=spec, frozen=frozen), adapters


def layer_names(adapters: dict[str, Tensor]) -> list[str]:
    """The adapted layers named in an adapter tree, in its order."""
    return [name[: -len(".lora_A.weight")] for name in adapters if name.endswith(".lora_A.weight")]


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def merged(frozen: dict[str, Tensor], params: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """The plain params tree of the adapted policy: ``frozen`` overlaid with the other weights of
    ``params``, and every adapter of ``params`` folded into its layer, ``W + s·B·A`` (new tensors
    for the adapted weights, the others shared; each in its base weight's dtype, summed in the
    adapters'). A tree with no adapters (merged already) comes back as the overlay."""
    out = {**frozen, **{name: t for name, t in params.items() if not is_adapter(name)}}
    with torch.no_grad():
        for name in layer_names(params):
            a, b = params[f"{name}.lora_A.weight"], params[f"{name}.lora_B.weight"]
            weight = out[f"{name}.weight"]  # in float32 adapters' dtype over a bfloat16 base (mixed precision)
            product = torch.addmm(weight.to(a.dtype), b.detach(), a.detach(), alpha=scale)
            out[f"{name}.weight"] = product.to(weight.dtype)
    return out


def export_peft(model: Any, adapters: dict[str, Tensor], out_dir: str | Path, *, base_model: str | None = None) -> Path:
    """Write ``adapters`` as a PEFT LoRA folder (``adapter_config.json``,
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(base, out_dir)`` loads
    onto the base model (``base_model``: its path, recorded as ``base_model_name_or_path``)."""
    spec: LoraSpec = model.lora
    layers = layer_names(adapters)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "target_modules": sorted({name.rpartition(".")[2] for name in layers}), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": base_model, "modules_to_save": None,
    }
    tensors = {f"base_model.model.{name}": t.detach().to("cpu").contiguous() for name, t in adapters.items()}
    with whole_folder(out_dir) as folder:  # a failed export leaves no partial folder
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        make_readable(folder / "adapter_model.safetensors")
    return Path(out_dir)
