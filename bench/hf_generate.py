"""Greedy generation with Hugging Face ``transformers``: stock KV caches against ours.

Model: a Llama-architecture ``LlamaForCausalLM`` built from a ``LlamaConfig`` with random weights
(``torch.manual_seed(0)``; no download): hidden 2048, intermediate 5632, 16 heads, 4 KV heads
(grouped-query attention, head dim 128), ``--layers`` layers, vocab 32000, SDPA attention; bf16
on CUDA, float32 on the CPU. Input: random token ids ``[batch, prompt]`` (seed 1). No EOS token,
so every run generates exactly ``--new`` tokens (``do_sample=False``).

Caches (each variant in a fresh child process: a fresh CUDA context, clean peaks):

* ``dynamic``: ``DynamicCache(config=model.config)``, everything on the GPU;
* ``dynamic_repeat``: the same again in another child: how far the baseline agrees with itself;
* ``dynamic_offloaded``: ``DynamicCache(config=model.config, offloading=True)``, transformers'
  own offload (whole layers to the CPU and back, every step);
* ``compressed``: ``torch_pagecomp.integrations.transformers.CompressedOffloadedCache`` (sealed
  ``--block-tokens`` blocks compressed in host memory, the tail on the GPU; bf16 blocks
  through the exponent codec, its default);
* ``compressed_lz4``: the same with ``codec="lz4"`` (LZ4 on bit-shuffled 2-byte elements).

Per child: one warm-up generate (a short prompt, long enough to seal blocks of the compressed
cache, 4 new tokens; its own cache, closed), then one timed generate with a new cache
(``output_logits=True``: every step's logits are kept, for the diagnostics below). Times are
host wall times with ``torch.cuda.synchronize()`` before and after. ``prefill_s`` is the time to
the first generated token in that same run, taken by a streamer at its first generated token
(``generate`` hands tokens to the streamer after copying them to the host, so the device has
finished the prefill and the first token then); ``decode_tokens_per_s`` is
``(new - 1) * batch / (total_s - prefill_s)``. ``peak_gpu_gib``: ``max_memory_allocated`` over
the timed run (model weights included: ``model_gib``), ``peak_prefill_gib`` the same up to the
first token (where the peak falls); for ``compressed``, ``device_metadata_bytes``: the device
memory its stored blocks keep for their restore (page metadata) at the end,
``device_metadata_split`` the same as the blocks' own metadata and the layers' concatenated
copies, and ``device_metadata_first_token`` that split at the first token (the end of the
prefill, where the GPU peak falls). ``host_gib``: host
memory the cache holds
at the end: 0 for ``dynamic``; for ``dynamic_offloaded`` the bytes of its layer tensors then on
the CPU; for ``compressed`` the stored bytes of its compressed blocks (``cache.stats()``;
``host_pool_gib``: the page-locked chunks its stores hold, ``host_pool_peak_gib`` their peak;
the timed run's cache makes its own stores, so chunks are pinned inside the timed run).
``kv_gib``: the uncompressed KV of the whole sequence,
``layers * 2 * batch * kv_heads * head_dim * (prompt + new) * itemsize``.

Token identity: each row keeps its generated ids (``tokens``), a hash of each step's logits
(``logits_hash``), the margin between the top two logits of every step and row
(``top2_margin``) and fingerprints of the weights and the input. The driver compares every row
with ``dynamic``: ``tokens_identical_to_dynamic``, and for rows that differ ``divergence``: the
first step where a row's token differs, ``dynamic``'s margin there, and the first step whose
logits differ at all (bit for bit). ``--check-kv N`` adds, in every child but ``dynamic``'s, a
teacher-forced comparison with a ``DynamicCache`` in the same process over the prompt and
``N`` steps (``bench/hf_kvcheck.py``): whether the keys and values handed to attention, the
attention outputs and the logits were bit-identical, and where they first were not.

``--peak-origins`` (CUDA): the timed run records the allocator's history; ``peak_origins`` then
lists the device memory allocated at the moment of the run's peak by where it was allocated
(the innermost frame in ``torch_pagecomp``, else in ``transformers``, else the innermost Python
frame), largest first, from a replay of the allocations and frees of the timed run (what was
allocated before it, the weights, is ``base``). Recording slows the run: its times are not
comparable with other rows.

    python -m bench.hf_generate --layers 16 --prompt 16384 --new 64 --out bench/out/hf.json

``--tiny`` (CPU, CI): 2 layers, hidden 64, prompt 40, 6 new tokens, 16-token blocks. On the CPU
``dynamic_offloaded`` is attempted and, where transformers' offloading needs CUDA (5.24 calls
``torch.cuda.default_stream`` in ``Cache.update``), reported as skipped with that error.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import inspect
import json
import os
import sys
import threading
import time

from bench.children import cell, run_child, write_results

VARIANTS = ("dynamic", "dynamic_repeat", "dynamic_offloaded", "compressed", "compressed_lz4")
COMPRESSED = ("compressed", "compressed_lz4")
GIB = 1 << 30

# hidden, intermediate, heads, kv heads, vocab
FULL = dict(hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000)
TINY = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, layers=2, prompt=40,
            new=6, block_tokens=16)


def _sizes(args) -> dict:
    s = dict(FULL, layers=args.layers, prompt=args.prompt, new=args.new,
             block_tokens=args.block_tokens or 256)
    if args.tiny:
        s.update(TINY)
        if args.block_tokens:
            s["block_tokens"] = args.block_tokens
    s["batch"] = args.batch
    s["check_kv"] = args.check_kv
    s["peak_origins"] = args.peak_origins
    return s


# ------------------------------------------------------------------------------- one run
def build(s: dict, device: str):
    """``(model, input_ids)``: a random-weight Llama on ``device``, seeded."""
    import torch
    import transformers as tr

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = tr.LlamaConfig(
        hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
        max_position_embeddings=max(4096, s["prompt"] + s["new"]),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = tr.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                    attn_implementation="sdpa")
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["prompt"]), generator=gen).to(device)
    return model, ids


def cache_kwarg(model) -> str:
    """The keyword ``generate`` takes a user cache by: ``cache`` (transformers 5.x; it maps the
    deprecated ``past_key_values`` onto it), ``past_key_values`` in older releases."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else (
        "past_key_values")


