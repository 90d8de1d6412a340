"""The Tinker API served by purerl: the unmodified ``tinker`` SDK (0.38) trains and samples local models.

``python3 -m purerl.tinker --model PATH`` (:mod:`purerl.tinker.__main__`) serves a local Hugging Face
causal LM on loopback and prints ``export TINKER_BASE_URL=… TINKER_API_KEY=tml-…``. Each training
client is a model over the one frozen base: LoRA adapters (:mod:`purerl.models.lora`) or, when
``create_model`` carries no ``lora_config``, every weight. Its calls run in ``seq_id`` order on one
compute thread (:mod:`.futures`), as purerl's pure pieces: the policy forward and
``value_and_grad`` for ``forward``/``forward_backward``, the loss maths of
:mod:`purerl.algo.policy_loss` in ``SumCount`` form (:mod:`.losses`), ``purerl.optim.adamw`` for
``optim_step`` (:mod:`.trainer`), the embedded engine for ``sample`` over numbered immutable sampler
snapshots (:mod:`.sampler`), and purerl's checkpoint format behind ``tinker://`` names (:mod:`.store`),
which the rest client's training-run calls describe so that a killed cookbook run resumes (:mod:`.runs`).

Choices where the SDK leaves the semantics open:

- **Reduction**: every loss is a sum over the batch's tokens (``loss:sum``), weighted by
  ``weights`` (cross-entropy) or the advantages; gradients accumulate over ``forward_backward``
  calls until ``optim_step`` applies their sum (no division by a token or sequence count).
- **Log-probs at temperature ≠ 1**: ``forward``/``forward_backward`` return the learner's log-probs
  at temperature 1; ``sample`` returns those of the distribution each token was drawn from
  (``logits / temperature``, after top-k/top-p, renormalised), so they differ from the learner's
  unless temperature is 1 and nothing is truncated.
- **LoRA alpha**: 32 (``--lora-alpha``), so adapters scale by ``32 / rank`` (purerl's default,
  SkyRL's choice); ``B`` starts at zero and a new model computes its base exactly. ``seed`` seeds
  ``A``'s init.
- **train_unembed** (the SDK's default True): a LoRA adapter on the output projection, ``W_out +
  s·B·A``; with tied embeddings (SmolLM2) it adapts the output side only, the input embedding
  stays the base's. ``train_attn``: ``q,k,v,o_proj``; ``train_mlp``: ``gate,up,down_proj``.
- **Adam**: the request's ``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``
  (decoupled, ``torch.optim.AdamW``'s) per step; ``grad_clip_norm > 0`` clips the accumulated
  gradient's global norm first (``torch.nn.utils.clip_grad_norm_``'s rule).
- **Stops**: a list of token ids replaces EOS as the sample's end (``[]``: only ``max_tokens``);
  strings end it once the text holds one; the ending token is kept. ``max_tokens`` None: the room
  left in the model's context.

Refused in one line, never approximated: the losses ``stable_reinforce``, ``custom`` and ``gspo``,
``cispo`` without thresholds and ``dro`` without ``beta``, per-token clip thresholds that differ
within a batch; prompt log-probs (and top-k, target and alternative-token variants); image and
audio chunks; sparse or 2-d loss inputs; ``inflight`` sampler weights; optimizers other than AdamW;
unknown fields in any request (the SDK's own pydantic types parse them). Provenance spans (which the
cookbook attaches to every sampled datum) must tile their fields and are otherwise unused: no
served loss reads them. Checkpoints never expire (``ttl_seconds`` is accepted, not enforced).
"""
