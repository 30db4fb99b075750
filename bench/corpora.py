"""Benchmark corpora: batches of memory pages built from this machine, never downloaded.

Public API::

    CORPORA                      # {name: Corpus}, in report order
    build_corpus(name, nbytes, page_size=4096, device="cpu", seed=None) -> uint8 [N, P]
    element_size(name) -> int    # 1 for byte corpora, 2 (bf16) or 4 (fp32) for typed ones

``N = nbytes // page_size`` (at least one page). Every corpus is built with torch ops from
bytes read once per process (source files, shared libraries) or generated on ``device``; the
same ``seed`` gives the same pages on the same machine, ``seed=None`` fresh ones.
"""

from __future__ import annotations

import math
import os
import random
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from . import tinygpt


@dataclass(frozen=True)
class Corpus:
    """One corpus: ``element_size`` is the width of its values (1: untyped bytes)."""

    name: str
    element_size: int
    description: str
    build: Callable[[int, int, torch.device, torch.Generator, int], torch.Tensor]


# ----------------------------------------------------------------- file pools (cached)
_TEXT_SUFFIXES = (".py", ".h", ".hpp", ".hh", ".c", ".cc", ".cpp", ".cuh", ".txt", ".rst")
_BINARY_MAX_FILE = 4 << 20  # read at most this much of one library: keeps the pool varied


def _site_dirs() -> list[str]:
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _walk(roots: list[str], accept: Callable[[str], bool]) -> Iterator[str]:
    seen: set[str] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if not accept(name) or os.path.islink(path):
                    continue
                real = os.path.realpath(path)
                if real not in seen:
                    seen.add(real)
                    yield real


def _text_files() -> Iterator[str]:
    roots = [sysconfig.get_paths()["stdlib"], "/usr/include", *_site_dirs()]
    return _walk(roots, lambda n: n.endswith(_TEXT_SUFFIXES))


def _binary_files() -> Iterator[str]:
    roots = ["/usr/lib", "/usr/lib64", "/lib", *_site_dirs()]
    return _walk(roots, lambda n: n.endswith(".so") or ".so." in n)