def make_cache(variant: str, model, block_tokens: int):
    import transformers as tr

    if variant in ("dynamic", "dynamic_repeat"):
        return tr.DynamicCache(config=model.config)
    if variant == "dynamic_offloaded":
        return tr.DynamicCache(config=model.config, offloading=True)
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    codec = "lz4" if variant == "compressed_lz4" else "auto"
    return CompressedOffloadedCache(config=model.config, block_tokens=block_tokens, codec=codec)


def _close(cache) -> None:
    close = getattr(cache, "close", None)
    if callable(close):
        close()


class _FirstToken:
    """A streamer recording when ``generate`` hands over the first generated token (its first
    ``put`` is the prompt). ``generate`` copies the tokens to the host before handing them
    over, so the device has finished the prefill and the first token by then."""

    def __init__(self, sync, cache=None):
        self.sync, self.puts, self.t = sync, 0, None
        self.cache = cache  # the compressed cache, whose device metadata is read then too
        self.peak = None  # GPU bytes: the peak up to the first token (the prefill's)
        self.metadata = None  # ``_metadata_split`` of the cache at the first token

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.sync()
            self.t = time.perf_counter()
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self.peak = torch.cuda.max_memory_allocated()
            if self.cache is not None:
                self.metadata = _metadata_split(self.cache)

    def end(self):
        pass


def _metadata_bytes(cache) -> int:
    """Bytes of device memory the compressed cache's stored blocks keep for their restore (each
    slice's page metadata, and each layer's concatenated copy of it), counted once per
    allocation: what the cache holds on the device besides its tails."""
    return sum(_metadata_split(cache).values())


