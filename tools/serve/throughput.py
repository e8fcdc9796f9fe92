#!/usr/bin/env python3
"""Aggregate generation throughput of a running turboquant-serve at N concurrent greedy streams.

A quick, bounded check (python3 stdlib only); tools/serve/load.py is the full load test (concurrency
sweeps, TTFT / ITL percentiles, error accounting).

    python3 tools/serve/throughput.py --port 8080 --streams 1 16 --max-tokens 128

Every stream is a streamed /v1/completions request with its own prompt, temperature 0 and EOS biased
away (logit_bias) so that each generates exactly --max-tokens tokens. Tokens/s is the sum of the
generated tokens over the wall time from the first request sent to the last stream closed.
"""
import argparse
import json
import sys
import threading
import time
import urllib.request

SUBJECTS = ["a cat", "a dog", "a king", "a girl", "a boy", "a bird", "a fish", "a tree",
            "the sun", "the moon", "a frog", "a ship", "a fox", "an owl", "a bear", "a mouse"]


def stream(url, prompt, max_tokens, eos, timeout, out, i):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if eos is not None:
        body["logit_bias"] = {str(eos): -100}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft, tokens, error = None, 0, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0].get("text") and ttft is None:
                    ttft = time.monotonic() - t0
    except Exception as e:  # reported, not hidden: a failed stream counts as an error
        error = str(e)
    out[i] = (tokens, ttft, time.monotonic() - t0, error)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--eos", type=int, default=0, help="the EOS id to bias away (-1: none)")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    url = f"http://{a.host}:{a.port}"
    eos = None if a.eos < 0 else a.eos
    for n in a.streams:
        out = [None] * n
        threads = [threading.Thread(target=stream, args=(url, f"Once upon a time there was {SUBJECTS[i % len(SUBJECTS)]} who",
                                                          a.max_tokens, eos, a.timeout, out, i)) for i in range(n)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        errors = [o[3] for o in out if o[3]]
        tokens = sum(o[0] for o in out)
        ttfts = sorted(o[1] for o in out if o[1] is not None)
        p50 = ttfts[len(ttfts) // 2] if ttfts else float("nan")
        print(f"streams {n:3d}: {tokens} tokens in {wall:.2f} s = {tokens / wall:8.1f} tokens/s aggregate, "
              f"{tokens / wall / n:7.1f} per stream, TTFT p50 {p50 * 1000:.0f} ms, errors {len(errors)}")
        for e in errors[:3]:
            print("  error:", e, file=sys.stderr)


if __name__ == "__main__":
    main()
