"""Dev probe (#26, #21): a small tensor's offload and restore with the exponent codec's kernels
reading and writing page-locked host memory themselves, against a pinned copy and
``PageCompressor.offload`` + ``restore``, one call at a time.

``python3 -m bench.dev_zero_copy [--sizes 64K,1M,16M,64M] [--repeats 100]`` (GPU).

``PageCompressor``'s path for a small bf16 tensor costs ~330 us of host time for an
``offload`` + ``restore`` of 1 MiB, 6-8x a pinned copy's end to end (``bench.latency``,
``bench/results/h200x2_c2301fe_session54``): the store's two phases (the GPU plans where
the pages go, the host reads the plan and queues the copy engine's copies) and its
book-keeping, a dozen pieces of 10-40 us. #26 asks for 2x.

Here the placed encoder (``_exp_encode_placed_kernel``) writes the pages end to end straight
into a page-locked ring by its host address (unified addressing), and their offsets, sizes
and kinds into page-locked metadata; the ring's end is an ``int64`` on the device that the
encoder raises with one atomic add a page, so successive offloads append without the host
knowing where (the offsets tell a restore). The restore is one launch of the exponent
decoder reading those host addresses into a fresh tensor. No copy engine, no plan, no host
read: one launch and one event each way. Nothing is freed here (the ring's end is set back
to 0 between calls, untimed): what a store built on this would have to add is the ring's
reuse, whose cost this probe does not measure.

Each call starts with the GPU idle (``bench.latency.time_calls``): ``host us`` until the
call returns, ``e2e us`` by CUDA events to the end of its work. Every restore is checked
bit for bit, with its statuses, once before the timed calls.
"""

from __future__ import annotations

import argparse

import torch

from .latency import _quantile, human, parse_sizes, time_calls

P = 4096