def _metadata_split(cache) -> dict[str, int]:
    """:func:`_metadata_bytes` in its two parts: ``slices`` (the blocks' own page metadata, made
    when they are stored) and ``group_copies`` (each layer's concatenated copy, made at its
    first restore), each allocation counted once."""
    seen: dict[int, tuple[str, int]] = {}
    for layer in cache.layers:
        group = getattr(layer, "_group", None)
        parts = [("slices", t) for stored in getattr(group, "storeds", ())
                 for sl in getattr(stored, "slices", ())
                 for t in (sl.rel, sl.sizes, sl.kinds)]
        parts += [("group_copies", t) for t in (getattr(group, "meta", None) or ())]
        for part, t in parts:
            if t is not None and t.is_cuda:
                st = t.untyped_storage()
                seen.setdefault(st.data_ptr(), (part, st.nbytes()))
    out = {"slices": 0, "group_copies": 0}
    for part, nbytes in seen.values():
        out[part] += nbytes
    return out


def peak_origins(trace: list[dict], base: int = 0, top: int = 12) -> dict:
    """Device memory allocated at the peak of an allocator trace (``torch.cuda.memory.
    _snapshot()["device_traces"][i]``: ``alloc`` adds a block, ``free_requested`` removes it, as
    ``memory_allocated`` counts them), grouped by origin (:func:`_origin`): ``{"peak_bytes",
    "base", "origins": [[origin, bytes], ...]}``, the ``top`` largest and the rest as "(rest)"."""
    live, total, peak, at = {}, base, base, -1
    for i, e in enumerate(trace):  # pass 1: where the peak is
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_requested":
            total -= live.pop(e["addr"], 0)
    live = {}
    for e in trace[:at + 1]:  # pass 2: what is allocated then
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    by = collections.Counter()
    for e in live.values():
        by[_origin(e.get("frames", ()))] += e["size"]
    ranked = by.most_common()
    out = [[k, v] for k, v in ranked[:top]]
    rest = sum(v for _, v in ranked[top:])
    if rest:
        out.append(["(rest)", rest])
    return {"peak_bytes": peak, "base": base, "origins": out}


def _origin(frames) -> str:
    """Where an allocation was made: the innermost frame in this package, else in
    transformers, else the innermost frame with a file name (``path:line function``)."""
    def name(f):
        path = f.get("filename", "")
        for marker in ("torch_pagecomp/", "transformers/"):
            if marker in path:
                path = marker + path.split(marker, 1)[1]
        return f"{path}:{f.get('line')} {f.get('name')}"

    frames = list(frames)
    for marker in ("torch_pagecomp/", "transformers/"):
        for f in frames:
            if marker in f.get("filename", ""):
                return name(f)
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return name(f)
    return "(no Python frame)"


def _held(cache, on_cpu: bool) -> int:
    """Bytes of the cache's layer tensors on the CPU (``on_cpu``) or elsewhere."""
    n = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and (t.device.type == "cpu") == on_cpu:
                n += t.numel() * t.element_size()
    return n


