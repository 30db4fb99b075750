"""Activation offload on architectures nobody here shaped: transformers' model classes as the
library ships them (random weights at toy sizes, dropout off, bf16, CPU), each under
``prefer="memory"``, a plain copy and ``prefer="speed"``: every parameter's gradient must be
bit-identical to the step without offload.

The stock bench (``bench.stock_models``) measures speed and memory on a few of these at full
size on a GPU; this file is about correctness on many: sliding-window attention (Mistral),
grouped-query attention (Qwen2, Gemma), mixtures of experts whose routing saves index
tensors and gathered tokens (Mixtral, Qwen2-MoE), fused QKV (Phi-3, GPT-NeoX, Falcon),
ALiBi (BLOOM), disentangled relative attention (DeBERTa-v2), learned positions (OPT,
RoBERTa, DistilBERT), partial rotary (GPT-J), a state-space model with no attention at
all (Mamba), encoder-decoders (T5, BART) and a speech encoder behind convolutions (wav2vec
2.0). Each saves tensors of its own shapes, dtypes and views; the hooks must bring
every one back exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

import torch_pagecomp as pc
from bench.public_models import _attr
from torch_pagecomp.offload._paged import PagedStore

tf = pytest.importorskip("transformers")

VOCAB = 512


def _configs() -> dict:
    """name -> (config class, config kwargs, model class, attribute paths of its blocks
    (space-separated: an encoder's, then a decoder's), inputs: :func:`_inputs`)."""
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, vocab_size=VOCAB)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return {
        "mistral": ("MistralConfig", dict(small, num_key_value_heads=2, sliding_window=16),
                    "MistralModel", "layers"),
        "qwen2": ("Qwen2Config", dict(small, num_key_value_heads=2), "Qwen2Model", "layers"),
        "mixtral": ("MixtralConfig", dict(small, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2), "MixtralModel", "layers"),
        "qwen2-moe": ("Qwen2MoeConfig", dict(small, num_key_value_heads=2, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=64,
                                             shared_expert_intermediate_size=128),
                      "Qwen2MoeModel", "layers"),
        "gemma": ("GemmaConfig", dict(small, num_key_value_heads=1, head_dim=32), "GemmaModel",
                  "layers"),
        "phi3": ("Phi3Config", dict(small, num_key_value_heads=4, pad_token_id=0,
                                    bos_token_id=0, eos_token_id=0), "Phi3Model", "layers"),
        "gpt-neox": ("GPTNeoXConfig", dict(small, hidden_dropout=0.0, attention_dropout=0.0),
                     "GPTNeoXModel", "layers"),
        "falcon": ("FalconConfig", dict(hidden_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, vocab_size=VOCAB,
                                        hidden_dropout=0.0, attention_dropout=0.0),
                   "FalconModel", "h"),
        "bloom": ("BloomConfig", dict(hidden_size=128, n_layer=3, n_head=4, vocab_size=VOCAB,
                                      hidden_dropout=0.0, attention_dropout=0.0),
                  "BloomModel", "h"),
        "deberta-v2": ("DebertaV2Config", dict(small, **no_dropout, relative_attention=True,
                                               pos_att_type=["p2c", "c2p"]),
                       "DebertaV2Model", "encoder.layer"),
        "opt": ("OPTConfig", dict(hidden_size=128, ffn_dim=256, num_hidden_layers=3,
                                  num_attention_heads=4, word_embed_proj_dim=128,
                                  vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0),
                "OPTModel", "decoder.layers"),
        "roberta": ("RobertaConfig", dict(small, **no_dropout), "RobertaModel",
                    "encoder.layer"),
        "distilbert": ("DistilBertConfig", dict(dim=128, hidden_dim=256, n_layers=3, n_heads=4,
                                                vocab_size=VOCAB, dropout=0.0,
                                                attention_dropout=0.0),
                       "DistilBertModel", "transformer.layer"),
        "gpt-j": ("GPTJConfig", dict(n_embd=128, n_layer=3, n_head=4, rotary_dim=16,
                                     vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                  "GPTJModel", "h"),
        "mamba": ("MambaConfig", dict(hidden_size=64, state_size=8, num_hidden_layers=3,
                                      vocab_size=VOCAB), "MambaModel", "layers"),
        # encoder-decoders: the decoder's cross-attention saves the encoder's output
        "t5": ("T5Config", dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                                dropout_rate=0.0, vocab_size=VOCAB, decoder_start_token_id=0,
                                pad_token_id=0), "T5Model", "encoder.block decoder.block",
               "seq2seq"),
        "bart": ("BartConfig", dict(d_model=128, encoder_layers=2, decoder_layers=2,
                                    encoder_attention_heads=4, decoder_attention_heads=4,
                                    encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=VOCAB,
                                    dropout=0.0, attention_dropout=0.0,
                                    activation_dropout=0.0, max_position_embeddings=64),
                 "BartModel", "encoder.layers decoder.layers", "seq2seq"),
        # speech: a convolutional feature extractor (group norm) before the transformer
        "wav2vec2": ("Wav2Vec2Config", dict(hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            conv_dim=(32, 32), conv_stride=(5, 2),
                                            conv_kernel=(10, 3), num_feat_extract_layers=2,
                                            hidden_dropout=0.0, attention_dropout=0.0,
                                            activation_dropout=0.0, feat_proj_dropout=0.0,
                                            layerdrop=0.0, mask_time_prob=0.0,
                                            num_conv_pos_embeddings=16,
                                            num_conv_pos_embedding_groups=4),
                     "Wav2Vec2Model", "encoder.layers", "audio"),
    }


CONFIGS = _configs()


def _model(name: str, device: str) -> tuple[torch.nn.Module, list]:
    cfg_cls, kwargs, model_cls, paths = CONFIGS[name][:4]
    if not hasattr(tf, cfg_cls) or not hasattr(tf, model_cls):
        pytest.skip(f"transformers {tf.__version__} has no {model_cls}")
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, cfg_cls)(**kwargs)).to(device, torch.bfloat16)
    return model, [b for path in paths.split() for b in _attr(model, path)]


def _inputs(name: str, gen: torch.Generator, device: str) -> dict:
    """A batch of 2 for model ``name``: token ids (and a decoder's, for an encoder-decoder),
    or a waveform."""
    kind = CONFIGS[name][4] if len(CONFIGS[name]) > 4 else "ids"
    if kind == "audio":
        return {"input_values": torch.randn(2, 1600, generator=gen).to(device, torch.bfloat16)}
    out = {"input_ids": torch.randint(0, VOCAB, (2, 48), generator=gen).to(device)}
    if kind == "seq2seq":
        out["decoder_input_ids"] = torch.randint(0, VOCAB, (2, 16), generator=gen).to(device)
    return out


def _grads(model, blocks, inputs: dict, settings: dict | None, cpu_store=None
           ) -> tuple[list, dict | None]:
    """One forward + backward (under the hooks of ``settings``; ``cpu_store``: a function
    making the store the hooks compress CPU tensors into): every parameter's gradient, and
    the offloader's stats."""
    model.zero_grad(set_to_none=True)
    off = None
    if settings is not None:
        off = pc.offload_module(model, blocks=blocks, offload_cpu=True, min_offload_bytes=1,
                                **settings)
        if cpu_store is not None:
            off._cpu_compressed = cpu_store()
    try:
        out = model(**inputs).last_hidden_state
        out.float().square().mean().backward()
        stats = off.stats() if off is not None else None
    finally:
        if off is not None:
            off.close()
            off.remove()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()], stats