class ZeroCopy:
    """A page-locked ring the encoder writes pages into, and metadata for ``most`` pages."""

    def __init__(self, device: torch.device, capacity: int, most: int):
        self.device, self.index = device, device.index
        self.ring = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.rel = torch.empty(most, dtype=torch.int64, pin_memory=True)
        self.sizes = torch.empty(most, dtype=torch.int32, pin_memory=True)
        self.kinds = torch.empty(most, dtype=torch.uint8, pin_memory=True)
        self.end = torch.zeros(1, dtype=torch.int64, device=device)
        self.status = torch.empty(most, dtype=torch.int32, device=device)

    def offload(self, x: torch.Tensor) -> int:
        """Queue ``x``'s pages (``uint8``, whole pages) into the ring; returns pages."""
        from torch_pagecomp.kernels.exp_codec import compress_exp_placed_at

        n = x.numel() // P
        pages = x.view(n, P)
        addrs = (x.data_ptr(), self.ring.data_ptr(), self.sizes.data_ptr(),
                 self.kinds.data_ptr(), self.rel.data_ptr(), self.end.data_ptr())
        compress_exp_placed_at(self.index, n, P, False, False, addrs,
                               lambda: (pages, self.ring, self.sizes[:n], self.kinds[:n],
                                        self.rel[:n], self.end))
        return n

    def restore(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``n`` pages decoded from the ring into ``out`` (``uint8 [n * P]``; by default a
        new tensor), statuses in ``status``."""
        from torch_pagecomp.offload._decode import decode_rows_at

        if out is None:
            out = torch.empty(n * P, dtype=torch.uint8, device=self.device)
        total = self.ring.numel()
        addrs = (self.ring.data_ptr(), self.rel.data_ptr(), self.sizes.data_ptr(),
                 self.kinds.data_ptr(), out.data_ptr(), self.status.data_ptr())
        decode_rows_at(True, self.index, P, n, addrs, total,
                       lambda: (self.ring, self.rel[:n], self.sizes[:n], self.kinds[:n],
                                out.view(n, P), self.status[:n], total), rows=False)
        return out

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        self.end.zero_()
        torch.cuda.synchronize(self.device)


def measure(sizes: list[int], repeats: int) -> list[str]:
    import torch_pagecomp as pc

    dev = torch.device("cuda", torch.cuda.current_device())
    most = max(sizes) // P
    zc = ZeroCopy(dev, max(sizes) + (1 << 20), most)
    comp = pc.PageCompressor(device=dev)
    lines = [f"## one call at a time on {torch.cuda.get_device_name(dev)}, bf16 "
             "(randn * 0.02), 4 KiB pages; median of up to "
             f"{repeats} calls (p90 in brackets)",
             "| bytes | way | host us | e2e us | e2e vs pinned copy | stored bytes |",
             "|---|---|---|---|---|---|"]
    for nbytes in sizes:
        lines += _one_size(nbytes, zc, comp, dev, repeats)
    comp.close()
    return lines


def _one_size(nbytes: int, zc: ZeroCopy, comp, dev: torch.device, repeats: int) -> list[str]:
    """The table's rows for tensors of ``nbytes``."""
    lines = []
    x = (torch.randn(nbytes // 2, device=dev) * 0.02).to(torch.bfloat16)
    flat = x.view(torch.uint8)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(flat)
    kept: list = []

    def copy_both():
        host.copy_(flat, non_blocking=True)
        back.copy_(host, non_blocking=True)

    def zc_both():
        zc.offload(flat)
        kept[:] = [zc.restore(flat.numel() // P)]

    def zc_down():
        return zc.offload(flat)

    n = flat.numel() // P

    def zc_up():
        kept[:] = [zc.restore(n)]

    def pc_both():
        h = comp.offload(x)
        kept[:] = [comp.restore(h)]
        return h

    def pc_free(h):
        kept.clear()
        h.free()
        comp.synchronize()

    # correctness first: poisoned output, statuses, the bytes stored
    zc.reset()
    zc.offload(flat)
    zc.status.fill_(-1)
    got = zc.restore(n, torch.full_like(flat, 0xA5))
    torch.cuda.synchronize(dev)
    ok = torch.equal(got, flat) and bool((zc.status[:n] == 0).all())
    stored = int(zc.end.item())
    h = comp.offload(x)
    ok_pc = torch.equal(comp.restore(h, check=True).view(-1), x.view(-1))
    pc_stored = h.stored_nbytes
    h.free()
    if not (ok and ok_pc):
        raise SystemExit(f"dev_zero_copy: a restore differs at {human(nbytes)} "
                         f"(zero-copy {ok}, PageCompressor {ok_pc})")
    rows = []
    for way, fn, after in (("pinned copy D2H + H2D", copy_both, None),
                           ("zero-copy offload + restore", zc_both,
                            lambda _: zc.reset()),
                           ("zero-copy offload", zc_down, lambda _: zc.reset()),
                           ("zero-copy restore", zc_up, None),
                           ("PageCompressor offload + restore", pc_both, pc_free)):
        if way == "zero-copy restore":
            zc.reset()
            zc.offload(flat)  # the pages it reads, stored once
        hs, es = time_calls(fn, dev, repeats, 5, 2.0, after)
        rows.append((way, hs, es))
    base = _quantile(rows[0][2], 0.5)
    for way, hs, es in rows:
        size = {"zero-copy offload + restore": stored, "zero-copy offload": stored,
                "PageCompressor offload + restore": pc_stored}.get(way, nbytes)
        lines.append(f"| {human(nbytes)} | {way} | {_quantile(hs, 0.5) * 1e6:.1f} "
                     f"[{_quantile(hs, 0.9) * 1e6:.1f}] | {_quantile(es, 0.5) * 1e6:.1f} "
                     f"[{_quantile(es, 0.9) * 1e6:.1f}] | {_quantile(es, 0.5) / base:.2f}x | "
                     f"{size if size is not None else '-'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64K,1M,16M,64M"))
    ap.add_argument("--repeats", type=int, default=100)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dev_zero_copy: needs a CUDA device")
    print("\n".join(measure(a.sizes, a.repeats)), flush=True)


if __name__ == "__main__":
    main()