def run(variant: str, s: dict, device: str) -> dict:
    import torch
    import transformers as tr

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, ids = build(s, device)
    kw = cache_kwarg(model)
    prompt, new, batch = s["prompt"], s["new"], s["batch"]
    row = {"variant": variant, "layers": s["layers"], "prompt": prompt, "new": new,
           "batch": batch, "block_tokens": s["block_tokens"] if variant in COMPRESSED else None,
           "cache_kwarg": kw}

    def generate(inp, max_new, cache, streamer=None):
        return model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                              do_sample=False, streamer=streamer, output_logits=True,
                              return_dict_in_generate=True, **{kw: cache})

    # warm-up: kernels compiled, pools grown; long enough to seal compressed blocks
    warm_prompt = min(prompt, max(128, 2 * s["block_tokens"]))
    cache = make_cache(variant, model, s["block_tokens"])
    try:
        generate(ids[:, :warm_prompt], min(4, new), cache)
    except Exception as e:  # transformers' offloading is CUDA-only: say so instead of failing
        if variant != "dynamic_offloaded" or cuda:
            raise
        _close(cache)
        row["skipped"] = (f"DynamicCache(offloading=True) on {device} with transformers "
                          f"{tr.__version__}: {type(e).__name__}: {e}")
        return row
    _close(cache)
    del cache
    sync()
    if cuda:
        torch.cuda.empty_cache()
        row["model_gib"] = torch.cuda.memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()

    # the timed run
    cache = make_cache(variant, model, s["block_tokens"])
    first = _FirstToken(sync, cache if variant in COMPRESSED else None)
    record = cuda and s.get("peak_origins")
    if record:
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    sync()
    t0 = time.perf_counter()
    out = generate(ids, new, cache, first)
    sync()
    total = time.perf_counter() - t0
    if record:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        row["peak_origins"] = peak_origins(trace, base)
        row["peak_origins"]["trace_events"] = len(trace)
    if cuda:
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GIB
        if first.peak is not None:  # where the peak falls: the prefill's, or later (decoding)
            row["peak_prefill_gib"] = first.peak / GIB
    gen_ids = out.sequences[:, prompt:].tolist()
    row.update(_logit_stats(out.logits))
    row["weights_hash"] = _fingerprint(list(model.parameters()))
    row["input_hash"] = _fingerprint([ids])
    prefill = first.t - t0 if first.t is not None else None
    row.update(
        total_s=total, prefill_s=prefill,
        decode_tokens_per_s=((new - 1) * batch / (total - prefill)
                             if prefill is not None and new > 1 and total > prefill else None),
        new_tokens=len(gen_ids[0]), tokens=gen_ids,
        cache_seq_length=cache.get_seq_length(),
    )
    head_dim = s["hidden"] // s["heads"]
    itemsize = next(model.parameters()).element_size()
    row["kv_gib"] = (s["layers"] * 2 * batch * s["kv_heads"] * head_dim * (prompt + new)
                     * itemsize / GIB)
    if variant in COMPRESSED:
        st = cache.stats()
        row["host_gib"] = st["host_bytes"] / GIB
        row["cache_on_device_gib"] = st["device_tail_bytes"] / GIB
        row["ratio"] = st["ratio"]
        row["cache_stats"] = st
        row["host_pool_gib"] = st["host_held_bytes"] / GIB
        row["host_pool_peak_gib"] = st["host_peak_held_bytes"] / GIB
        row["stores"] = {str(d): store.stats() for d, store in cache.stores.items()}
        row["device_metadata_bytes"] = _metadata_bytes(cache)
        row["device_metadata_split"] = _metadata_split(cache)
        if first.metadata is not None:  # at the first token: the prefill's, where the peak is
            row["device_metadata_first_token"] = first.metadata
    else:
        on_cpu = _held(cache, on_cpu=True)
        row["host_gib"] = (on_cpu if variant == "dynamic_offloaded" else 0) / GIB
        row["cache_on_device_gib"] = (_held(cache, on_cpu=False) if cuda else on_cpu) / GIB
    _close(cache)
    del cache
    if s["check_kv"] and variant != "dynamic":
        from bench.hf_kvcheck import check_kv

        ref_cache, cache = tr.DynamicCache(config=model.config), make_cache(
            variant, model, s["block_tokens"])
        try:
            row["kv_check"] = check_kv(model, ids, cache, ref_cache, s["check_kv"], kw)
        finally:
            _close(cache)
        del ref_cache, cache
    codec = sys.modules.get("torch_pagecomp.cpu_codec")
    if codec is not None:  # the CPU codec's process-wide worker pool (else joined at exit)
        codec.shutdown_pool()
    row["threads_after_close"] = sorted(
        t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    return row


def _logit_stats(logits) -> dict:
    """Per step (``logits``: one ``[batch, vocab]`` tensor per generated token): a hash of the
    logits' bytes, and per row the margin between the two largest logits."""
    import torch

    steps = torch.stack([t.float() for t in logits])  # [steps, batch, vocab]
    top = steps.topk(2, dim=-1).values
    hashes = [hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16] for t in steps]
    return {"logits_hash": hashes, "top2_margin": (top[..., 0] - top[..., 1]).tolist()}


