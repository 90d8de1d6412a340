"""What the shared decoder (:mod:`.decoder`) reads: a model's :class:`Layout` (its sizes, from its HF
config, and its settings, from its family's :class:`~.variant.Variant`) and its params tree
rearranged with q/k/v and gate/up each fused into one matrix (:func:`fused_weights`), LoRA adapters
fused alike, a sparse layer's experts (:mod:`.moe`), and each norm's weight as the norm scales by it.
:data:`VARIANTS` lists every family's variant, which a layout is found by (the config's model type)."""

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from purerl.models.families.gemma import GEMMA3
from purerl.models.families.llama import LLAMA, QWEN3, QWEN3_MOE
from purerl.models.families.moe import Experts, experts_of
from purerl.models.families.saved_parts import concatenated
from purerl.models.families.variant import Variant

__all__ = ["VARIANTS", "FusedWeights", "LayerWeights", "LazyLayers", "Layout", "Lora", "Params", "TiedReads",
           "fused_weights", "layer_weights", "layout_of", "variant_of"]

VARIANTS = (LLAMA, QWEN3, QWEN3_MOE, GEMMA3)
"""Every variant of the shared block, each found by its model types (:func:`variant_of`)."""


def variant_of(config: Any) -> Variant:
    """The variant that covers ``config``'s model type."""
    for variant in VARIANTS:
        if variant.covers(config):
            return variant
    raise ValueError(f"no lean variant covers model_type {getattr(config, 'model_type', None)!r}")


