#!/usr/bin/env python3
"""Load test for turboquant-serve: N concurrent streaming requests for T seconds, at each concurrency of a sweep.

    tools/serve/load.py --url http://127.0.0.1:8080 --concurrency 1,4,16,64 --duration 10 --max-tokens 64

Each stream is checked as it arrives: a well-formed HTTP response and SSE stream, JSON chunks with one id, the
role in the first delta only, finish_reason in the last choice chunk only, the usage chunk, [DONE] and nothing
after it, and completion_tokens = max_tokens when it ends at the length. A response that breaks any of these,
times out, or fails to connect counts as an error. Reports aggregate generated tokens/s, requests/s, time to
first token (TTFT) p50/p99, inter-token latency (ITL: the gaps between content chunks) p50/p99, time per output
token after the first (TPOT: a stream's decode time over its tokens; unlike ITL it does not depend on how many
tokens a chunk carries), tokens per chunk, and errors, as a table (--markdown for Markdown), JSON (--json) and a
PNG chart (--chart, when matplotlib is importable).

Bounded: each level sends requests for --duration seconds (and at most --max-requests), then waits for the
streams in flight, each of which is cut at --request-timeout. Nothing but the Python standard library: raw
HTTP/1.1 over asyncio streams, one connection per request.
"""

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.parse

# Prompts are built from these words, so that a prompt of about N tokens needs no file (one common English
# word is about one token for most tokenizers, with a space before it).
WORDS = (
    "the a little girl boy dog cat tree house sun moon river bird ball friend happy sad big small red blue green "
    "day night park garden toy book story mom dad school teacher played jumped ran walked saw found wanted "
    "liked said went came looked helped shared smiled laughed and then but so because when after before one "
    "two three very fast slow warm cold kind brave quiet loud apple cake flower boat car train star sky"
).split()


def build_prompt(approx_tokens, variant, shared_words=0):
    """A deterministic prompt of about approx_tokens words; variants differ from their first word on, or
    after a common opening of shared_words words (a long system prompt or document every request repeats)."""
    rng = random.Random(1000 + variant)
    shared = random.Random(999)
    n = max(1, approx_tokens - 8)
    words = [shared.choice(WORDS) for _ in range(min(shared_words, n))]
    words += [rng.choice(WORDS) for _ in range(n - len(words))]
    return "Continue this story: " + " ".join(words) + "."


def percentile(values, p):
    """Linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class ResponseError(Exception):
    """A response that breaks the HTTP, SSE or chunk contract: counted as an error of kind `kind`."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