def _fingerprint(tensors) -> str:
    """A hash of the tensors' bit patterns, summed on their device (cheap for a model)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [t.detach().reshape(-1).view(ints[t.element_size()]).sum(dtype=torch.int64)
            for t in tensors]
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------------------ driver
def _child(args, variant: str, s: dict) -> dict:
    argv = ["--child", variant, "--layers", str(args.layers), "--prompt", str(args.prompt),
            "--new", str(args.new), "--batch", str(args.batch), "--device", args.device]
    if args.block_tokens:
        argv += ["--block-tokens", str(args.block_tokens)]
    if args.check_kv:
        argv += ["--check-kv", str(args.check_kv)]
    if args.deterministic:
        argv.append("--deterministic")
    if args.tiny:
        argv.append("--tiny")
    if args.peak_origins:
        argv.append("--peak-origins")
    base = {"variant": variant, "layers": s["layers"], "prompt": s["prompt"], "new": s["new"],
            "batch": s["batch"]}
    return run_child("bench.hf_generate", argv, base, args.timeout,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tokens_hash(tokens) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _finish(rows: list[dict], meta: dict) -> dict:
    """Token identity against ``dynamic``, with a hash of the ids and, where they differ, where
    (see the module docstring)."""
    ref = next((r for r in rows if r["variant"] == "dynamic" and "tokens" in r), None)
    out = []
    for r in rows:
        r = dict(r)
        tokens = r.get("tokens")
        if tokens is not None:
            r["tokens_hash"] = _tokens_hash(tokens)
            if ref is not None:
                r["tokens_identical_to_dynamic"] = tokens == ref["tokens"]
                r["weights_identical_to_dynamic"] = r.get("weights_hash") == ref.get(
                    "weights_hash") and r.get("input_hash") == ref.get("input_hash")
                r["first_logits_diff_step"] = next(
                    (i for i, (a, b) in enumerate(zip(r.get("logits_hash", []),
                                                      ref.get("logits_hash", []))) if a != b),
                    None)
                if not r["tokens_identical_to_dynamic"]:
                    r["divergence"] = _divergence(tokens, ref)
        out.append(r)
    return {**meta, "rows": out}


def _divergence(tokens: list[list[int]], ref: dict) -> dict:
    """Where ``tokens`` first part from ``ref``'s, and how close ``ref``'s top two logits were
    there (a margin of 0 is a tie that the smallest difference turns over)."""
    first = {}
    for b, (ours, theirs) in enumerate(zip(tokens, ref["tokens"])):
        i = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
        if i is not None:
            first[b] = i
    step = min(first.values())
    rows = [b for b, i in first.items() if i == step]
    margins = ref.get("top2_margin")
    at = [margins[step][b] for b in rows] if margins else []
    flat = sorted(m for per_step in margins or [] for m in per_step)
    return {
        "first_step": step, "rows_first_differing": first,
        "dynamic_margin_at_first_step": min(at) if at else None,
        "dynamic_margin_min": flat[0] if flat else None,
        "dynamic_margin_median": flat[len(flat) // 2] if flat else None,
        "dynamic_exact_ties": sum(m == 0 for m in flat),
    }


def _kv_summary(check: dict | None) -> str:
    """``--check-kv``'s findings in a few words (``s``: step, ``L``: layer)."""
    if not check:
        return ""
    parts = []
    for key in ("kv", "attn"):
        where = check.get(key)
        if where is not None:
            extra = f" ({where['part']})" if "part" in where else ""
            parts.append(f"{key} s{where['step']} L{where['layer']}{extra}")
    for key in ("logits", "argmax"):
        if check.get(key) is not None:
            parts.append(f"{key} s{check[key]}")
    return "; ".join(parts) if parts else f"bit-identical over {check['steps']} steps"


