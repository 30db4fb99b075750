"""Where do a cache's greedy tokens part from ``DynamicCache``'s? A teacher-forced comparison
in one process (``bench/hf_generate.py --check-kv N``).

The model runs the prompt and then ``N`` single-token steps twice per step, first with a
``DynamicCache`` (the reference), then with the cache under test, both fed the reference's
greedy token. Per step and layer it compares, bit for bit:

* the keys and values each cache hands to attention (``Cache.update``'s return), split into
  the past tokens (what the cache kept: a wrong restore shows here) and the new ones (the
  layer's input: a difference upstream shows here);
* the attention output at the last position (a forward hook on each ``self_attn``): a
  difference while the keys and values are identical is the attention kernels' own;
* the last position's logits and their argmax.

It reports the first step/layer of each kind of difference (``None``: none in ``N`` steps).
"""

from __future__ import annotations

import torch


def _first(found: dict, key: str, value) -> None:
    if found.get(key) is None:
        found[key] = value


def check_kv(model, ids: torch.Tensor, cache, ref_cache, steps: int, kwarg: str) -> dict:
    """Compare ``cache`` with ``ref_cache`` (a ``DynamicCache``) over the prompt ``ids``
    (``int64 [B, T]``) and ``steps`` decode steps; see the module docstring. ``kwarg``: the
    keyword the model's forward takes a cache by. Both caches are left filled."""
    found: dict = {"steps": steps, "kv": None, "kv_new_only": None, "attn": None,
                   "logits": None, "argmax": None}
    state = {"step": 0, "ref_attn": {}, "attn": {}, "which": "ref"}
    orig = cache.update  # the model calls ``cache.update``: the instance's, set below

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = orig(key_states, value_states, layer_idx, *args, **kwargs)
        ref = ref_cache.layers[layer_idx]
        if not (torch.equal(keys, ref.keys) and torch.equal(values, ref.values)):
            past = keys.shape[-2] - key_states.shape[-2]
            same_past = (keys.shape == ref.keys.shape
                         and torch.equal(keys[..., :past, :], ref.keys[..., :past, :])
                         and torch.equal(values[..., :past, :], ref.values[..., :past, :]))
            where = {"step": state["step"], "layer": layer_idx,
                     "part": "new tokens only" if same_past else "past tokens"}
            _first(found, "kv", where)
            if same_past:
                _first(found, "kv_new_only", where)
        return keys, values

    def hook(layer_idx):
        def fn(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            key = "ref_attn" if state["which"] == "ref" else "attn"
            state[key][layer_idx] = out[:, -1].detach().clone()
        return fn

    attn = [layer.self_attn for layer in model.model.layers]
    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(attn)]
    cache.update = update
    try:
        batch, inp, length = ids.shape[0], ids, 0
        with torch.no_grad():
            for step in range(steps + 1):
                state["step"] = step
                length += inp.shape[1]
                mask = torch.ones(batch, length, dtype=torch.long, device=ids.device)
                state["which"] = "ref"
                ref_logits = model(input_ids=inp, attention_mask=mask, use_cache=True,
                                   logits_to_keep=1, **{kwarg: ref_cache}).logits[:, -1]
                state["which"] = "test"
                logits = model(input_ids=inp, attention_mask=mask, use_cache=True,
                               logits_to_keep=1, **{kwarg: cache}).logits[:, -1]
                if found["kv"] is None:  # attention's own differences, on identical inputs
                    for i in range(len(attn)):
                        if not torch.equal(state["ref_attn"][i], state["attn"][i]):
                            _first(found, "attn", {"step": step, "layer": i})
                            break
                if not torch.equal(logits, ref_logits):
                    _first(found, "logits", step)
                nxt = ref_logits.argmax(-1, keepdim=True)
                if not torch.equal(logits.argmax(-1, keepdim=True), nxt):
                    _first(found, "argmax", step)
                inp = nxt
    finally:
        del cache.update  # the class's method again
        for h in handles:
            h.remove()
    return found