class Layout(NamedTuple):
    """Sizes and settings of a model: its HF config's, as its family's variant reads them."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    padding_idx: int | None  # the embedding row that takes no gradient (HF's nn.Embedding padding_idx)
    scale: float  # attention's: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5
    sliding: tuple[bool, ...]  # sliding[i]: layer i is a sliding-window layer
    window: int  # a sliding layer's queries see the last `window` positions (themselves included)
    softcap: float | None  # final_logit_softcapping
    embed_scale: float | None  # √hidden where embeddings are scaled
    norm_plus_one: bool  # RMSNorm scales by 1 + w in float32 (Variant.norm_plus_one)
    sandwich_norms: bool  # four norms a layer (Variant.sandwich_norms)
    activation: str  # the gated MLP's (Variant.activation)
    experts_per_token: int = 0  # a sparse MLP's k (num_experts_per_tok)
    norm_topk_prob: bool = False  # whether a sparse MLP renormalises its k gate weights


def layout_of(config: Any) -> Layout:
    """The layout of a model of ``config``, as the variant that covers it (:func:`variant_of`) reads it."""
    variant = variant_of(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pad = getattr(config, "pad_token_id", None)
    layers = config.num_hidden_layers
    softcap = getattr(config, "final_logit_softcapping", None) if variant.logit_softcap else None
    types = config.layer_types if variant.sliding_windows else ("full_attention",) * layers
    sliding = tuple(layer_type == "sliding_attention" for layer_type in types)
    return Layout(layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                  float(config.rms_norm_eps), pad if isinstance(pad, int) else None,
                  (float(config.query_pre_attn_scalar) if variant.query_pre_attn_scalar else head_dim) ** -0.5,
                  sliding, int(getattr(config, "sliding_window", None) or 0) if any(sliding) else 0,
                  None if softcap is None else float(softcap),
                  config.hidden_size ** 0.5 if variant.embedding_scale else None,
                  variant.norm_plus_one, variant.sandwich_norms, variant.activation,
                  int(getattr(config, "num_experts_per_tok", 0) or 0), bool(getattr(config, "norm_topk_prob", False)))


class LayerWeights(NamedTuple):
    """One decoder layer with its projections fused: q, k, v in one matrix, gate and up in another.
    Matrices are transposed views, ``[in, out]``, as the products take them. A sparse layer has
    ``experts`` in place of ``gate_up`` and ``down`` (None). Norms: ``input_norm`` before
    attention, ``mlp_norm`` before the MLP; with sandwich norms also ``attention_out_norm`` (on the
    attention output, before the residual) and ``mlp_out_norm`` (on the MLP's), else None."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    out: Tensor
    out_bias: Tensor | None
    mlp_norm: Tensor
    gate_up: Tensor | None
    down: Tensor | None
    qkv_lora: "Lora | None" = None
    out_lora: "Lora | None" = None
    gate_up_lora: "Lora | None" = None
    down_lora: "Lora | None" = None
    qk_norm: Tensor | None = None  # [H + K, D]: each query head's q_norm weight, then each key head's k_norm
    experts: Experts | None = None
    attention_out_norm: Tensor | None = None
    mlp_out_norm: Tensor | None = None


class Lora(NamedTuple):
    """The LoRA update of a (fused) projection, ``s · (x @ a) @ b``: ``a`` ``[in, R]`` is the
    parts' ``lora_A`` side by side, ``b`` ``[R, out]`` their ``lora_B`` block-diagonal (part ``j``'s
    rank columns feed part ``j``'s outputs only), both transposed like the layers' matrices."""

    a: Tensor
    b: Tensor
    scale: float


class FusedWeights(NamedTuple):
    """What the shared decoder reads, built from the params tree by :func:`fused_weights`."""

    embed: Tensor
    layers: Sequence[LayerWeights]
    norm: Tensor
    head: Tensor  # [hidden, vocab], like the layers' matrices
    head_bias: Tensor | None
    tied: bool = False  # embed and head are the two reads of one tied matrix (:class:`TiedReads`)


def _plus_one(w: Tensor) -> Tensor:
    return 1.0 + w.float()


Params = Mapping[str, Tensor]
"""A params tree as the decoder reads it: by name (a dict, or a mapping that gathers each sharded tensor when
read, :class:`purerl.models.sharding.Gathered`)."""


def _norm(params: Params, layout: Layout, name: str) -> Tensor:
    return _plus_one(params[name]) if layout.norm_plus_one else params[name]


def _cat(params: Params, *names: str) -> Tensor | None:
    parts = [params.get(n) for n in names]
    return None if parts[0] is None else concatenated(parts)


def _lora(params: Params, lora_scale: float | None, *names: str) -> "Lora | None":
    a = [params.get(f"{n}.lora_A.weight") for n in names]
    if lora_scale is None or all(x is None for x in a):
        return None
    b = [params.get(f"{n}.lora_B.weight") for n in names]
    weights = [params[f"{n}.weight"] for n in names]
    a = [x if x is not None else w.new_zeros(0, w.shape[1]) for x, w in zip(a, weights)]
    b = [x if x is not None else w.new_zeros(w.shape[0], 0) for x, w in zip(b, weights)]
    return Lora(concatenated(a).t(), torch.block_diag(*b).t() if len(b) > 1 else b[0].t(), lora_scale)


def _head_norms(params: Params, layout: Layout, attention: str) -> Tensor | None:
    q = params.get(f"{attention}.q_norm.weight")
    if q is None:
        return None
    both = torch.cat((q.expand(layout.heads, -1), params[f"{attention}.k_norm.weight"].expand(layout.kv_heads, -1)))
    return _plus_one(both) if layout.norm_plus_one else both


def layer_weights(params: Params, layout: Layout, i: int, lora_scale: float | None = None) -> LayerWeights:
    """Layer ``i`` of the params tree rearranged for the shared decoder (see :func:`fused_weights`)."""
    at, a, m = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    if params.get(f"{m}.gate_proj.bias") is not None or params.get(f"{m}.down_proj.bias") is not None:
        raise ValueError("fused_weights: MLP biases are not supported")
    experts = experts_of(params, m)
    dense = experts is None
    sandwich = layout.sandwich_norms
    return LayerWeights(
        _norm(params, layout, f"{at}.input_layernorm.weight"),
        _cat(params, f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight").t(),
        _cat(params, f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
        params[f"{a}.o_proj.weight"].t(), params.get(f"{a}.o_proj.bias"),
        _norm(params, layout, f"{at}.pre_feedforward_layernorm.weight" if sandwich
              else f"{at}.post_attention_layernorm.weight"),
        _cat(params, f"{m}.gate_proj.weight", f"{m}.up_proj.weight").t() if dense else None,
        params[f"{m}.down_proj.weight"].t() if dense else None,
        _lora(params, lora_scale, f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
        _lora(params, lora_scale, f"{a}.o_proj"),
        _lora(params, lora_scale, f"{m}.gate_proj", f"{m}.up_proj") if dense else None,
        _lora(params, lora_scale, f"{m}.down_proj") if dense else None,
        _head_norms(params, layout, a), experts,
        _norm(params, layout, f"{at}.post_attention_layernorm.weight") if sandwich else None,
        _norm(params, layout, f"{at}.post_feedforward_layernorm.weight") if sandwich else None)


class LazyLayers(Sequence[LayerWeights]):
    """The layers of a params tree, each rearranged (:func:`layer_weights`) when the decoder reads it: a
    layer's fused copies (and, for sharded params, its gathered weights) exist only while it runs, and a
    checkpointed layer builds them again in the backward."""

    def __init__(self, params: Params, layout: Layout, lora_scale: float | None) -> None:
        self.params, self.layout, self.lora_scale = params, layout, lora_scale

    def __len__(self) -> int:
        return self.layout.layers

    def __getitem__(self, i: int) -> LayerWeights:  # type: ignore[override]
        if not 0 <= i < self.layout.layers:
            raise IndexError(i)
        return layer_weights(self.params, self.layout, i, self.lora_scale)


def fused_weights(params: Params, layout: Layout, lora_scale: float | None = None, *,
                  lazy: bool = False) -> FusedWeights:
    """The params tree rearranged for the shared decoder. The fused matrices are concatenations:
    copies, rebuilt after every update, and differentiable (gradients flow back to ``params``).
    LoRA adapters in the tree (``….lora_A.weight``/``….lora_B.weight``, scale ``lora_scale``)
    become each fused projection's :class:`Lora` (a projection some of whose parts have none
    gets zero blocks for those); adapters on the LM head are merged into its weight (``W + s·B·A``, the head's
    size). Where ``layout.norm_plus_one``, every norm weight is held as
    ``1 + w`` in float32 (what the norm scales by). ``lazy``: each layer is built when read
    (:class:`LazyLayers`), not all at once."""
    layers = LazyLayers(params, layout, lora_scale)
    embed = params["model.embed_tokens.weight"]
    head = params.get("lm_head.weight")
    tied = head is None and embed.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if head is None:  # tied: only the embedding is in the tree
        embed, head = TiedReads.apply(embed) if tied else (embed, embed)
    if lora_scale is not None and "lm_head.lora_A.weight" in params:  # adapters on the head: its weight merged
        head = head + lora_scale * (params["lm_head.lora_B.weight"] @ params["lm_head.lora_A.weight"])
    return FusedWeights(embed, layers if lazy else list(layers), _norm(params, layout, "model.norm.weight"),
                        head.t(), params.get("lm_head.bias"), tied)


class TiedReads(torch.autograd.Function):
    """A tied matrix read twice, by the embedding and by the LM head: two views of it whose gradients meet here.
    The embedding looks up sparse (the rows it read), and the backward adds those rows into the head's dense
    ``[v, hidden]`` gradient in place, so that gradient exists once in a step, not twice (autograd's own sum
    of a dense and a sparse gradient allocates a third). Not used under ``torch.compile``."""

    @staticmethod
    def forward(weight: Tensor) -> tuple[Tensor, Tensor]:
        return weight.view_as(weight), weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: tuple[Tensor, Tensor]) -> None:
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, lookup: Tensor | None, head: Tensor | None) -> Tensor | None:
        if head is None:  # the head unread (a critic's backbone)
            return None if lookup is None else lookup.to_dense()
        return head if lookup is None else head.add_(lookup)  # the head's gradient is this node's alone