class _Pool:
    """Bytes of files from ``files``, read lazily and kept for the life of the process."""

    def __init__(self, files: Callable[[], Iterator[str]], max_file: int | None = None):
        self._files = files
        self._it: Iterator[str] | None = None
        self._max_file = max_file
        self._buf = bytearray()
        self._done = False
        self.sources = 0

    @property
    def nbytes(self) -> int:
        return len(self._buf)

    def get(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` bytes as ``uint8 [L]`` (CPU) unless the machine has fewer."""
        if self._it is None:
            self._it = self._files()
        while len(self._buf) < nbytes and not self._done:
            path = next(self._it, None)
            if path is None:
                self._done = True
                break
            try:
                with open(path, "rb") as f:
                    data = f.read(-1 if self._max_file is None else self._max_file)
            except OSError:
                continue
            if data:
                self._buf += data
                self.sources += 1
        if not self._buf:
            raise RuntimeError("no source files found on this machine for this corpus")
        return torch.frombuffer(self._buf, dtype=torch.uint8)


TEXT_POOL = _Pool(_text_files)
BINARY_POOL = _Pool(_binary_files, _BINARY_MAX_FILE)


def _window(pool: _Pool, nbytes: int, gen: torch.Generator) -> torch.Tensor:
    """``nbytes`` contiguous bytes from a random start in the pool (tiled if it is short)."""
    data = pool.get(nbytes)
    length = data.numel()
    start = int(torch.randint(0, max(1, length - nbytes + 1), (1,), generator=gen))
    if length >= nbytes:
        return data[start : start + nbytes].clone()
    reps = -(-(nbytes + start) // length)
    return data.repeat(reps)[start : start + nbytes].clone()


def _random_pages(pool: _Pool, n: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` pages, each a window at a random byte offset of the pool: ``uint8 [n, P]``."""
    data = pool.get(max(16 << 20, n * page_size))
    if data.numel() < page_size:
        data = data.repeat(-(-page_size // data.numel()))
    starts = torch.randint(0, data.numel() - page_size + 1, (n, 1), generator=gen)
    return data[starts + torch.arange(page_size)]


# ------------------------------------------------------------------------- builders
def _text(n: int, p: int, device, gen, seed) -> torch.Tensor:
    return _window(TEXT_POOL, n * p, gen).view(n, p).to(device)


def _binary(n: int, p: int, device, gen, seed) -> torch.Tensor:
    return _window(BINARY_POOL, n * p, gen).view(n, p).to(device)


def _mixed(n: int, p: int, device, gen, seed) -> torch.Tensor:
    zeros = round(0.3 * n)
    texts = (n - zeros) // 2
    pages = torch.cat(
        [
            torch.zeros((zeros, p), dtype=torch.uint8),
            _random_pages(TEXT_POOL, texts, p, gen),
            _random_pages(BINARY_POOL, n - zeros - texts, p, gen),
        ]
    )
    return pages[torch.randperm(n, generator=gen)].to(device)


def _device_gen(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _randn(dtype: torch.dtype, relu: bool = False):
    def build(n: int, p: int, device, gen, seed) -> torch.Tensor:
        width = torch.empty((), dtype=dtype).element_size()
        x = torch.randn(n * p // width, generator=_device_gen(device, seed), device=device)
        if relu:
            x = torch.relu_(x)
        return x.to(dtype).view(torch.uint8).view(n, p)

    return build


def _random(n: int, p: int, device, gen, seed) -> torch.Tensor:
    g = _device_gen(device, seed)
    return torch.randint(0, 256, (n, p), generator=g, device=device, dtype=torch.uint8)


def _gpt(kind: str):
    def build(n: int, p: int, device, gen, seed) -> torch.Tensor:
        tokens = TEXT_POOL.get(4 << 20)
        data = tinygpt.capture(kind, n * p, tokens, device, seed)
        return data.view(torch.uint8)[: n * p].view(n, p)

    return build


# Periodic pages: a random pattern of 1..17 bytes repeated over the page, after a short
# random prefix. LZ4 encodes them as matches whose offset (the period) is shorter than their
# length, which decoders must copy byte by byte (overlapping), not as one block move.
_PERIOD_MAX = 17
_PREFIX_MAX = 15
_PERIODIC_CHUNK = 8 << 20  # bytes per gather: its int64 index takes 8 bytes per byte built


def _periodic(n: int, p: int, device, gen, seed) -> torch.Tensor:
    # Every random draw is made on the CPU generator, so a seed gives the same bytes on
    # every device; only the (integer, exact) gathers run on ``device``.
    period = torch.randint(1, _PERIOD_MAX + 1, (n, 1), generator=gen)
    prefix = torch.randint(0, _PREFIX_MAX + 1, (n, 1), generator=gen)
    pattern = torch.randint(0, 256, (n, _PERIOD_MAX), generator=gen, dtype=torch.uint8)
    head = torch.randint(0, 256, (n, _PREFIX_MAX), generator=gen, dtype=torch.uint8)
    period, prefix, pattern, head = (t.to(device) for t in (period, prefix, pattern, head))
    pos = torch.arange(p, device=device)
    out = torch.empty((n, p), dtype=torch.uint8, device=device)
    rows = max(1, _PERIODIC_CHUNK // p)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        phase = (pos - prefix[lo:hi]).clamp_(min=0) % period[lo:hi]
        out[lo:hi] = pattern[lo:hi].gather(1, phase)
    lead = out[:, :_PREFIX_MAX]
    lead.copy_(torch.where(pos[:_PREFIX_MAX] < prefix, head, lead))
    return out


# Encoder activations: what a stock pre-norm ``nn.TransformerEncoder`` saves for backward.
ENCODER_D_MODEL = 512
ENCODER_HEADS = 8
ENCODER_LAYERS = 4
_ENCODER_MAX_SEQ = 512
_ENCODER_MIN_SEQ = 32
# Bytes saved per token (bf16, all layers) by the capture below: measured, used only to size
# the batch; the capture runs until it has the bytes asked for.
_ENCODER_BYTES_PER_TOKEN = ENCODER_LAYERS * 12 * ENCODER_D_MODEL * 2


def _encoder_model(seed: int) -> tuple[nn.Embedding, nn.TransformerEncoder]:
    """A byte-level embedding and a stock pre-norm encoder, randomly initialised from ``seed``
    on the CPU (the same weights on every device)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embed = nn.Embedding(256, ENCODER_D_MODEL)
        layer = nn.TransformerEncoderLayer(
            ENCODER_D_MODEL, ENCODER_HEADS, 4 * ENCODER_D_MODEL, dropout=0.0,
            batch_first=True, norm_first=True,
        )
        model = nn.TransformerEncoder(layer, ENCODER_LAYERS, enable_nested_tensor=False)
        # The encoder deep-copies one layer, so its layers start equal: draw each afresh.
        for m in model.modules():
            if isinstance(m, nn.MultiheadAttention):
                m._reset_parameters()
            elif isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.reset_parameters()
    return embed, model


def _positions(seq: int, d: int) -> torch.Tensor:
    """Sinusoidal position encodings ``[seq, d]`` (fp32), as in "Attention is all you need"."""
    pos = torch.arange(seq, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    out = torch.empty(seq, d)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)
    return out


def encoder_capture(nbytes: int, text: torch.Tensor, device: torch.device,
                    gen: torch.Generator, seed: int) -> torch.Tensor:
    """At least ``nbytes`` bytes of activations saved for backward by a stock pre-norm
    ``nn.TransformerEncoder``, as a flat bf16 tensor on ``device``.

    The model (:func:`_encoder_model`) runs in training mode on windows of ``text`` (``uint8``
    bytes as token ids, byte-level vocabulary) drawn with ``gen``; every tensor that autograd
    saves (``saved_tensors_hooks``) is kept once per storage, in the order saved, when it is
    not a parameter and holds at least ``d_model`` values per token (layer-norm statistics and
    attention log-sum-exps are left out). On a GPU the model runs in bf16; on the CPU, where
    bf16 matmuls are slow, in fp32, its saved tensors rounded to bf16.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed, model = _encoder_model(seed)
    embed, model = embed.to(device, dtype), model.to(device, dtype)
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    tokens = -(-nbytes // _ENCODER_BYTES_PER_TOKEN)
    seq = min(_ENCODER_MAX_SEQ, max(_ENCODER_MIN_SEQ, -(-tokens // 32) * 32))
    batch = max(1, min(8, tokens // seq))
    pos = _positions(seq, ENCODER_D_MODEL).to(device, dtype)
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    have = 0

    def keep(t: torch.Tensor) -> torch.Tensor:
        nonlocal have
        ptr = t.untyped_storage().data_ptr()
        if (have < nbytes and t.dtype == dtype and ptr not in params and ptr not in seen
                and t.numel() >= batch * seq * ENCODER_D_MODEL):
            seen.add(ptr)
            whole = torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage())
            out.append(whole.detach().to(torch.bfloat16).flatten())
            have += out[-1].numel() * 2
        return t

    while have < nbytes:
        starts = torch.randint(0, max(1, text.numel() - seq), (batch, 1), generator=gen)
        idx = (starts + torch.arange(seq)) % text.numel()
        with torch.no_grad():
            x = embed(text[idx].long().to(device)) + pos
        seen.clear()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(x)
    return torch.cat(out)


def _encoder_act(n: int, p: int, device, gen, seed) -> torch.Tensor:
    data = encoder_capture(n * p, TEXT_POOL.get(4 << 20), device, gen, seed)
    return data.view(torch.uint8)[: n * p].view(n, p)


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in [
        Corpus("text", 1, "source files (Python stdlib, /usr/include, site-packages)", _text),
        Corpus("binary", 1, "shared libraries (.so under /usr/lib, site-packages)", _binary),
        Corpus("mixed", 1, "30% zero pages, text and binary pages, shuffled", _mixed),
        Corpus("bf16-randn", 2, "bf16 standard normal", _randn(torch.bfloat16)),
        Corpus("fp32-randn", 4, "fp32 standard normal", _randn(torch.float32)),
        Corpus("bf16-relu", 2, "bf16 ReLU(normal) activations", _randn(torch.bfloat16, True)),
        Corpus("random", 1, "uniform random bytes (control)", _random),
        Corpus("gpt-act", 2, "tiny GPT on text: hidden states + MLP activations, bf16",
               _gpt("act")),
        Corpus("gpt-kv", 2, "tiny GPT on text: K and V projections, bf16", _gpt("kv")),
        Corpus("gpt-weights", 2, "tiny GPT weights, bf16", _gpt("weights")),
        Corpus("periodic", 1, "pages repeating a random 1..17-byte pattern after a short "
               "random prefix (overlapping LZ4 matches)", _periodic),
        Corpus("encoder-act", 2, "stock pre-norm nn.TransformerEncoder on text: activations "
               "saved for backward, bf16", _encoder_act),
    ]
}


def pool_stats() -> dict:
    """Files and bytes read so far into the text and binary pools (for the report)."""
    return {name: {"files": pool.sources, "bytes": pool.nbytes}
            for name, pool in (("text", TEXT_POOL), ("binary", BINARY_POOL))}


def element_size(name: str) -> int:
    """Width in bytes of the values of corpus ``name`` (1 for untyped byte corpora)."""
    return _get(name).element_size


def _get(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    return CORPORA[name]


def build_corpus(
    name: str,
    nbytes: int,
    page_size: int = 4096,
    device: torch.device | str = "cpu",
    seed: int | None = None,
) -> torch.Tensor:
    """Build ``nbytes // page_size`` pages (at least one) of corpus ``name``.

    Returns:
        A contiguous ``uint8 [N, page_size]`` tensor on ``device``. Typed corpora hold their
        values' bytes (little-endian); view them back with ``.view(torch.bfloat16)`` etc.
    """
    corpus = _get(name)
    if page_size <= 0 or page_size % 64:
        raise ValueError(f"page_size must be a positive multiple of 64, got {page_size}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    seed = random.randrange(1 << 62) if seed is None else int(seed)
    gen = torch.Generator()
    gen.manual_seed(seed)
    n = max(1, nbytes // page_size)
    pages = corpus.build(n, page_size, device, gen, seed)
    assert pages.shape == (n, page_size) and pages.dtype == torch.uint8
    return pages.contiguous()
