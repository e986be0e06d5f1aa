#!/usr/bin/env python3
"""Peers timed on the GPU next to ddtree's kernels (issue 47): the same shapes on other stacks.

- W4A16, group 32, 7168 -> 36864 (Kimi K2.6's fused gate/up of the dense MLP, the GEMV goal shape)
  and the decode step's smaller projections: cuBLAS bf16 (`torch.matmul`), PyTorch's int4
  tinygemm (`torch.ops.aten._weight_int4pack_mm`) and gemlite's Triton A16W4 kernels (`A16Wn`,
  INT4 with zero points, group 32), at M = 1..256 rows.
- Tree-masked absorbed MLA (576-wide latent keys, 512-wide values, one KV head): a PyTorch
  implementation (two bf16 matmuls, an additive tree mask, f32 softmax) and
  `scaled_dot_product_attention`, at contexts 1K..32K, tree sizes 1..64, 8 and 64 heads.
- Routed-expert MoE, Kimi K2.6's EP8 slice (48 local experts, hidden 7168, expert width 2048,
  top-8 of the 48, gate/up fused, SiLU-and-mul, route-weighted sum), at T = 1..64 tokens:
  PyTorch's grouped bf16 GEMM (`torch._grouped_mm`, tokens sorted by expert) and tinygemm int4
  run expert by expert; both captured in a CUDA graph, so launch overhead does not count.
  FlashInfer's MLA decode is not here: its wheel (flashinfer-python 0.7.4) is 101 MB, past the
  GPU machine's 64 MiB carry limit, and it JIT-compiles with nvcc and needs native packages
  (apache-tvm-ffi, nvidia-cutlass-dsl) that machine does not have.

Weights and caches are random (timing only). Each figure is the median over `--reps` samples,
each the mean of a batch of calls timed with CUDA events; GEMM weights alternate between two
copies (each past the L2) so every call reads its weights from HBM. Prints markdown tables.

Pinned environment: the GPU machine's torch (2.11, CUDA 13) and Triton; gemlite 0.6.0.post2
installed from its sdist with `pip install --no-deps` (`scripts/requirements-peers.txt`). A peer
that fails (missing package, unsupported shape) prints its error in its cell instead of a time.

    python3 scripts/bench_peers.py [--reps 7] [--only gemm|attention|moe]
"""

import argparse
import statistics
import sys

import torch

GROUP = 32
GEMM_SHAPES = [(7168, 36864), (7168, 2048), (2048, 7168), (1536, 12288)]  # (K, N)
GEMM_MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ATTN_CONTEXTS = [1024, 4096, 32768]
ATTN_NODES = [1, 8, 16, 64]
ATTN_HEADS = [8, 64]
LATENT, ROPE = 512, 64
MOE_EXPERTS, MOE_TOPK, MOE_HIDDEN, MOE_WIDTH = 48, 8, 7168, 2048
MOE_TOKENS = [1, 8, 16, 32, 64]


def timed(fn, reps, batch):
    """Median µs of `reps` samples, each the mean of `batch` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / batch)
    return statistics.median(samples)


def cell(f):
    return cell_text(lambda: f"{f():.1f}")


def cell_text(f):
    try:
        return f()
    except Exception as e:  # a peer that cannot run this shape says why, the table goes on
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:60]})"


def copy_bandwidth():
    """Device-to-device copy, GB/s counting read + write (as ddtree's benches do)."""
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda: b.copy_(a), 7, 10)
    return 2 * n / us / 1e3


