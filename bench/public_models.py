"""Public model definitions for ``bench.stock_models``, used as their libraries ship them.

``bench.stock_models`` also has models written here from torch primitives; these come from
other people's code, with nothing of ours in their forward:

* ``gpt2-*``, ``bert-*``, ``hf-llama-*``: Hugging Face ``transformers``' ``GPT2Model``,
  ``BertModel`` (no pooler) and ``LlamaModel``, built from a config (random weights, dropout
  off, the library's default attention: SDPA), fed embeddings (``inputs_embeds``) so that the
  input is the same ``[batch, seq, width]`` bf16 tensor as the other sequence models'.
* ``t5-*``: ``T5EncoderModel`` (T5 v1.1's gated-GELU feed-forward, relative position
  buckets, RMS-style layer norms without bias), fed embeddings like the others.
* ``qwen2-*``: ``Qwen2Model`` (128-wide heads, 6 query heads per key/value head, biased
  query / key / value projections, SwiGLU 5.8x wide); ``mixtral-*``: ``MixtralModel`` (8
  experts, 2 routed per token: which tokens each expert's saved tensors hold, and so their
  sizes, follow the router from step to step). Both added in session 90, never tuned on.
* ``tv-resnet50``, ``tv-vit-b16``, ``tv-convnext-t``, ``tv-swin-t``:
  ``torchvision.models.resnet50``, ``vit_b_16``, ``convnext_tiny`` and ``swin_t`` (random
  weights; stochastic depth off, which would draw a different path each step), fed
  ``[batch, 3, size, size]`` images. ConvNeXt's blocks run a depthwise convolution, then
  LayerNorm and two Linear layers on a channels-last permutation, a layer scale and a residual;
  Swin's shift windows with ``torch.roll`` and attend within them: shapes of saved tensors that
  none of the other models make.
* ``tv-efficientnet-b0``, ``tv-densenet121`` (session 90, never tuned on): EfficientNet-B0's
  inverted bottlenecks (depthwise convolutions, SiLU, squeeze-and-excitation: many small saved
  tensors) and DenseNet-121's dense layers (each concatenates every earlier feature map of
  its block and normalises the concatenation: saved tensors that grow through a block).
  Dropout and stochastic depth are off in every torchvision model (a random path each step).
* Second sizes (session 91): ``qwen2-896`` (Qwen2-0.5B's width, 12 layers, batch 4 x 2048),
  ``mixtral-2048`` (6 layers, batch 4 x 2048), ``t5-768`` (T5 v1.1-base's width, 12 layers,
  batch 16 x 512), ``tv-efficientnet-b0-128`` (batch 128).

Each builder returns ``(model, input shape)``, the model in fp32 on the default device with a
``layers`` attribute: the blocks the hooks group by (``offload_module(blocks=...)``) and FSDP2
shards one by one.
"""

from __future__ import annotations

import torch.nn as nn

# family -> the attribute path of its blocks inside the library's model
_BLOCKS = {"hf-gpt2": "h", "hf-bert": "encoder.layer", "hf-llama": "layers",
           "hf-t5": "encoder.block", "hf-qwen2": "layers", "hf-mixtral": "layers",
           "tv-vit": "encoder.layers"}


def _stack(body, blocks: list, forward) -> nn.Module:
    """``body`` wrapped as a module whose ``layers`` are ``blocks`` and whose ``forward(x)`` is
    ``forward(body, x)``."""
    return _Stack(body, blocks, forward)


class _Stack(nn.Module):
    """:func:`_stack`'s module. One class for every model, defined here: FSDP2's
    ``fully_shard`` keeps the class it makes for each module class in a module-level cache
    for the process's life, keyed by that class. A class made per call, its ``__init__``
    closing over the model's parts, kept every model wrapped so alive through that cache:
    under FSDP2 the interleaved bench's later models started on 0.6 GiB a rank of an earlier
    model's parameter and gradient shards (``bench.dev_leftover``,
    ``bench/results/h200x2_de2195a_session53``)."""

    def __init__(self, body, blocks: list, forward):
        super().__init__()
        self.body = body
        self.layers = blocks  # a plain list: parameters() stays the library model's
        self._forward = forward

    def forward(self, x):
        return self._forward(self.body, x)


