"""SIGTERM or a first Ctrl-C (SIGINT) to ``ds4serve serve``: the running stream ends with its terminal event, the
queued request and one sent during the drain get a JSON 503 with Retry-After (``/health`` says shutting_down),
the disk tier holds the finished request's entry, and the process exits 0; a second Ctrl-C exits at once, in one
log line. The same process takes its API key from the environment and closes a connection that never sends a
request."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from .server_harness import free_port, wait_for

LAUNCH = "from ds4serve.cli import main; raise SystemExit(main())"
KEY = "from-the-environment"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT = 8  # shorter than the stream: it is stopped at the timeout
LONG_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 900,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


def start(tiny_dir, tmp_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["serve", "--model", str(tiny_dir), "--port", str(port), "--max-context", "1024", "--no-warm-up"]
    args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--prefix-cache-dir", str(tmp_path / "snapshots")]
    args += ["--idle-timeout-s", "1", "--max-batch", "1"]  # one stream runs, the next request waits
    log = open(tmp_path / "serve.log", "w")
    env = {**os.environ, "DS4SERVE_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout=180)
    return proc, base


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_first_signal_finishes_running_streams_and_refuses_queued_ones(sig, tiny_dir, tmp_path):
    proc, base = start(tiny_dir, tmp_path)
    try:
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers=AUTH).status_code == 200
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as idle:
            idle.settimeout(60)
            assert idle.recv(1) == b""  # closed by the server, not by this timeout
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json=LONG_CHAT, headers=AUTH, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        first.set()

        running = threading.Thread(target=stream)
        running.start()
        assert first.wait(120), "the stream never started"
        queued: list[httpx.Response] = []
        short = {"model": "tiny", "messages": [{"role": "user", "content": "Yo"}], "max_tokens": 2}
        waiter = threading.Thread(
            target=lambda: queued.append(
                httpx.post(f"{base}/v1/chat/completions", json=short, headers=AUTH, timeout=120)
            )
        )
        waiter.start()
        wait_for(lambda: httpx.get(f"{base}/health", timeout=5).json()["queue_depth"] == 1, timeout=60)
        assert lines[-1] != "[DONE]", "the stream ended before the signal: nothing was tested"
        proc.send_signal(sig)
        waiter.join(60)
        # still listening while the stream runs: the drain is said, not a refused connection
        assert lines[-1] != "[DONE]", "the stream ended before the drain could be seen"
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        late = httpx.post(f"{base}/v1/chat/completions", json=short, headers=AUTH, timeout=30)
        assert late.status_code == 503 and late.headers["retry-after"]
        running.join(SHUTDOWN_TIMEOUT + 30)
        assert proc.wait(SHUTDOWN_TIMEOUT + 30) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert queued and queued[0].status_code == 503 and queued[0].headers["retry-after"]
    assert queued[0].json()["error"]["code"] == "unavailable"
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])  # the finish chunk, or (stopped at the timeout) an error event
    assert last.get("error") or last["choices"][0]["finish_reason"] == "length"
    files = list((tmp_path / "snapshots").glob("*/*"))
    assert files and all(f.name.endswith(".safetensors") for f in files)  # written, no temporaries left


def test_second_ctrl_c_exits_at_once_in_one_log_line(tiny_dir, tmp_path):
    """The first Ctrl-C drains; the second, while a stream still runs, ends the process with status 130 and one
    log line, no traceback (the stream is cut off with no terminal event)."""
    proc, base = start(tiny_dir, tmp_path)
    try:
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", f"{base}/v1/chat/completions", json=LONG_CHAT, headers=AUTH, timeout=120
                ) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                        first.set()
            except httpx.TransportError:
                pass  # cut off: what a forced exit does

        running = threading.Thread(target=stream)
        running.start()
        assert first.wait(120), "the stream never started"
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, timeout=60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        running.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "data: [DONE]" not in lines, "the stream ended before the second Ctrl-C: nothing was tested"
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert log.count("second Ctrl-C") == 1
    assert "second Ctrl-C: exiting now, 1 running request(s) cut off" in log.splitlines()[-1], log