class StreamChecker:
    """Checks the chunks of one streamed response, in order, as they come, and times the content pieces."""

    def __init__(self, endpoint, max_tokens, t_sent):
        self.endpoint = endpoint
        self.max_tokens = max_tokens
        self.t_sent = t_sent
        self.id = None
        self.choice_chunks = 0
        self.finish_reason = None
        self.usage = None
        self.done = False
        self.text = []
        self.token_times = []  # arrival time of each chunk with content

    def on_event(self, data, now):
        if self.done:
            raise ResponseError("sse", "data after [DONE]")
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ResponseError("sse", "event data is not JSON: %r" % data[:200])
        if not isinstance(chunk, dict):
            raise ResponseError("sse", "event data is not a JSON object")
        if "error" in chunk:
            raise ResponseError("server", "error in the stream: %s" % json.dumps(chunk["error"])[:300])
        want = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        if chunk.get("object") != want:
            raise ResponseError("invariant", "object %r, expected %r" % (chunk.get("object"), want))
        if self.id is None:
            self.id = chunk.get("id")
            if not isinstance(self.id, str) or not self.id:
                raise ResponseError("invariant", "chunk without an id")
        elif chunk.get("id") != self.id:
            raise ResponseError("invariant", "id changed from %r to %r" % (self.id, chunk.get("id")))
        if self.usage is not None:
            raise ResponseError("invariant", "a chunk after the usage chunk")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise ResponseError("invariant", "chunk without a choices list")
        if chunk.get("usage"):
            if choices:
                raise ResponseError("invariant", "usage chunk with choices")
            self.usage = chunk["usage"]
            return
        if len(choices) != 1:
            raise ResponseError("invariant", "%d choices in a chunk" % len(choices))
        if self.finish_reason is not None:
            raise ResponseError("invariant", "a choice chunk after finish_reason %r" % self.finish_reason)
        choice = choices[0]
        if self.endpoint == "chat":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                raise ResponseError("invariant", "chat chunk without a delta")
            has_role = delta.get("role") is not None
            if self.choice_chunks == 0 and delta.get("role") != "assistant":
                raise ResponseError("invariant", "the first delta has no role 'assistant'")
            if self.choice_chunks > 0 and has_role:
                raise ResponseError("invariant", "role in a delta after the first")
            piece = delta.get("content")
        else:
            piece = choice.get("text")
        if piece is not None and not isinstance(piece, str):
            raise ResponseError("invariant", "content is not a string")
        self.choice_chunks += 1
        if piece:
            self.text.append(piece)
            self.token_times.append(now)
        fr = choice.get("finish_reason")
        if fr is not None:
            if fr not in ("stop", "length"):
                raise ResponseError("invariant", "finish_reason %r" % fr)
            self.finish_reason = fr

    def finish(self):
        """Checks what must hold once the stream ended; returns the number of generated tokens."""
        if not self.done:
            raise ResponseError("lost", "the stream ended without [DONE]")
        if self.finish_reason is None:
            raise ResponseError("invariant", "no finish_reason")
        if self.usage is None:
            raise ResponseError("invariant", "no usage chunk (stream_options.include_usage was asked)")
        u = self.usage
        try:
            prompt, completion, total = int(u["prompt_tokens"]), int(u["completion_tokens"]), int(u["total_tokens"])
        except (KeyError, TypeError, ValueError):
            raise ResponseError("invariant", "malformed usage %s" % json.dumps(u)[:200])
        if total != prompt + completion:
            raise ResponseError("invariant", "usage total %d != %d + %d" % (total, prompt, completion))
        # Each content piece holds at least one token (a token cut inside a UTF-8 character may be merged
        # with the next), so more pieces than tokens means something was duplicated or corrupted.
        if len(self.token_times) > completion:
            raise ResponseError("invariant", "%d content pieces for %d tokens" % (len(self.token_times), completion))
        if self.finish_reason == "length" and completion != self.max_tokens:
            raise ResponseError("invariant", "finish_reason length after %d tokens, max_tokens %d" % (completion, self.max_tokens))
        if completion > self.max_tokens:
            raise ResponseError("invariant", "%d tokens over max_tokens %d" % (completion, self.max_tokens))
        return completion


class SSEParser:
    """Incremental SSE: feed bytes, get each event's data (its data: lines joined) at a blank line."""

    def __init__(self, on_data):
        self.buf = b""
        self.data = []
        self.on_data = on_data

    def feed(self, data, now):
        self.buf += data
        while True:
            i = self.buf.find(b"\n")
            if i < 0:
                return
            line, self.buf = self.buf[:i], self.buf[i + 1:]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self.data:
                    self.on_data("\n".join(self.data), now)
                    self.data = []
            elif line.startswith(b"data:"):
                try:
                    text = line[5:].decode("utf-8")
                except UnicodeDecodeError:
                    raise ResponseError("sse", "event data is not UTF-8")
                self.data.append(text[1:] if text.startswith(" ") else text)
            # comments (':') and other fields are not used by this API

    def close(self):
        if self.buf.strip() or self.data:
            raise ResponseError("sse", "the stream ended inside an event")


