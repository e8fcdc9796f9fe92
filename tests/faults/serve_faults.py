#!/usr/bin/env python3
"""turboquant-serve under faults (issue 25 item 4): bounded, 127.0.0.1 only, stops by itself.

  tests/faults/serve_faults.py build/bin/turboquant-serve            # CI mode (ctest serve_faults)
  tests/faults/serve_faults.py build/bin/turboquant-serve --long     # manual: 60 s of 64 streams

It starts the server on the demo model (any free port), then
  1. takes the reference texts: each prompt alone, temperature 0, one at a time;
  2. warms up (one round of 64 concurrent streams) and reads the process' RSS;
  3. kills clients mid-stream (the socket is closed after the first chunk);
  4. sends 1000 malformed requests of 20 kinds (50 each) mixed with well-formed ones (every 10th),
     each kind checked for the answer it must get (a 4xx with a JSON error, or the connection closed by
     the server within its --timeout for the half-header kinds);
  5. runs 64 concurrent streams for a bounded time (CI 8 s, --long 60 s);
then checks that every well-formed request got the reference text in full with finish_reason 'length',
that /props shows no request running and an empty KV pool (prefix cache off, so nothing is kept), that
the RSS is within 10% of its value after warm-up, and that the server still answers and exits on SIGTERM.
Only the Python standard library is used. Exit 0: all held; 1: a check failed (each failure printed).
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HOST = "127.0.0.1"
PROMPTS = ["It is a truth universally acknowledged", "The quick brown fox", "Once upon a time",
           "In the beginning", "A hacker is", "The program", "Linus said", "Call me Ishmael"]
MAX_TOKENS = 24
SERVER_TIMEOUT_S = 2  # --timeout: how long the server waits on a client's reads (bounds the slowloris kinds)
MAX_BODY = 65536      # --max-body: larger bodies must get 413

failures = []
flock = threading.Lock()


def fail(msg):
    with flock:
        if len(failures) < 50:
            print("FAIL:", msg, flush=True)
        failures.append(msg)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def request(port, method, path, body=None, headers=None, timeout=30):
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def completion_body(prompt, stream):
    return json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})


def lone(port, prompt):
    st, data = request(port, "POST", "/v1/completions", completion_body(prompt, False),
                       {"Content-Type": "application/json"})
    if st != 200:
        raise RuntimeError(f"reference request for {prompt!r}: HTTP {st}: {data[:200]!r}")
    ch = json.loads(data)["choices"][0]
    return ch["text"]


def stream_text(port, prompt, timeout=60):
    """One streaming completion; returns (text, finish_reason, saw_done)."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=completion_body(prompt, True),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return None, f"HTTP {r.status}: {r.read()[:200]!r}", False
        text, finish, done = [], None, False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            ch = json.loads(payload)["choices"][0]
            text.append(ch.get("text", ""))
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
        return "".join(text), finish, done
    finally:
        c.close()


def check_wellformed(port, refs, prompt):
    try:
        text, finish, done = stream_text(port, prompt)
    except Exception as e:  # a well-formed request must never fail
        fail(f"well-formed stream {prompt!r}: {type(e).__name__}: {e}")
        return
    if text is None:
        fail(f"well-formed stream {prompt!r}: {finish}")
    elif text != refs[prompt] or finish != "length" or not done:
        fail(f"well-formed stream {prompt!r}: got {text!r} (finish {finish}, [DONE] {done}), "
             f"alone it was {refs[prompt]!r}")


def raw_exchange(port, data, timeout):
    """Sends raw bytes, reads until the server closes; returns (bytes read, seconds until closed)."""
    t0 = time.monotonic()
    s = socket.create_connection((HOST, port), timeout=timeout)
    try:
        s.sendall(data)
        got = b""
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            got += b
        return got, time.monotonic() - t0
    finally:
        s.close()


def status_of(raw):
    m = re.match(rb"HTTP/1\.[01] (\d{3})", raw)
    return int(m.group(1)) if m else None


JSON_HDR = {"Content-Type": "application/json"}


