"""A tiny GPT-style transformer, run on text, whose memory makes the ``gpt-*`` corpora.

Pre-norm blocks (LayerNorm, causal multi-head attention, LayerNorm, GELU MLP), byte-level
vocabulary, ``d_model = 512``, 8 heads, MLP width 2048. Initialised as GPT-2 is (normal with
std 0.02, residual projections scaled by ``1/sqrt(2 L)``, zero biases, unit LayerNorm gains);
it is not trained. Written functionally (plain tensors, no ``nn.Module``) so that weights of
any size come straight out in bf16 and every intermediate can be captured. :class:`Block` is
the same block as an ``nn.Module``, for the training bench and the offload tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

D_MODEL = 512
HEADS = 8
MLP = 4 * D_MODEL
VOCAB = 256
LAYERS = 4
MAX_SEQ = 1024


def init_params(layers: int, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """GPT-2-style initial parameters: ``{name: tensor}`` in ``dtype`` on ``device``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=torch.float32)
        return t.normal_(0.0, std, generator=g).to(dtype)

    def const(n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value, device=device, dtype=dtype)

    resid = 0.02 / math.sqrt(2 * layers)
    p = {"wte": normal(VOCAB, D_MODEL), "wpe": normal(MAX_SEQ, D_MODEL, std=0.01)}
    for i in range(layers):
        p |= {
            f"h{i}.ln1.w": const(D_MODEL, 1.0),
            f"h{i}.ln1.b": const(D_MODEL, 0.0),
            f"h{i}.qkv.w": normal(3 * D_MODEL, D_MODEL),
            f"h{i}.qkv.b": const(3 * D_MODEL, 0.0),
            f"h{i}.proj.w": normal(D_MODEL, D_MODEL, std=resid),
            f"h{i}.proj.b": const(D_MODEL, 0.0),
            f"h{i}.ln2.w": const(D_MODEL, 1.0),
            f"h{i}.ln2.b": const(D_MODEL, 0.0),
            f"h{i}.fc1.w": normal(MLP, D_MODEL),
            f"h{i}.fc1.b": const(MLP, 0.0),
            f"h{i}.fc2.w": normal(D_MODEL, MLP, std=resid),
            f"h{i}.fc2.b": const(D_MODEL, 0.0),
        }
    p |= {"lnf.w": const(D_MODEL, 1.0), "lnf.b": const(D_MODEL, 0.0)}
    return p


def forward(p: dict, tokens: torch.Tensor, layers: int, sink: dict[str, list]) -> torch.Tensor:
    """Run ``tokens`` (``int64 [B, S]``) through the model, appending captures to ``sink``.

    ``sink`` keys: ``"act"`` (each block's output hidden state ``[B, S, d]`` and MLP activation
    ``[B, S, 4d]``), ``"kv"`` (K and V ``[B, S, H, d/H]``, the layout of a paged KV cache).
    Captured tensors are bf16.
    """
    b, s = tokens.shape
    x = p["wte"][tokens] + p["wpe"][:s]
    for i in range(layers):
        a = F.layer_norm(x, (D_MODEL,), p[f"h{i}.ln1.w"], p[f"h{i}.ln1.b"])
        q, k, v = F.linear(a, p[f"h{i}.qkv.w"], p[f"h{i}.qkv.b"]).split(D_MODEL, dim=-1)
        q, k, v = (t.reshape(b, s, HEADS, D_MODEL // HEADS) for t in (q, k, v))
        sink["kv"] += [k.to(torch.bfloat16), v.to(torch.bfloat16)]
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + F.linear(att.transpose(1, 2).reshape(b, s, D_MODEL), p[f"h{i}.proj.w"],
                         p[f"h{i}.proj.b"])
        m = F.layer_norm(x, (D_MODEL,), p[f"h{i}.ln2.w"], p[f"h{i}.ln2.b"])
        u = F.gelu(F.linear(m, p[f"h{i}.fc1.w"], p[f"h{i}.fc1.b"]))
        x = x + F.linear(u, p[f"h{i}.fc2.w"], p[f"h{i}.fc2.b"])
        sink["act"] += [x.to(torch.bfloat16), u.to(torch.bfloat16)]
    return F.layer_norm(x, (D_MODEL,), p["lnf.w"], p["lnf.b"])


class Block(nn.Module):
    """Pre-norm GPT block: ``[B, S, d]`` -> ``[B, S, d]``.

    ``sdpa``: attention by ``F.scaled_dot_product_attention`` (fast; the flash backward is not
    bit-deterministic) or written out (deterministic on every device). ``gelu``: the
    ``approximate`` argument of ``F.gelu``.
    """

    def __init__(self, d: int, heads: int, sdpa: bool = True, gelu: str = "tanh"):
        super().__init__()
        self.heads, self.sdpa, self.gelu = heads, sdpa, gelu
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            a = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.gelu))


_BYTES_PER_TOKEN = {"act": LAYERS * (D_MODEL + MLP) * 2, "kv": LAYERS * 2 * D_MODEL * 2}
_LAYER_PARAMS = 12 * D_MODEL * D_MODEL + 13 * D_MODEL


@torch.no_grad()
def capture(kind: str, nbytes: int, text: torch.Tensor, device: torch.device, seed: int):
    """At least ``nbytes`` bytes of the model's memory as a flat bf16 tensor on ``device``.

    Args:
        kind: ``"act"`` (hidden states and MLP activations), ``"kv"`` (K and V projections) or
            ``"weights"`` (all parameters; the model gets as many layers as it takes).
        text: ``uint8 [L]`` bytes whose values are the token ids (byte-level vocabulary).
    """
    if kind == "weights":
        layers = max(LAYERS, math.ceil(nbytes / (2 * _LAYER_PARAMS)))
        params = init_params(layers, device, torch.bfloat16, seed)
        return torch.cat([t.flatten() for t in params.values()])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    params = init_params(LAYERS, device, dtype, seed)
    tokens_needed = -(-nbytes // _BYTES_PER_TOKEN[kind])
    seq = min(MAX_SEQ, max(128, -(-tokens_needed // 64) * 64))
    batch = max(1, min(8, tokens_needed // seq))
    g = torch.Generator()
    g.manual_seed(seed)
    out: list[torch.Tensor] = []
    have = 0
    while have < nbytes:
        starts = torch.randint(0, max(1, text.numel() - seq), (batch, 1), generator=g)
        idx = (starts + torch.arange(seq)) % text.numel()
        sink: dict[str, list] = {"act": [], "kv": []}
        forward(params, text[idx].long().to(device), LAYERS, sink)
        for t in sink[kind]:
            out.append(t.flatten())
            have += t.numel() * 2
    return torch.cat(out)
