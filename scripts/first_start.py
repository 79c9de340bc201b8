"""Time a server's first start: launch to ready, to the first chat answer and to full speed.

Starts ``dflash2 serve`` (extra flags after ``--``) with the dflash2 cache pointed at ``--cache``
(a fresh folder measures a fresh machine: the CPU kernels and every graph are built), then polls
``/health/ready``, sends a short greedy chat request as soon as the server is ready and again every
``--interval`` seconds, and prints one line per checkpoint (seconds since launch) and per request
(its decode rate). Full speed is the moment ``dflash2_compiled`` reads 1 in ``/metrics``, or the
moment the server is ready when it has no such gauge.

    .venv/bin/python scripts/first_start.py --cache /tmp/fresh-cache --port 8123 -- --log-level INFO

The server's own log goes to ``--log`` (default: ``<cache>/server.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "Explain what a binary search does."


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def _chat(base: str, max_tokens: int) -> tuple[float, int]:
    """Seconds for one greedy chat request and the tokens it generated."""
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"}, method="POST"
    )
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return time.monotonic() - start, int(answer["usage"]["completion_tokens"])


def _compiled(base: str) -> float | None:
    """``dflash2_compiled`` from /metrics, None when the server has no such gauge."""
    status, text = _get(f"{base}/metrics")
    for line in text.splitlines() if status == 200 else ():
        if line.startswith("dflash2_compiled{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="the dflash2 cache folder (DFLASH2_CACHE) the server uses")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--log", default=None, help="the server's log file (default: <cache>/server.log)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per timed request")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between timed requests")
    parser.add_argument("--after-full-speed", type=int, default=3, help="timed requests once at full speed")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    parser.add_argument("server_args", nargs="*", help="more flags for dflash2 serve (after --)")
    args = parser.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "DFLASH2_CACHE": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [sys.executable, "-m", "dflash2.cli", "serve", "--port", str(args.port), *args.server_args]
    print("command:", " ".join(command), flush=True)
    launch = time.monotonic()
    with open(args.log or cache / "server.log", "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while _get(f"{base}/health/ready")[0] != 200:
            if server.poll() is not None or time.monotonic() - launch > args.timeout:
                print("the server exited or timed out before it was ready", flush=True)
                return 1
            time.sleep(0.25)
        ready = time.monotonic() - launch
        print(f"{ready:7.1f} s  ready", flush=True)
        full_speed: float | None = None
        remaining = args.after_full_speed
        first = True
        while remaining > 0 and time.monotonic() - launch < args.timeout:
            sent = time.monotonic() - launch
            seconds, tokens = _chat(base, args.max_tokens)
            done = time.monotonic() - launch
            if first:
                print(f"{done:7.1f} s  first answer ({tokens} tokens in {seconds:.2f} s)", flush=True)
                first = False
            compiled = _compiled(base)
            label = "eager" if compiled == 0 else "compiled" if compiled == 1 else "-"
            print(
                f"{sent:7.1f} s  request: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s [{label}]",
                flush=True,
            )
            if full_speed is None and compiled in (None, 1.0):
                full_speed = done if compiled == 1.0 else ready
                print(f"{full_speed:7.1f} s  full speed (compiled graphs in use)", flush=True)
            if full_speed is not None:
                remaining -= 1
                continue
            deadline = time.monotonic() + args.interval
            while time.monotonic() < deadline and _compiled(base) != 1.0:
                time.sleep(0.5)
            if full_speed is None and _compiled(base) == 1.0:
                full_speed = time.monotonic() - launch
                print(f"{full_speed:7.1f} s  full speed (dflash2_compiled = 1)", flush=True)
        return 0
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
