#!/usr/bin/env python3
"""Summarizes an Nsight Compute CSV of `scripts/gpu.sh profile` (one metric,
gpu__time_duration): finds the repeating decode step (the sequence of kernels between two
LM-head GEMVs over the vocabulary), and prints each kernel of the last complete step with its
median time over the steps seen, then the sum.

Usage: scripts/profile_table.py NCU_CSV
"""
import csv
import statistics
import sys


def main(path):
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    h = rows[head]
    data = [r for r in rows[head + 1:] if len(r) == len(h) and r[0].isdigit()]
    ki, ti = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
    gi, bi = h.index("Grid Size"), h.index("Block Size")
    ks = [(r[ki], float(r[ti].replace(",", "")) / 1e3, r[gi], r[bi]) for r in data]
    # A decode step ends with the row top-1 of the logits (`row_topk*`, one kernel or a split
    # pass and its merge): steps are the stretches between two such ends.
    top = [k[0].startswith("row_topk") for k in ks]
    ends = [i for i in range(len(ks)) if top[i] and (i + 1 == len(ks) or not top[i + 1])]
    steps = [ks[a + 1:b + 1] for a, b in zip(ends, ends[1:])]
    if not steps:
        sys.exit("no complete decode step (two row_topk launches) in the profile")
    # The most common step length is the replayed decode step.
    n = statistics.mode(len(s) for s in steps)
    same = [s for s in steps if len(s) == n and [k[0] for k in s] == [k[0] for k in steps[-1]]]
    if not same:
        same = [s for s in steps if len(s) == n]
    print(f"{len(same)} decode steps of {n} kernels")
    total = 0.0
    for j in range(n):
        t = statistics.median(s[j][1] for s in same)
        total += t
        name, _, grid, block = same[-1][j]
        print(f"{j:4} {t:8.2f} us  {name[:64]:64} grid {grid} block {block}")
    print(f"sum {total:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