def _attr(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _hf(family: str, width: int, layers: int, seq: int):
    import transformers as tf

    heads = max(1, width // 64)
    common = dict(vocab_size=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "hf-gpt2":
        cfg = tf.GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=seq,
                            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **common)
        body = tf.GPT2Model(cfg)
    elif family == "hf-bert":
        cfg = tf.BertConfig(hidden_size=width, num_hidden_layers=layers,
                            num_attention_heads=heads, intermediate_size=4 * width,
                            max_position_embeddings=seq, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **common)
        body = tf.BertModel(cfg, add_pooling_layer=False)
    elif family == "hf-t5":  # T5 v1.1's proportions: 64-wide heads, a gated feed-forward
        cfg = tf.T5Config(d_model=width, d_kv=64, d_ff=int(2.75 * width) // 64 * 64,
                          num_layers=layers, num_heads=heads, dropout_rate=0.0,
                          feed_forward_proj="gated-gelu", is_encoder_decoder=False, **common)
        body = tf.T5EncoderModel(cfg)
    elif family == "hf-qwen2":  # Qwen2-1.5B's proportions
        cfg = tf.Qwen2Config(hidden_size=width, num_hidden_layers=layers,
                             num_attention_heads=max(1, width // 128),
                             num_key_value_heads=max(1, width // 768),
                             intermediate_size=int(5.83 * width) // 64 * 64,
                             max_position_embeddings=seq, **common)
        body = tf.Qwen2Model(cfg)
    elif family == "hf-mixtral":  # Mixtral's routing (8 experts, top 2), narrower experts
        cfg = tf.MixtralConfig(hidden_size=width, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                               intermediate_size=2 * width, num_local_experts=8,
                               num_experts_per_tok=2, router_jitter_noise=0.0,
                               max_position_embeddings=seq, **common)
        body = tf.MixtralModel(cfg)
    else:  # TinyLlama's proportions: 64-wide heads, 8 query heads per key/value head
        cfg = tf.LlamaConfig(hidden_size=width, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 8),
                             intermediate_size=int(2.75 * width) // 64 * 64,
                             max_position_embeddings=seq, **common)
        body = tf.LlamaModel(cfg)

    def forward(m, x):
        kw = {} if family == "hf-bert" else {"use_cache": False}
        return m(inputs_embeds=x, **kw).last_hidden_state

    return _stack(body, list(_attr(body, _BLOCKS[family])), forward)


def _torchvision(family: str, size: int):
    import torch
    import torchvision

    if family == "tv-resnet":
        body = torchvision.models.resnet50()
        blocks = [b for stage in (body.layer1, body.layer2, body.layer3, body.layer4)
                  for b in stage]
    elif family in ("tv-convnext", "tv-swin"):
        make = (torchvision.models.convnext_tiny if family == "tv-convnext"
                else torchvision.models.swin_t)
        body = make()
        # features: a stem, then stages of blocks with a downsampling layer between them
        blocks = [b for stage in body.features[1::2] for b in stage]
    elif family == "tv-efficientnet":
        body = torchvision.models.efficientnet_b0()
        # features: a stem, seven stages of inverted bottlenecks, a last convolution
        blocks = [b for stage in body.features[1:-1] for b in stage]
    elif family == "tv-densenet":
        body = torchvision.models.densenet121()
        blocks = [layer for name, block in body.features.named_children()
                  if name.startswith("denseblock") for layer in block.values()]
    else:
        body = torchvision.models.vit_b_16(image_size=size)
        # torchvision starts the classifier at zero: every gradient of the step would be zero,
        # and the stock bench's gradient check would pass whatever the restores returned
        torch.nn.init.normal_(body.heads.head.weight, std=0.02)
        blocks = list(_attr(body, _BLOCKS[family]))
    for mod in body.modules():  # the same path every step and arm (swin_t's and
        # efficientnet_b0's builders fix the stochastic depth's rate: set to 0 here)
        if isinstance(mod, (torch.nn.Dropout, torchvision.ops.StochasticDepth)):
            mod.p = 0.0
    return _stack(body, blocks, lambda m, x: m(x))


def build_public(family: str, width: int, layers: int, batch: int, seq: int):
    """``(model, input shape)`` of a public model of ``family`` (``hf-gpt2``, ``hf-bert``,
    ``hf-llama``, ``hf-t5``: ``width`` wide, ``layers`` blocks, ``[batch, seq, width]``
    embeddings in; ``tv-resnet``, ``tv-vit``, ``tv-convnext``, ``tv-swin``: ``[batch, 3, seq,
    seq]`` images in, ``width`` and ``layers`` fixed by the library's definition)."""
    if family.startswith("hf-"):
        return _hf(family, width, layers, seq), (batch, seq, width)
    return _torchvision(family, seq), (batch, 3, seq, seq)


def available(family: str) -> bool:
    """Whether the library a model of ``family`` comes from is installed (torchvision is not
    in CI); the models written from torch primitives always are."""
    import importlib.util

    if family.startswith("hf-"):
        return importlib.util.find_spec("transformers") is not None
    return not family.startswith("tv-") or importlib.util.find_spec("torchvision") is not None