async def read_headers(reader):
    status_line = await reader.readline()
    if not status_line:
        raise ResponseError("connect", "connection closed before the status line")
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ResponseError("protocol", "bad status line %r" % status_line[:100])
    status = int(parts[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            break
        if not line:
            raise ResponseError("protocol", "connection closed inside the headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def body_pieces(reader, headers):
    """Yields the body as it arrives, undoing chunked transfer encoding and checking its framing."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line.endswith(b"\n"):
                raise ResponseError("lost", "connection closed inside the chunked body")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise ResponseError("protocol", "bad chunk size line %r" % size_line[:40])
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            try:
                data = await reader.readexactly(size)
                crlf = await reader.readexactly(2)
            except asyncio.IncompleteReadError:
                raise ResponseError("lost", "connection closed inside a chunk")
            if crlf != b"\r\n":
                raise ResponseError("protocol", "chunk not followed by CRLF")
            yield data
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise ResponseError("lost", "connection closed %d bytes before Content-Length" % left)
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


class Target:
    def __init__(self, url, api_key):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http":
            raise SystemExit("load.py: only http:// URLs (the server listens on loopback)")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.base = u.path.rstrip("/")
        self.api_key = api_key

    def request_bytes(self, method, path, body=None):
        lines = ["%s %s%s HTTP/1.1" % (method, self.base, path), "Host: %s:%d" % (self.host, self.port),
                 "Connection: close", "Accept: text/event-stream, application/json"]
        if self.api_key:
            lines.append("Authorization: Bearer %s" % self.api_key)
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode()
            lines += ["Content-Type: application/json", "Content-Length: %d" % len(payload)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload

    async def get_json(self, path, timeout=10):
        """Plain GET, for /health, /v1/models and /props: (status, parsed JSON or None)."""
        async def go():
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(self.request_bytes("GET", path))
                await writer.drain()
                status, headers = await read_headers(reader)
                body = b"".join([p async for p in body_pieces(reader, headers)])
                try:
                    return status, json.loads(body)
                except ValueError:
                    return status, None
            finally:
                writer.close()
        return await asyncio.wait_for(go(), timeout)

    async def get_text(self, path, timeout=10):
        """Plain GET of a text body (/metrics): (status, text)."""
        async def go():
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(self.request_bytes("GET", path))
                await writer.drain()
                status, headers = await read_headers(reader)
                body = b"".join([p async for p in body_pieces(reader, headers)])
                return status, body.decode("utf-8", "replace")
            finally:
                writer.close()
        return await asyncio.wait_for(go(), timeout)


# Gauges and counters of turboquant-serve's /metrics that --watch-metrics follows during a level.
WATCHED = ("requests_running", "requests_waiting", "kv_pool_usage_ratio", "kv_pool_bytes_in_use",
           "kv_pool_blocks_in_use", "kv_pool_blocks_capacity", "kv_pool_bytes_capacity", "preemptions_total",
           "kv_pool_waits_total")


def parse_metrics(text):
    """{name without the turboquant_ prefix: value} for the unlabelled samples of a Prometheus text body."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("turboquant_") and "{" not in parts[0]:
            try:
                values[parts[0][len("turboquant_"):]] = float(parts[1])
            except ValueError:
                pass
    return values


async def watch_metrics(target, interval, stop, peaks):
    """Polls /metrics every interval seconds until stop is set; peaks[name] = the largest value seen, and
    peaks['<name>_start'] the first (counters are reported as their growth over the level)."""
    first = None
    while not stop.is_set():
        try:
            status, text = await target.get_text("/metrics", timeout=5)
            if status == 200:
                v = parse_metrics(text)
                if first is None:
                    first = v
                for k in WATCHED:
                    if k in v:
                        peaks[k] = max(peaks.get(k, v[k]), v[k])
                        if k.endswith("_total"):
                            peaks[k + "_during"] = v[k] - first.get(k, 0.0)
        except (OSError, asyncio.TimeoutError, ResponseError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def one_stream(target, args, model, variant, prompt):
    """Sends one streaming request and checks it; returns a result dict (ok or error)."""
    endpoint = args.endpoint
    body = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens,
            "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    t_sent = time.perf_counter()
    checker = StreamChecker(endpoint, args.max_tokens, t_sent)
    writer = None
    t_connected = [None]
    try:
        async def go():
            nonlocal writer
            try:
                reader, writer = await asyncio.open_connection(target.host, target.port)
            except OSError as e:
                raise ResponseError("connect", str(e))
            # The TCP handshake alone: a server whose listen backlog overflows drops SYNs, and the kernel
            # retries them after 1 s, 3 s, 7 s..., which shows here rather than as slow generation.
            t_connected[0] = time.perf_counter()
            writer.write(target.request_bytes("POST", path, body))
            await writer.drain()
            status, headers = await read_headers(reader)
            if status != 200:
                text = b"".join([p async for p in body_pieces(reader, headers)])
                raise ResponseError("http_%d" % status, text.decode("utf-8", "replace")[:300])
            if not headers.get("content-type", "").startswith("text/event-stream"):
                raise ResponseError("protocol", "content-type %r" % headers.get("content-type"))
            parser = SSEParser(checker.on_event)
            async for piece in body_pieces(reader, headers):
                parser.feed(piece, time.perf_counter())
            parser.close()
            return checker.finish()
        tokens = await asyncio.wait_for(go(), args.request_timeout)
    except asyncio.TimeoutError:
        return {"ok": False, "kind": "timeout", "message": "no complete answer in %gs" % args.request_timeout}
    except ResponseError as e:
        return {"ok": False, "kind": e.kind, "message": str(e)}
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        return {"ok": False, "kind": "connect", "message": "%s: %s" % (type(e).__name__, e)}
    finally:
        if writer is not None:
            writer.close()
    t_end = time.perf_counter()
    times = checker.token_times
    return {
        "ok": True, "variant": variant, "tokens": tokens, "text": "".join(checker.text),
        "finish_reason": checker.finish_reason,
        "ttft": (times[0] - t_sent) if times else None,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "latency": t_end - t_sent,
        "connect": t_connected[0] - t_sent,
        # Time per output token after the first: robust to chunks that carry several tokens (the server
        # sends what queued since its last write), where ITL measures the gaps between chunks.
        "tpot": (times[-1] - times[0]) / (tokens - 1) if times and tokens > 1 else None,
    }


async def run_level(target, args, model, concurrency, prompts):
    """concurrency workers send requests back to back until the level's time or count runs out."""
    results = []
    started = 0
    t0 = time.perf_counter()
    deadline = t0 + args.duration

    async def worker():
        nonlocal started
        while time.perf_counter() < deadline and started < args.max_requests:
            variant = started % len(prompts)
            started += 1
            results.append(await one_stream(target, args, model, variant, prompts[variant]))

    peaks = {}
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_metrics(target, args.watch_metrics, stop, peaks)) if args.watch_metrics else None
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    if watcher:
        stop.set()
        await watcher
    r = summarize(concurrency, results, elapsed, args)
    if watcher:
        r["server_peaks"] = peaks
    return r


def summarize(concurrency, results, elapsed, args):
    ok = [r for r in results if r["ok"]]
    errors = {}
    examples = []
    for r in results:
        if not r["ok"]:
            errors[r["kind"]] = errors.get(r["kind"], 0) + 1
            if len(examples) < 5:
                examples.append("%s: %s" % (r["kind"], r["message"]))
    # Greedy answers to one prompt must agree whatever the batch held.
    mismatched = 0
    if args.temperature == 0:
        by_variant = {}
        for r in ok:
            by_variant.setdefault(r["variant"], []).append(r["text"])
        for texts in by_variant.values():
            mismatched += sum(1 for t in texts if t != texts[0])
    if args.check_greedy and mismatched:
        errors["greedy_mismatch"] = mismatched
        examples.append("greedy_mismatch: %d answers differ from the first answer to the same prompt" % mismatched)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 2)
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    connect = [r["connect"] for r in ok]
    chunks = sum(len(r["itl"]) + 1 for r in ok if r["ttft"] is not None)
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "requests": len(results),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "error_examples": examples,
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None,
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed > 0 else None,
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
        "ttft_ms_max": ms(max(ttft)) if ttft else None,
        "latency_ms_max": ms(max(r["latency"] for r in ok)) if ok else None,
        "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)), "tpot_ms_p99": ms(percentile(tpot, 99)),
        "tokens_per_chunk": round(tokens / chunks, 2) if chunks else None,
        "connect_ms_p50": ms(percentile(connect, 50)), "connect_ms_p99": ms(percentile(connect, 99)),
        "connect_ms_max": ms(max(connect)) if connect else None,
        "finish_length": sum(1 for r in ok if r["finish_reason"] == "length"),
        "finish_stop": sum(1 for r in ok if r["finish_reason"] == "stop"),
        "greedy_mismatched": mismatched if args.temperature == 0 else None,
    }


COLUMNS = [("concurrency", "conc"), ("requests", "requests"), ("errors", "errors"), ("tokens_per_s", "gen tok/s"),
           ("requests_per_s", "req/s"), ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"),
           ("itl_ms_p50", "ITL p50 ms"), ("itl_ms_p99", "ITL p99 ms"), ("tpot_ms_p50", "TPOT p50 ms"),
           ("tokens_per_chunk", "tok/chunk"), ("connect_ms_p99", "connect p99 ms")]


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return "%.1f" % v if abs(v) >= 10 else "%.2f" % v
    return str(v)


def table(runs, markdown):
    multi = len({r.get("label") for r in runs}) > 1
    cols = ([("label", "run")] if multi else []) + COLUMNS
    if any("server_peaks" in r for r in runs):
        cols = cols + [("peak_running", "peak running"), ("peak_waiting", "peak waiting"), ("preemptions", "preempted")]
        runs = [dict(r, peak_running=r.get("server_peaks", {}).get("requests_running"),
                     peak_waiting=r.get("server_peaks", {}).get("requests_waiting"),
                     preemptions=r.get("server_peaks", {}).get("preemptions_total_during")) for r in runs]
    rows = [[fmt(r.get(k)) for k, _ in cols] for r in runs]
    heads = [h for _, h in cols]
    if markdown:
        out = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(out)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    out = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def chart(runs, path):
    """Throughput, TTFT and ITL by concurrency, one line per run label. Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("load.py: no chart: matplotlib is not importable by %s (Debian: apt-get install python3-matplotlib, "
              "then run this with /usr/bin/python3)" % sys.executable, file=sys.stderr)
        return False
    labels = []
    for r in runs:
        if r.get("label") not in labels:
            labels.append(r.get("label"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    panels = [("tokens_per_s", None, "generated tokens/s (all streams)"),
              ("ttft_ms_p50", "ttft_ms_p99", "time to first token (ms)"),
              ("itl_ms_p50", "itl_ms_p99", "inter-token latency (ms)")]
    for ax, (key, key99, title) in zip(axes, panels):
        for i, label in enumerate(labels):
            rs = sorted((r for r in runs if r.get("label") == label), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in rs]
            color = "C%d" % i
            name = label or "run"
            ax.plot(xs, [r[key] for r in rs], "o-", color=color, label=name + (" p50" if key99 else ""))
            if key99:
                ax.plot(xs, [r[key99] for r in rs], "s--", color=color, alpha=0.7, label=name + " p99")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in runs}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    print("load.py: chart written to %s" % path, file=sys.stderr)
    return True


async def wait_ready(target, seconds):
    deadline = time.monotonic() + seconds
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, _ = await target.get_json("/health", timeout=2)
            if status == 200:
                return
            last = "HTTP %d" % status
        except (OSError, asyncio.TimeoutError, ResponseError) as e:
            last = str(e) or type(e).__name__
        await asyncio.sleep(0.2)
    raise SystemExit("load.py: %s/health not ready within %gs (%s)" % (args_url(target), seconds, last))


def args_url(target):
    return "http://%s:%d%s" % (target.host, target.port, target.base)


async def main_async(args):
    target = Target(args.url, args.api_key)
    await wait_ready(target, args.wait)
    model = args.model
    if not model:
        status, j = await target.get_json("/v1/models")
        if status == 200 and j and j.get("data"):
            model = j["data"][0]["id"]
        elif status == 401:
            raise SystemExit("load.py: /v1/models answered 401: give --api-key")
    props = None
    try:
        status, j = await target.get_json("/props")
        if status == 200:
            props = j
    except (OSError, asyncio.TimeoutError, ResponseError):
        pass
    if args.endpoint == "auto":
        args.endpoint = "completions" if (props or {}).get("chat_template") is False else "chat"
        print("load.py: /v1/%s" % ("chat/completions" if args.endpoint == "chat" else "completions"), file=sys.stderr)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = [f.read()]
    else:
        prompts = [build_prompt(args.prompt_tokens, v, args.shared_prefix) for v in range(args.prompt_variants)]
    label = args.label or (props or {}).get("kv", {}).get("describe") or ""
    if args.prefix_reuse:
        await prefix_reuse(target, args, model, prompts[0])
        return [], props, model
    runs = []
    for c in args.concurrency:
        print("load.py: %d concurrent streams for %gs..." % (c, args.duration), file=sys.stderr)
        r = await run_level(target, args, model, c, prompts)
        r["label"] = label
        runs.append(r)
        print("  %d requests, %d errors, %s gen tok/s, TTFT p50 %s ms, ITL p50 %s ms" %
              (r["requests"], r["errors"], fmt(r["tokens_per_s"]), fmt(r["ttft_ms_p50"]), fmt(r["itl_ms_p50"])),
              file=sys.stderr)
        for e in r["error_examples"]:
            print("  error: " + e, file=sys.stderr)
        if "server_peaks" in r:
            pk = r["server_peaks"]
            print("  server peaks: %s running, %s waiting, KV pool %s of %s blocks (ratio %s), %s preemptions" %
                  (fmt(pk.get("requests_running")), fmt(pk.get("requests_waiting")), fmt(pk.get("kv_pool_blocks_in_use")),
                   fmt(pk.get("kv_pool_blocks_capacity")), fmt(pk.get("kv_pool_usage_ratio")),
                   fmt(pk.get("preemptions_total_during"))), file=sys.stderr)
    return runs, props, model


async def prefix_reuse(target, args, model, prefix):
    """The prefix cache's effect on the time to first token: one request with a long prompt, then one whose
    prompt is the same text with another ending (the server can reuse the first's whole blocks), one at a
    time. Prints both TTFTs and their ratio; a response that fails the stream checks exits non-zero."""
    saved = args.max_tokens
    args.max_tokens = 8
    first = await one_stream(target, args, model, 0, prefix + " The end of the first question.")
    second = await one_stream(target, args, model, 1, prefix + " A different ending, for the second one.")
    args.max_tokens = saved
    for name, r in (("first", first), ("second", second)):
        if not r["ok"]:
            raise SystemExit("load.py: the %s request failed: %s: %s" % (name, r["kind"], r["message"]))
    ratio = second["ttft"] / first["ttft"]
    print("| request | TTFT ms |\n|---|---:|\n| first (%d-word prompt) | %.1f |\n| second (same prefix) | %.1f |\n"
          "second / first: %.1f%%" % (len(prefix.split()), first["ttft"] * 1e3, second["ttft"] * 1e3, 100 * ratio))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default %(default)s)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels (default %(default)s)")
    p.add_argument("--duration", type=float, default=10, help="seconds of new requests per level (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=10000, help="at most this many requests per level")
    p.add_argument("--request-timeout", type=float, default=120, help="a stream not done after this many seconds is an error")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy: answers to one prompt must agree)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (servers that know it generate max_tokens)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="approximate prompt length in words (default %(default)s)")
    p.add_argument("--prompt-variants", type=int, default=16, help="distinct prompts, sent in turn (default %(default)s)")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="WORDS",
                   help="the prompts' first WORDS words are the same for every variant (what a prefix cache reuses)")
    p.add_argument("--prompt-file", help="send this file's text as every prompt instead")
    p.add_argument("--endpoint", choices=["auto", "chat", "completions"], default="auto",
                   help="auto (the default): chat, unless /props says the model has no chat template")
    p.add_argument("--model", help="the model field (default: the first of /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer")
    p.add_argument("--wait", type=float, default=60, help="seconds to wait for /health 200 first")
    p.add_argument("--prefix-reuse", action="store_true",
                   help="instead of the sweep: the TTFT of a long prompt (--prompt-tokens or --prompt-file), then of "
                        "the same prompt with another ending (what the prefix cache saves)")
    p.add_argument("--check-greedy", action="store_true",
                   help="at temperature 0, count answers that differ from the first to the same prompt as errors")
    p.add_argument("--watch-metrics", type=float, default=0, metavar="SECONDS",
                   help="poll the server's /metrics this often during each level and report the peaks (requests "
                        "running and waiting, KV pool blocks in use, preemptions): how many sequences the pool held")
    p.add_argument("--label", help="name of this run in tables and charts (default: /props kv.describe)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--chart", metavar="PNG", help="draw throughput, TTFT and ITL by concurrency (needs matplotlib)")
    p.add_argument("--from-json", nargs="+", metavar="IN",
                   help="run nothing: report (and chart) the runs of these --json files together")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error("--concurrency takes integers separated by commas, e.g. 1,4,16,64")
    if not args.concurrency or min(args.concurrency) < 1 or max(args.concurrency) > 1024:
        p.error("--concurrency levels must be between 1 and 1024")
    if not 0 < args.duration <= 3600:
        p.error("--duration must be in (0, 3600] seconds")
    if args.max_tokens < 1 or args.max_requests < 1 or args.prompt_variants < 1 or args.prompt_tokens < 1:
        p.error("--max-tokens, --max-requests, --prompt-variants and --prompt-tokens must be at least 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        runs = []
        for path in args.from_json:
            with open(path, encoding="utf-8") as f:
                runs += json.load(f)["runs"]
        print(table(runs, args.markdown))
        if args.chart:
            chart(runs, args.chart)
        return 0
    runs, props, model = asyncio.run(main_async(args))
    if args.prefix_reuse:
        return 0
    print(table(runs, args.markdown))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "json", "chart", "from_json", "markdown")}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": config, "model": model, "props": props, "runs": runs}, f, indent=2)
            f.write("\n")
    if args.chart:
        chart(runs, args.chart)
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
