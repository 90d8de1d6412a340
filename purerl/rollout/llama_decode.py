"""A lean forward for sampling from Llama-family models, with a preallocated (static) KV cache.

Decoding through the HF module costs per token: a growing ``DynamicCache`` (one ``torch.cat`` per
layer and token, so O(T²) copying), mask construction and module dispatch, which dominate for
small models and on GPUs. Here one decoding step is a plain function of the params tree: RMSNorm,
rotary embeddings, grouped-query attention over a cache written in place, SwiGLU MLP, with q/k/v
and gate/up each fused into one matrix product (fewer, larger kernels). It computes
what ``LlamaForCausalLM`` computes, op for op, so its logits equal the module's (fp32: to ~1e-6;
``tests/test_llama_decode.py``). Models it does not cover (other architectures, rope variants that
rescale attention, sliding windows) go through the HF module as before: see :func:`supports`.

Shapes: ``b`` rows, ``s`` new positions, ``t`` cache capacity (prompt width + max new tokens),
``H`` query heads, ``K`` key/value heads, ``D`` head size.
"""

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = [
    "LlamaLayout",
    "StaticCache",
    "RotaryTable",
    "GraphedDecoder",
    "supports",
    "layout_of",
    "forward_last",
    "decode_step_static",
    "DecoderWeights",
    "decoder_weights",
]