def malformed_kinds(ctx_size):
    """20 kinds: (name, function(port) -> None that calls fail() when the answer is wrong)."""
    def expect(name, method, path, body, headers=JSON_HDR, codes=range(400, 500)):
        def run(port):
            st, data = request(port, method, path, body, headers)
            if st not in codes:
                fail(f"{name}: HTTP {st} (wanted {list(codes)[0]}..{list(codes)[-1]}): {data[:160]!r}")
            elif st != 404 and st != 405 and st != 413:
                try:
                    err = json.loads(data)["error"]
                    if not err.get("message"):
                        fail(f"{name}: error without a message: {data[:160]!r}")
                except Exception:
                    fail(f"{name}: HTTP {st} without a JSON error: {data[:160]!r}")
        return name, run

    def raw_kind(name, data, want_status):
        # want_status None: a half request; the server must close it within its timeout (plus slack).
        def run(port):
            got, secs = raw_exchange(port, data, SERVER_TIMEOUT_S + 10)
            st = status_of(got)
            if want_status is None:
                if secs > SERVER_TIMEOUT_S + 5:
                    fail(f"{name}: the server held a half request {secs:.1f} s (its timeout is {SERVER_TIMEOUT_S} s)")
                if st is not None and not 400 <= st < 500:
                    fail(f"{name}: HTTP {st} for a half request")
            elif st is None or not 400 <= st < 500:
                fail(f"{name}: wanted a 4xx, got {got[:120]!r}")
        return name, run

    long_prompt = " ".join(["word"] * (ctx_size * 2))
    body = '{"prompt": "x", "max_tokens": 4}'
    return [
        expect("bad JSON", "POST", "/v1/completions", '{"prompt": "x", '),
        expect("not an object", "POST", "/v1/completions", '[1, 2, 3]'),
        expect("prompt of a wrong type", "POST", "/v1/completions", '{"prompt": 42, "max_tokens": 4}'),
        expect("max_tokens a string", "POST", "/v1/completions", '{"prompt": "x", "max_tokens": "4"}'),
        expect("negative max_tokens", "POST", "/v1/completions", '{"prompt": "x", "max_tokens": -5}'),
        expect("huge max_tokens", "POST", "/v1/completions", '{"prompt": "x", "max_tokens": 1e30}'),
        expect("temperature negative", "POST", "/v1/completions", '{"prompt": "x", "max_tokens": 4, "temperature": -1}'),
        expect("messages missing", "POST", "/v1/chat/completions", '{"max_tokens": 4}'),
        expect("messages of a wrong type", "POST", "/v1/chat/completions", '{"messages": "hi", "max_tokens": 4}'),
        expect("empty body", "POST", "/v1/completions", ''),
        expect("invalid UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 4}'),
        expect("oversize body", "POST", "/v1/completions",
               '{"prompt": "' + "a" * (MAX_BODY + 1024) + '"}', codes=[413]),
        expect("prompt over the context", "POST", "/v1/completions",
               json.dumps({"prompt": long_prompt, "max_tokens": 4})),
        expect("wrong method", "GET", "/v1/completions", None, {}, codes=[405]),
        expect("unknown path", "POST", "/v1/nothing-here", body, codes=[404]),
        expect("nested garbage", "POST", "/v1/completions", '{"prompt": {"a": [1, {"b": null}]}, "max_tokens": 4}'),
        raw_kind("truncated body (Content-Length larger than sent)",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": \"x\"", None),
        raw_kind("slowloris half headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", None),
        raw_kind("bad request line", b"GARBAGE\r\n\r\n", 400),
        raw_kind("bad Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -7\r\n\r\n", 400),
    ]


def kill_mid_stream(port, prompt):
    s = socket.create_connection((HOST, port), timeout=30)
    try:
        b = json.dumps({"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)
        got = b""
        while b"data:" not in got:
            chunk = s.recv(4096)
            if not chunk:
                fail("kill mid-stream: the server closed before the first chunk")
                return
            got += chunk
    finally:
        # RST instead of FIN: the abrupt end a killed client leaves.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()


def props(port):
    st, data = request(port, "GET", "/props")
    if st != 200:
        raise RuntimeError(f"/props: HTTP {st}")
    return json.loads(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("--long", action="store_true", help="60 s of 64 concurrent streams (CI: 8 s)")
    ap.add_argument("--model", help="model folder (default: the server's demo model)")
    ap.add_argument("--no-rss-check", action="store_true",
                    help="for a sanitizer build: ASan's quarantine (256 MiB of freed memory held back) makes "
                         "the RSS grow by design, and LeakSanitizer checks leaks at exit instead")
    a = ap.parse_args()
    stream_seconds = 60 if a.long else 8
    deadline = time.monotonic() + (600 if a.long else 150)  # the whole run, under ctest's TIMEOUT

    args = [a.server, "--host", HOST, "--port", "0", "--parallel", "64", "--no-prefix-cache",
            "--timeout", str(SERVER_TIMEOUT_S), "--max-body", str(MAX_BODY), "--threads-http", "256",
            "--kv-pool-mb", "256"]
    if a.model:
        args += ["--model", a.model]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    port_box = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port_box.append(int(m.group(1)))
            if "ready:" in line:
                ready.set()
    threading.Thread(target=reader, daemon=True).start()
    try:
        if not ready.wait(120) or not port_box:
            print("".join(log[-30:]))
            raise RuntimeError("the server was not ready within 120 s")
        port = port_box[0]
        ctx = props(port)["ctx_size"]
        print(f"serve_faults: server pid {proc.pid} on port {port}, context {ctx}, "
              f"streams for {stream_seconds} s", flush=True)

        refs = {p: lone(port, p) for p in PROMPTS}
        # Warm-up: every slot used once, and each kind of fault once, so that what the allocator keeps for
        # good (glibc's per-thread arenas, up to 8 per core, reached by whichever HTTP threads serve the
        # faults) is in the baseline; what grows after it is what the faults leak.
        kinds = malformed_kinds(ctx)
        assert len(kinds) == 20
        with ThreadPoolExecutor(64) as ex:
            list(ex.map(lambda i: check_wellformed(port, refs, PROMPTS[i % len(PROMPTS)]), range(64)))
        with ThreadPoolExecutor(40) as ex:
            list(ex.map(lambda i: kinds[i % 20][1](port) if i < 40 else kill_mid_stream(port, PROMPTS[0]),
                        range(48)))
        with ThreadPoolExecutor(64) as ex:
            list(ex.map(lambda i: check_wellformed(port, refs, PROMPTS[i % len(PROMPTS)]), range(64)))
        time.sleep(0.5)
        rss_warm = rss_kib(proc.pid)
        print(f"serve_faults: RSS after warm-up {rss_warm} KiB", flush=True)

        with ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda i: kill_mid_stream(port, PROMPTS[i % len(PROMPTS)]), range(32)))
        print("serve_faults: 32 clients killed mid-stream", flush=True)

        jobs = [k for k in kinds for _ in range(50)]
        random.Random(25).shuffle(jobs)
        counts = {"malformed": 0, "wellformed": 0}

        def one(i):
            if time.monotonic() > deadline:
                return
            if i % 10 == 0:
                check_wellformed(port, refs, PROMPTS[i % len(PROMPTS)])
                counts["wellformed"] += 1
            name, run = jobs[i]
            try:
                run(port)
            except Exception as e:
                fail(f"{name}: {type(e).__name__}: {e}")
            counts["malformed"] += 1
        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as ex:
            list(ex.map(one, range(len(jobs))))
        print(f"serve_faults: {counts['malformed']} malformed + {counts['wellformed']} well-formed requests "
              f"in {time.monotonic() - t0:.1f} s", flush=True)

        stop_at = time.monotonic() + stream_seconds
        done = [0]

        def streamer(i):
            k = i
            while time.monotonic() < stop_at:
                check_wellformed(port, refs, PROMPTS[k % len(PROMPTS)])
                k += 1
                with flock:
                    done[0] += 1
        with ThreadPoolExecutor(64) as ex:
            list(ex.map(streamer, range(64)))
        print(f"serve_faults: 64 concurrent streams: {done[0]} completions in {stream_seconds} s", flush=True)

        # Idle again: nothing running, the pool empty (prefix cache off, so finished sequences keep nothing).
        t_idle = time.monotonic() + 15
        while True:
            p = props(port)
            if (p["requests_running"] == 0 and p["requests_waiting"] == 0 and p["kv_pool"]["bytes_in_use"] == 0) \
                    or time.monotonic() > t_idle:
                break
            time.sleep(0.2)
        if p["requests_running"] or p["requests_waiting"] or p["kv_pool"]["bytes_in_use"]:
            fail(f"not idle 15 s after the load: running {p['requests_running']}, waiting "
                 f"{p['requests_waiting']}, KV bytes in use {p['kv_pool']['bytes_in_use']}")
        rss_end = rss_kib(proc.pid)
        print(f"serve_faults: RSS at the end {rss_end} KiB ({100.0 * (rss_end - rss_warm) / rss_warm:+.1f}%)", flush=True)
        if rss_end > rss_warm * 1.10 and not a.no_rss_check:
            fail(f"RSS grew from {rss_warm} KiB after warm-up to {rss_end} KiB (over 10%)")
        check_wellformed(port, refs, PROMPTS[0])  # still serving
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                # 0 after SIGTERM: a clean shutdown (under ASan, also no leak report at exit).
                if proc.wait(20) != 0:
                    fail(f"the server exited with {proc.returncode} after SIGTERM")
                    print("".join(log[-40:]))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                fail("the server did not exit within 20 s of SIGTERM")
        elif proc.returncode != 0:
            fail(f"the server exited with {proc.returncode} during the test")
            print("".join(log[-30:]))
    if failures:
        print(f"serve_faults: {len(failures)} failures", flush=True)
        return 1
    print("serve_faults: all checks held", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