def table(doc: dict) -> str:
    head = ("| variant | layers | batch | prompt | new | prefill s | total s | decode tok/s | "
            "decode vs dynamic | peak GPU GiB | host GiB | KV GiB | ratio | tokens identical | "
            "first token diff: step (dynamic margin) | first logits diff | kv check |")
    lines = [head, "|" + "---|" * 17]
    ref = next((r.get("decode_tokens_per_s") for r in doc["rows"]
                if r["variant"] == "dynamic"), None)
    g = lambda v: "" if v is None else f"{v:.3g}"  # noqa: E731
    for r in doc["rows"]:
        lead = f"| {r['variant']} | {r['layers']} | {r['batch']} | {r['prompt']} | {r['new']} | "
        if "error" in r or "skipped" in r:
            what = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(lead + what.replace("|", "/").replace("\n", " ")[:200] + " ||||||||||||")
            continue
        dec = r.get("decode_tokens_per_s")
        rel = f"{dec / ref:.2f}x" if dec and ref else ""
        div = r.get("divergence")
        first = "" if div is None else (
            f"{div['first_step']} ({g(div['dynamic_margin_at_first_step'])})")
        lines.append(
            lead + f"{cell(r['prefill_s'], 3)} | {cell(r['total_s'], 3)} | {cell(dec, 1)} | "
            f"{rel} | "
            f"{cell(r.get('peak_gpu_gib'))} | {g(r.get('host_gib'))} | {g(r.get('kv_gib'))} | "
            f"{cell(r.get('ratio'), 3)} | {r.get('tokens_identical_to_dynamic', '')} | {first} | "
            f"{'' if r.get('first_logits_diff_step') is None else r['first_logits_diff_step']} | "
            f"{_kv_summary(r.get('kv_check'))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per compressed block (default 256; 16 with --tiny)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=int, default=600, help="seconds per child")
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU CI)")
    ap.add_argument("--check-kv", type=int, default=0, metavar="N",
                    help="compare with a DynamicCache fed the same tokens over the prompt and "
                    "N steps, in every child but dynamic's (bench/hf_kvcheck.py)")
    ap.add_argument("--deterministic", action="store_true",
                    help="every child with torch.use_deterministic_algorithms (warn only), "
                    "cuDNN deterministic and CUBLAS_WORKSPACE_CONFIG=:4096:8")
    ap.add_argument("--peak-origins", action="store_true",
                    help="CUDA: record the allocator's history in the timed run and report "
                    "what is allocated at its peak, by origin (slows the run)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, choices=VARIANTS)
    args = ap.parse_args(argv)
    if args.child and args.deterministic:  # before cuBLAS starts in this process
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    import torch

    if args.child and args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = _sizes(args)
    if args.child:
        print(json.dumps(run(args.child, s, args.device)))
        sys.stdout.flush()
        return 0
    import transformers

    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    argv_list = sys.argv[1:] if argv is None else list(argv)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "commit": os.environ.get("PAGECOMP_COMMIT", "unknown"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "command": " ".join(["python -m bench.hf_generate", *argv_list]),
            "sizes": s, "prefill_measure": "time to the first generated token in the timed "
            "run (streamer), host wall time with torch.cuda.synchronize()"}
    rows = []
    for v in variants:
        rows.append(_child(args, v, s))
        doc = _finish(rows, meta)
        write_results(doc, args.out, table(doc))  # partial results survive an outer timeout
    text = table(doc)
    print(text)
    write_results(doc, args.out, text)
    bad = [r for r in rows if "error" in r or r.get("exit_code", 0)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
