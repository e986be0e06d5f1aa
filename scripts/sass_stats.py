#!/usr/bin/env python3
"""SASS instruction counts of compiled kernel variants, for kernel work without a GPU.

    DDTREE_NVRTC_FILTER=w4a16_gemv__group32_mode_dense DDTREE_SASS_DIR=/tmp/sass \\
        cargo test --release -p ddtree-kernels --test nvrtc
    scripts/sass_stats.py /tmp/sass/*.cubin [--ops 12]

For each cubin (disassembled with `nvdisasm`, on PATH or in $NVDISASM; the
`nvidia-cuda-nvdisasm` wheel has one) prints the kernel's SASS instruction count, its loops
(a backward branch and its target: instructions and the most frequent opcodes) and, for the
hot loop (the innermost one with tensor-core instructions), the opcode histogram. The instructions of a loop body are what a warp issues per
trip, so two variants' loops compare directly (an unrolled ring of `stages` k steps is one
trip of `stages` steps).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def disassemble(cubin, nvdisasm):
    out = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{nvdisasm} failed on {cubin}:\n{out.stderr}")
    insts = []  # (address, opcode, operands)
    labels = {}  # label -> address of the instruction after it
    pending = []
    for line in out.stdout.splitlines():
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = LINE.search(line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending.clear()
            insts.append((addr, m.group(3), m.group(4)))
    return insts, labels


def loops(insts, labels):
    """(start, end) address ranges of backward branches."""
    out = []
    for addr, op, rest in insts:
        if op.startswith("BRA"):
            t = TARGET.search(rest)
            if t and t.group(1) in labels and labels[t.group(1)] <= addr:
                out.append((labels[t.group(1)], addr))
    return sorted(set(out))


def mma(insts, lo, hi):
    return any(op.startswith(("HMMA", "HGMMA")) for a, op, _ in insts if lo <= a <= hi)


def base(op):
    return op.split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cubins", nargs="+")
    ap.add_argument("--ops", type=int, default=12, help="opcodes shown per histogram")
    args = ap.parse_args()
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, put its bin folder on PATH or set NVDISASM")
    for cubin in args.cubins:
        insts, labels = disassemble(cubin, nvdisasm)
        name = os.path.basename(cubin).removesuffix(".cubin")
        print(f"{name}: {len(insts)} instructions")
        ranges = loops(insts, labels)
        hot = None
        for lo, hi in ranges:
            body = [op for a, op, _ in insts if lo <= a <= hi]
            hist = collections.Counter(base(op) for op in body)
            top = ", ".join(f"{o} {n}" for o, n in hist.most_common(5))
            print(f"  loop {lo:#06x}-{hi:#06x}: {len(body)} instructions ({top})")
            # The hot loop: the innermost one with tensor-core instructions.
            inner = not any(l2 >= lo and h2 <= hi and (l2, h2) != (lo, hi) and mma(insts, l2, h2) for l2, h2 in ranges)
            if mma(insts, lo, hi) and inner:
                hot = (lo, hi, body)
        if hot:
            lo, hi, body = hot
            hist = collections.Counter(base(op) for op in body)
            print(f"  hot loop {lo:#06x}-{hi:#06x} ({hist['HMMA'] + hist['HGMMA']} mma, {len(body)} instructions): "
                  + ", ".join(f"{o} {n}" for o, n in hist.most_common(args.ops)))


if __name__ == "__main__":
    main()