_ARCHITECTURES = ("llama", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq changes, attention is not rescaled


def supports(model: Any) -> bool:
    """Whether :func:`forward_last` computes exactly what ``model`` (a CausalLM skeleton) does."""
    config = model.config
    rotary = getattr(getattr(model.module, "model", None), "rotary_emb", None)
    return (
        getattr(config, "model_type", None) in _ARCHITECTURES
        and getattr(config, "hidden_act", None) == "silu"
        and rotary is not None
        and getattr(rotary, "rope_type", None) in _ROPE_TYPES
        and float(getattr(rotary, "attention_scaling", 1.0)) == 1.0
        and not getattr(config, "use_sliding_window", False)
        and not getattr(config, "mlp_bias", False)
        and "model.rotary_emb.inv_freq" in model.buffers
    )


@attrs.frozen
class LlamaLayout:
    """Sizes and names of a Llama-family model (from its HF config)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def layout_of(config: Any) -> LlamaLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return LlamaLayout(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                       head_dim, float(config.rms_norm_eps))


@attrs.define
class StaticCache:
    """Keys and values of every layer, ``[b, K, t, D]`` each, filled in place; ``valid[b, t]`` marks
    the positions that are real tokens (left padding and unwritten slots are not)."""

    keys: list[Tensor]
    values: list[Tensor]
    valid: Bool[Tensor, "b t"]
    length: int = 0

    @classmethod
    def empty(cls, layout: LlamaLayout, rows: int, capacity: int, *, dtype: torch.dtype,
              device: torch.device) -> "StaticCache":
        shape = (rows, layout.kv_heads, capacity, layout.head_dim)
        # zeros, not empty: masked slots still enter the products (and NaN · 0 is NaN)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers)],
                   torch.zeros((rows, capacity), dtype=torch.bool, device=device))

    def repeat_rows(self, n: int) -> "StaticCache":
        """Every row ``n`` times in a row (``repeat_interleave``): one prefilled prompt per sample."""
        return StaticCache([k.repeat_interleave(n, 0) for k in self.keys], [v.repeat_interleave(n, 0) for v in self.values],
                           self.valid.repeat_interleave(n, 0), self.length)

    def select_rows(self, rows: Int[Tensor, " r"]) -> "StaticCache":
        """Only ``rows``, copied (the batch without its finished rows)."""
        return StaticCache([k[rows] for k in self.keys], [v[rows] for v in self.values], self.valid[rows], self.length)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``LlamaRMSNorm``: normalise in float32, cast back, then scale (bit-identical to the module)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@attrs.frozen(eq=False)
class RotaryTable:
    """``cos`` and sign-folded ``sin`` of every position below a capacity, ``[t, D]`` each, computed
    once per generate call. Rotating ``x`` at position ``p`` is
    ``x · cos[p] + roll(x, D/2) · sin[p]``, which equals HF's ``x · cos + rotate_half(x) · sin``
    value for value (``roll`` moves the halves as ``rotate_half`` does; the minus sign that
    ``rotate_half`` puts on the second half sits in ``sin`` here)."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def build(cls, inv_freq: Float[Tensor, " half"], capacity: int, *, dtype: torch.dtype,
              device: torch.device) -> "RotaryTable":
        freqs = torch.arange(capacity, device=device).float()[:, None] * inv_freq.float().to(device)
        return cls(torch.cat((freqs, freqs), -1).cos().to(dtype),
                   torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype))

    def at(self, positions: Int[Tensor, "b s"]) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` at ``positions``, ``[b, 1, s, D]`` (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@attrs.frozen(eq=False)
class LayerWeights:
    """One decoder layer with its projections fused: q, k, v in one matrix, gate and up in another."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    out: Tensor
    out_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor


@attrs.frozen(eq=False)
class DecoderWeights:
    """What the lean forward reads, built once per generate call by :func:`decoder_weights`."""

    embed: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    head: Tensor
    head_bias: Tensor | None


def decoder_weights(params: dict[str, Tensor], layout: LlamaLayout) -> DecoderWeights:
    """The params tree rearranged for decoding (the fused matrices are copies: rebuild after an update)."""

    def cat(*names: str) -> Tensor | None:
        parts = [params.get(n) for n in names]
        return None if parts[0] is None else torch.cat(parts)

    layers = []
    for i in range(layout.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if params.get(f"{m}.gate_proj.bias") is not None or params.get(f"{m}.down_proj.bias") is not None:
            raise ValueError("decoder_weights: MLP biases are not supported")
        layers.append(LayerWeights(
            params[f"model.layers.{i}.input_layernorm.weight"],
            cat(f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
            cat(f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
            params[f"{a}.o_proj.weight"], params.get(f"{a}.o_proj.bias"),
            params[f"model.layers.{i}.post_attention_layernorm.weight"],
            cat(f"{m}.gate_proj.weight", f"{m}.up_proj.weight"), params[f"{m}.down_proj.weight"]))
    embed = params["model.embed_tokens.weight"]
    return DecoderWeights(embed, layers, params["model.norm.weight"],
                          params.get("lm_head.weight", embed),  # tied: only the embedding is in the tree
                          params.get("lm_head.bias"))


def forward_last(
    weights: DecoderWeights,
    rotary: RotaryTable,
    layout: LlamaLayout,
    ids: Int[Tensor, "b s"],
    attend: Bool[Tensor, "b s"] | None,
    positions: Int[Tensor, "b s"],
    cache: StaticCache,
) -> Float[Tensor, "b v"]:
    """Run ``ids`` (new tokens at ``positions``; ``attend`` False for padding, None when every new
    position is a real token) through the model, appending their keys and values to ``cache``, and
    return the logits at the last position.

    Each new position attends to the valid cached positions and the valid new positions up to
    itself. A padding position attends only to itself (its output is never used, and this keeps
    its keys finite, so they can be masked without NaNs).
    """
    b, s = ids.shape
    start, stop = cache.length, cache.length + s
    cache.length = stop
    if s == 1 and attend is None:  # a decoding step: the new token sees every valid slot
        cache.valid[:, start] = True
        mask = cache.valid[:, None, None, :stop]
    else:
        cache.valid[:, start:stop] = True if attend is None else attend
        causal = torch.ones((s, stop), dtype=torch.bool, device=ids.device).tril(start)
        eye = F.pad(torch.eye(s, dtype=torch.bool, device=ids.device), (start, 0))
        mask = ((cache.valid[:, None, :stop] & causal[None]) | eye[None])[:, None]  # [b, 1, s, stop]

    scale = layout.head_dim ** -0.5
    gqa = layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.keys[i][:, :, start:stop] = k
        cache.values[i][:, :, start:stop] = v
        keys, values = cache.keys[i][:, :, :stop], cache.values[i][:, :, :stop]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)

    return _logits_of_last(weights, rotary.at(positions), layout, ids, attention)


def _logits_of_last(weights: DecoderWeights, rope: tuple[Tensor, Tensor], layout: LlamaLayout, ids: Tensor,
                    attention: Any) -> Tensor:
    """The decoder stack on ``ids`` at the positions ``rope`` was taken at; ``attention(layer, q, k,
    v)`` stores the new keys and values and returns the attention output ``[b, H, s, D]``. Logits
    of the last position. The hidden state stays ``[b·s, hidden]`` so every projection is one
    matrix product, with the residual added inside it (``addmm``)."""
    b, s = ids.shape
    heads, kv_heads, head_dim = layout.heads, layout.kv_heads, layout.head_dim
    cos, sin = rope
    h = F.embedding(ids.reshape(-1), weights.embed)
    for i, w in enumerate(weights.layers):
        qkv = _project(_rms_norm(h, w.input_norm, layout.eps), w.qkv, w.qkv_bias)
        qkv = qkv.view(b, s, heads + 2 * kv_heads, head_dim).transpose(1, 2)
        # q and k are adjacent heads of the fused product: one rotation for both
        qk, v = qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:]
        q, k = _rotate(qk, cos, sin).split((heads, kv_heads), dim=1)
        attn = attention(i, q, k, v).transpose(1, 2).reshape(b * s, heads * head_dim)
        h = _project(attn, w.out, w.out_bias, residual=h)
        gate, up = _project(_rms_norm(h, w.post_norm, layout.eps), w.gate_up).chunk(2, dim=-1)
        h = _project(F.silu(gate) * up, w.down, residual=h)
    last = h.view(b, s, -1)[:, -1]
    return _project(_rms_norm(last, weights.norm, layout.eps), weights.head, weights.head_bias)


def _project(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, residual: Tensor | None = None) -> Tensor:
    """``residual + x @ weightᵀ + bias`` for 2-d ``x`` (what ``F.linear`` computes, one kernel)."""
    if residual is None:
        return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
    out = torch.addmm(residual, x, weight.t())
    return out if bias is None else out + bias


def decode_step_static(
    weights: DecoderWeights,
    rotary: RotaryTable,
    layout: LlamaLayout,
    token: Int[Tensor, "b 1"],
    position: Int[Tensor, "b 1"],
    index: Int[Tensor, " 1"],
    cache: StaticCache,
) -> Float[Tensor, "b v"]:
    """One decoding step with every shape fixed (so that a CUDA graph can replay it): the token
    goes to cache slot ``index`` (a device tensor) and attention runs over the whole capacity,
    unwritten slots masked. Same result as :func:`forward_last` with ``s = 1``; ``cache.length``
    is not used or changed."""
    cache.valid.index_fill_(1, index, True)
    mask = cache.valid[:, None, None, :]  # [b, 1, 1, t]
    scale = layout.head_dim ** -0.5
    gqa = layout.heads != layout.kv_heads

    def attention(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.keys[i].index_copy_(2, index, k)
        cache.values[i].index_copy_(2, index, v)
        return F.scaled_dot_product_attention(q, cache.keys[i], cache.values[i], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)

    return _logits_of_last(weights, rotary.at(position), layout, token, attention)


class GraphedDecoder:
    """:func:`decode_step_static` captured once in a CUDA graph and replayed per token.

    Decoding a small model on a GPU is bound by kernel launches (hundreds per token); a replay is
    one launch. The graph is tied to ``cache`` (its batch and capacity), so one is captured per
    generate call: ``step(token, position)`` writes slot ``cache.length`` and advances it.
    """

    def __init__(self, weights: DecoderWeights, rotary: RotaryTable, layout: LlamaLayout, cache: StaticCache) -> None:
        device = cache.valid.device
        rows = cache.valid.shape[0]
        self.cache = cache
        self.token = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.index = torch.full((1,), cache.length, dtype=torch.long, device=device)
        valid = cache.valid.clone()  # warm-up and capture write slot `index`: undo afterwards

        def run() -> Tensor:
            return decode_step_static(weights, rotary, layout, self.token, self.position, self.index, cache)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = run()
        cache.valid.copy_(valid)

    def step(self, token: Int[Tensor, " b"], position: Int[Tensor, "b 1"]) -> Float[Tensor, "b v"]:
        self.token.copy_(token[:, None])
        self.position.copy_(position)
        self.index.fill_(self.cache.length)
        self.graph.replay()
        self.cache.length += 1
        return self.logits.clone()
