"""Load generator for `ddtree serve`: streaming completions at several concurrencies; reports
requests/s, output tokens/s, time to first token and inter-token latency percentiles.
Standard library only.

    ddtree serve --port 8000 --device cpu &
    python3 scripts/bench_serve.py --base-url http://127.0.0.1:8000 --concurrency 1,4,16

ITL is measured per token: a chunk of k tokens (one DDTree round) after a gap g counts as k
tokens of g / k each, as the server's own histogram does.
"""

import argparse
import http.client
import json
import threading
import time
import urllib.parse

PROMPTS = ["fn main() {", "def add(a, b):", "use std::collections::", "import os\n", "impl Drop for", "class Node:"]


def one(base, prompt, max_tokens):
    """One streaming request: (ttft s, [per-token gaps s], tokens)."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, last, gaps, tokens = None, None, [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ids = json.loads(line[6:]).get("ddtree", {}).get("token_ids")
        if not ids:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - start
        else:
            gaps += [(now - last) / len(ids)] * len(ids)
        last = now
        tokens += len(ids)
    conn.close()
    return ttft, gaps, tokens


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def run(base, concurrency, requests, max_tokens):
    results, lock = [], threading.Lock()
    todo = list(range(requests))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            r = one(base, PROMPTS[i % len(PROMPTS)], max_tokens)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "req_per_s": len(results) / wall,
        "tok_per_s": tokens / wall,
        "ttft_ms": [1e3 * pct(ttfts, p) for p in (50, 90, 99)],
        "itl_ms": [1e3 * pct(gaps, p) for p in (50, 90, 99)],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    one(args.base_url, PROMPTS[0], 4)  # warm-up
    rows = [run(args.base_url, int(c), args.requests, args.max_tokens) for c in args.concurrency.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| concurrency | requests | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) |")
    print("|---:|---:|---:|---:|---|---|")
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} "
            f"| {t[0]:.1f} / {t[1]:.1f} / {t[2]:.1f} | {i[0]:.2f} / {i[1]:.2f} / {i[2]:.2f} |"
        )


if __name__ == "__main__":
    main()