def gemm_tables(reps):
    dev = "cuda"
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw:.0f} GB/s\n")
    try:
        import gemlite
        from gemlite.helper import A16Wn

        gemlite_version = getattr(gemlite, "__version__", "?")
    except Exception as e:
        A16Wn, gemlite_version = None, f"not importable: {e}"
    print(f"torch {torch.__version__}, gemlite {gemlite_version}\n")
    for k, n in GEMM_SHAPES:
        w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
        # tinygemm: nibbles packed two to a byte ([n, k / 2] uint8), scales and zeros per group.
        packed = [
            torch.ops.aten._convert_weight_to_int4pack(
                torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev), 8
            )
            for _ in range(2)
        ]
        sz = [torch.rand(k // GROUP, n, 2, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        gl = []
        if A16Wn is not None:
            try:
                for _ in range(2):
                    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev)
                    scales = torch.rand(n, k // GROUP, device=dev, dtype=torch.bfloat16) * 0.01
                    zeros = torch.full((n, k // GROUP), 8.0, device=dev, dtype=torch.bfloat16)
                    gl.append(A16Wn(device=dev, dtype=torch.bfloat16).from_weights(q, scales, zeros, 4, GROUP))
            except Exception as e:
                gl = e
        print(f"### {k}->{n}, W4A16 group {GROUP}: µs (% of copy bandwidth for the int4 bytes)\n")
        print("| M | cuBLAS bf16 | tinygemm int4 | gemlite A16W4 |")
        print("|---:|---:|---:|---:|")
        int4_bytes = n * k / 2 + n * (k // GROUP) * 2
        for m in GEMM_MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            state = {"i": 0}

            def flip():
                state["i"] ^= 1
                return state["i"]

            cublas = cell(lambda: timed(lambda: torch.matmul(x, w[flip()].t()), reps, 20))
            tiny_us = None

            def tiny():
                nonlocal tiny_us
                tiny_us = timed(lambda: torch.ops.aten._weight_int4pack_mm(x, packed[flip()], GROUP, sz[state["i"]]), reps, 20)
                return tiny_us

            tiny_cell = cell(tiny)
            if tiny_us:
                tiny_cell += f" ({100 * (int4_bytes + 2 * m * (k + n)) / tiny_us / 1e3 / bw:.0f}%)"
            if isinstance(gl, Exception):
                gl_cell = f"n/a ({type(gl).__name__}: {str(gl).splitlines()[0][:60]})"
            elif gl:
                gl_cell = cell(lambda: timed(lambda: gl[flip()](x), reps, 20))
            else:
                gl_cell = "n/a (gemlite not installed)"
            print(f"| {m} | {cublas} | {tiny_cell} | {gl_cell} |")
        print()
        del w, packed, sz, gl
        torch.cuda.empty_cache()


def attention_tables(reps):
    dev = "cuda"
    d = LATENT + ROPE
    scale = d**-0.5
    print("### Tree-masked absorbed MLA (576-wide keys, 512-wide values, one KV head): µs\n")
    print("| ctx | nodes x heads | PyTorch matmul + mask + softmax | SDPA |")
    print("|---:|---:|---:|---:|")
    for ctx in ATTN_CONTEXTS:
        cache = torch.randn(ctx + max(ATTN_NODES), d, device=dev, dtype=torch.bfloat16)
        for heads in ATTN_HEADS:
            for t in ATTN_NODES:
                keys = cache[: ctx + t]
                q = torch.randn(t * heads, d, device=dev, dtype=torch.bfloat16)
                # The tree's own rows: node i sees its ancestors (here: a random tree, parent < i).
                tree = torch.zeros(t, t, dtype=torch.bool, device=dev)
                for i in range(t):
                    tree[i, i] = True
                    if i:
                        p = int(torch.randint(0, i, ()).item())
                        tree[i] |= tree[p]
                bias = torch.zeros(t, ctx + t, device=dev, dtype=torch.float32)
                bias[:, ctx:] = torch.where(tree, 0.0, float("-inf"))
                bias = bias.repeat_interleave(heads, dim=0)  # rows are (node, head)

                def manual():
                    s = torch.matmul(q, keys.t()).float() * scale + bias
                    p = torch.softmax(s, dim=-1).to(torch.bfloat16)
                    return torch.matmul(p, keys[:, :LATENT])

                qs = q.view(1, 1, t * heads, d)
                ks = keys.view(1, 1, ctx + t, d)
                vs = keys[:, :LATENT].view(1, 1, ctx + t, LATENT)
                mask = bias.to(torch.bfloat16).view(1, 1, t * heads, ctx + t)

                def sdpa():
                    return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)

                print(
                    f"| {ctx // 1024}K | {t} x {heads} | {cell(lambda: timed(manual, reps, 10))} | "
                    f"{cell(lambda: timed(sdpa, reps, 10))} |"
                )
        del cache
        torch.cuda.empty_cache()
    print()


def graphed(fn):
    """`fn` captured in a CUDA graph; the returned callable replays it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def moe_tables(reps):
    dev = "cuda"
    e, k, h, w = MOE_EXPERTS, MOE_TOPK, MOE_HIDDEN, MOE_WIDTH
    bw = copy_bandwidth()
    print(f"### Routed MoE, EP8 slice ({e} experts, {h} -> 2x{w} -> {h}, top-{k}): µs (% of copy for the touched experts' bytes)\n")
    print(f"copy bandwidth (read + write): {bw:.0f} GB/s\n")
    print("| T | touched experts | grouped bf16 (`torch._grouped_mm`) | tinygemm int4 g32, per expert |")
    print("|---:|---:|---:|---:|")
    gate_up = torch.randn(e, 2 * w, h, device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, w, device=dev, dtype=torch.bfloat16) * 0.02
    pack = lambda n, kk: torch.ops.aten._convert_weight_to_int4pack(
        torch.randint(0, 256, (n, kk // 2), dtype=torch.uint8, device=dev), 8
    )
    gu4 = [pack(2 * w, h) for _ in range(e)]
    gu4_sz = [torch.rand(h // GROUP, 2 * w, 2, device=dev, dtype=torch.bfloat16) for _ in range(e)]
    d4 = [pack(h, w) for _ in range(e)]
    d4_sz = [torch.rand(w // GROUP, h, 2, device=dev, dtype=torch.bfloat16) for _ in range(e)]
    int4_expert = (2 * w * h + h * w) / 2 + (2 * w * h // GROUP + h * w // GROUP) * 2 * 2
    bf16_expert = (2 * w * h + h * w) * 2
    for t in MOE_TOKENS:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])  # [t, k]
        wts = torch.rand(t, k, device=dev, dtype=torch.float32)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // k  # token of each sorted slot
        counts = torch.bincount(flat, minlength=e)
        touched = int((counts > 0).sum())
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[tok].contiguous()
        ws = wts.flatten()[order].unsqueeze(1)
        out = torch.zeros(t, h, device=dev, dtype=torch.float32)

        def grouped():
            g = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
            a = torch.nn.functional.silu(g[:, :w]) * g[:, w:]
            y = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
            out.zero_()
            out.index_add_(0, tok, y.float() * ws)

        per = [(ex, (order[(flat[order] == ex)] // k)) for ex in range(e) if counts[ex] > 0]
        per_w = {ex: wts.flatten()[order[(flat[order] == ex)]].unsqueeze(1) for ex, _ in per}

        def tiny():
            out.zero_()
            for ex, rows in per:
                xe = x[rows]
                g = torch.ops.aten._weight_int4pack_mm(xe, gu4[ex], GROUP, gu4_sz[ex])
                a = torch.nn.functional.silu(g[:, :w]) * g[:, w:]
                y = torch.ops.aten._weight_int4pack_mm(a, d4[ex], GROUP, d4_sz[ex])
                out.index_add_(0, rows, y.float() * per_w[ex])

        def run(fn, bytes_per_expert):
            us = timed(graphed(fn), reps, 20)
            return f"{us:.1f} ({100 * touched * bytes_per_expert / us / 1e3 / bw:.0f}%)"

        g_cell = cell_text(lambda: run(grouped, bf16_expert))
        t_cell = cell_text(lambda: run(tiny, int4_expert))
        print(f"| {t} | {touched} | {g_cell} | {t_cell} |")
    print()
    del gate_up, down, gu4, d4
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", choices=["gemm", "attention", "moe"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device for torch", file=sys.stderr)
        return 2
    torch.manual_seed(47)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}\n")
    if args.only in (None, "gemm"):
        gemm_tables(args.reps)
    if args.only in (None, "attention"):
        attention_tables(args.reps)
    if args.only in (None, "moe"):
        moe_tables(args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