def _check_offloads_match(model, grads, variants: tuple) -> None:
    """``grads(settings)`` -> ``(gradients, stats)`` of one step (``None``: no offload): under
    each of ``variants`` every parameter's gradient equals the step without offload, bit for
    bit, with deterministic algorithms, and bytes were offloaded."""
    with torch.random.fork_rng():
        torch.use_deterministic_algorithms(True)
        try:
            try:
                want, _ = grads(None)
            except RuntimeError as exc:  # an op of the model's own without a deterministic
                if "deterministic" not in str(exc):  # kernel on this device: nothing to compare
                    raise
                pytest.skip(f"the model's step is not deterministic here: {exc}")
            assert any(g is not None and g.abs().sum() > 0 for g in want)  # a real step
            for settings in variants:
                got, stats = grads(settings)
                assert stats["offloaded_bytes"] > 0, settings
                for (pname, _), w, g in zip(model.named_parameters(), want, got):
                    assert (w is None) == (g is None), (settings, pname)
                    assert w is None or torch.equal(w, g), (settings, pname)
        finally:
            torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_are_bit_identical_under_offload(name, device, gen):
    if device == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        pytest.skip("deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA "
                    "starts (bench/gpu_suite.sh sets it)")
    model, blocks = _model(name, device)
    inputs = _inputs(name, gen, device)
    _check_offloads_match(model, lambda settings: _grads(model, blocks, inputs, settings),
                          ({"prefer": "memory"}, {"mode": "uncompressed"}, {"prefer": "speed"}))


@pytest.mark.parametrize("mode", ["checkpointing", "autocast"])
@pytest.mark.parametrize("name", ["mistral", "deberta-v2", "mamba"])
def test_gradients_are_bit_identical_with_checkpointing_or_autocast(name, mode, gen):
    """The same on the CPU with the library's activation checkpointing (non-reentrant: the
    checkpointed blocks save only their inputs, recomputed under the hooks in the backward),
    and with an fp32 model under bf16 autocast (fp32 and bf16 saved tensors side by side)."""
    model, blocks = _model(name, "cpu")
    if mode == "checkpointing":
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # (the name since 5.x)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
    else:
        model.float()
    inputs = _inputs(name, gen, "cpu")

    def grads(settings):
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return _grads(model, blocks, inputs, settings)
        return _grads(model, blocks, inputs, settings)

    _check_offloads_match(model, grads, ({"prefer": "memory"}, {"mode": "uncompressed"}))


class _PagedOnCpu(PagedStore):
    """The GPU's compressed store (slices placed in the virtual arena, the batched restores of
    placed slices), its kernels run by the Triton interpreter, in the CPU store's place: the
    hooks call a CPU store's ``offload(src, element_size, float_format)``."""

    def offload(self, src, element_size, float_format=None):
        return super().offload(src, element_size, float_format=float_format)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the GPU's store on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("name", ["mixtral", "t5", "mamba"])
def test_hooks_on_the_gpus_compressed_store_keep_gradients(name, gen):
    """The hooks' compressed path with the store a GPU uses (``PagedStore``: the arena, slice
    placement, chunk reuse, the batched restores), driven on the CPU with small chunks and
    slices so that tensors cross them: gradients bit-identical to no offload. CI has no GPU;
    this runs that store's bookkeeping under real saved tensors (a mixture of experts, an
    encoder-decoder, a state-space model), though not its streams."""
    model, blocks = _model(name, "cpu")
    inputs = _inputs(name, gen, "cpu")
    made = []

    def store():
        made.append(_PagedOnCpu(torch.device("cpu"), 4096, chunk_bytes=1 << 17,
                                slice_bytes=1 << 15))
        return made[-1]

    _check_offloads_match(model, lambda settings: _grads(model, blocks, inputs, settings,
                                                         cpu_store=store),
                          ({"prefer": "memory"},))
    assert made and made[-1].arena.pins > 0  # the store was used: it backed chunks
