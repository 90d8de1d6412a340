"""What the lean Llama-family forward (:mod:`.llama`) reads: a model's sizes (:class:`LlamaLayout`,
from its HF config) and its params tree rearranged with q/k/v and gate/up each fused into one
matrix (:func:`fused_weights`), LoRA adapters fused alike and a sparse layer's experts (:mod:`.moe`)."""

from typing import Any, NamedTuple

import torch
from torch import Tensor

from purerl.models.families.moe import Experts, experts_of

__all__ = ["FusedWeights", "LayerWeights", "LlamaLayout", "Lora", "fused_weights", "layout_of"]


class LlamaLayout(NamedTuple):
    """Sizes of a Llama-family model (from its HF config)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    padding_idx: int | None = None  # the embedding row that takes no gradient (HF's nn.Embedding padding_idx)
    experts_per_token: int = 0  # a sparse MLP's k (num_experts_per_tok)
    norm_topk_prob: bool = False  # whether a sparse MLP renormalises its k gate weights


def layout_of(config: Any) -> LlamaLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pad = getattr(config, "pad_token_id", None)
    return LlamaLayout(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                       head_dim, float(config.rms_norm_eps), pad if isinstance(pad, int) else None,
                       int(getattr(config, "num_experts_per_tok", 0) or 0),
                       bool(getattr(config, "norm_topk_prob", False)))


class LayerWeights(NamedTuple):
    """One decoder layer with its projections fused: q, k, v in one matrix, gate and up in another.
    Matrices are transposed views, ``[in, out]``, as the products take them. A sparse layer has
    ``experts`` in place of ``gate_up`` and ``down`` (None)."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    out: Tensor
    out_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor | None
    down: Tensor | None
    qkv_lora: "Lora | None" = None
    out_lora: "Lora | None" = None
    gate_up_lora: "Lora | None" = None
    down_lora: "Lora | None" = None
    qk_norm: Tensor | None = None  # [H + K, D]: each query head's q_norm weight, then each key head's k_norm
    experts: Experts | None = None


class Lora(NamedTuple):
    """The LoRA update of a (fused) projection, ``s · (x @ a) @ b``: ``a`` ``[in, R]`` is the
    parts' ``lora_A`` side by side, ``b`` ``[R, out]`` their ``lora_B`` block-diagonal (part ``j``'s
    rank columns feed part ``j``'s outputs only), both transposed like the layers' matrices."""

    a: Tensor
    b: Tensor
    scale: float


class FusedWeights(NamedTuple):
    """What the lean forward reads, built from the params tree by :func:`fused_weights`."""

    embed: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    head: Tensor  # [hidden, vocab], like the layers' matrices
    head_bias: Tensor | None


def fused_weights(params: dict[str, Tensor], layout: LlamaLayout, lora_scale: float | None = None) -> FusedWeights:
    """The params tree rearranged for the lean forward. The fused matrices are concatenations:
    copies, rebuilt after every update, and differentiable (gradients flow back to ``params``).
    LoRA adapters in the tree (``….lora_A.weight``/``….lora_B.weight``, scale ``lora_scale``)
    become each fused projection's :class:`Lora` (a projection some of whose parts have none
    gets zero blocks for those)."""

    def cat(*names: str) -> Tensor | None:
        parts = [params.get(n) for n in names]
        return None if parts[0] is None else torch.cat(parts)

    def t(name: str) -> Tensor:
        return params[name].t()

    def lora(*names: str) -> Lora | None:
        a = [params.get(f"{n}.lora_A.weight") for n in names]
        if lora_scale is None or all(x is None for x in a):
            return None
        b = [params.get(f"{n}.lora_B.weight") for n in names]
        weights = [params[f"{n}.weight"] for n in names]
        a = [x if x is not None else w.new_zeros(0, w.shape[1]) for x, w in zip(a, weights)]
        b = [x if x is not None else w.new_zeros(w.shape[0], 0) for x, w in zip(b, weights)]
        return Lora(torch.cat(a).t(), torch.block_diag(*b).t() if len(b) > 1 else b[0].t(), lora_scale)

    def head_norms(a: str) -> Tensor | None:
        q = params.get(f"{a}.q_norm.weight")
        if q is None:
            return None
        return torch.cat((q.expand(layout.heads, -1), params[f"{a}.k_norm.weight"].expand(layout.kv_heads, -1)))

    layers = []
    for i in range(layout.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if params.get(f"{m}.gate_proj.bias") is not None or params.get(f"{m}.down_proj.bias") is not None:
            raise ValueError("fused_weights: MLP biases are not supported")
        experts = experts_of(params, m)
        dense = experts is None
        layers.append(LayerWeights(
            params[f"model.layers.{i}.input_layernorm.weight"],
            cat(f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight").t(),
            cat(f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
            t(f"{a}.o_proj.weight"), params.get(f"{a}.o_proj.bias"),
            params[f"model.layers.{i}.post_attention_layernorm.weight"],
            cat(f"{m}.gate_proj.weight", f"{m}.up_proj.weight").t() if dense else None,
            t(f"{m}.down_proj.weight") if dense else None,
            lora(f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"), lora(f"{a}.o_proj"),
            lora(f"{m}.gate_proj", f"{m}.up_proj") if dense else None, lora(f"{m}.down_proj") if dense else None,
            head_norms(a), experts))
    embed = params["model.embed_tokens.weight"]
    return FusedWeights(embed, layers, params["model.norm.weight"],
                        params.get("lm_head.weight", embed).t(),  # tied: only the embedding is in the tree
                        params.get("lm_head.bias"))
