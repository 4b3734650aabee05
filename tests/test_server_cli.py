"""``ds4serve serve`` on a fresh cache directory (what ``make serve`` runs) answers the OpenAI SDK."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time

import httpx
import openai
import pytest

import ds4serve.server.cli  # noqa: F401 - registers the serve command with the parser
from ds4serve.cli import SHIPPED_MODEL, build_parser, default_model_note, load_engine
from ds4serve.parallel import SplitModel

from .server_harness import free_port

LAUNCH = "from ds4serve.cli import main; raise SystemExit(main())"


def _built_in_name() -> str:
    """The served name of the built-in model: the shipped archive's folder, else the random tiny one's."""
    if not SHIPPED_MODEL.is_file():
        return "tiny-default-v2"
    with tarfile.open(SHIPPED_MODEL) as tar:
        return tar.next().name.split("/")[0]


def test_serve_builds_the_default_model_and_answers(tmp_path):
    port = free_port()
    env = {**os.environ, "DS4SERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "serve",
            "--port",
            str(port),
            "--max-context",
            "512",
            "--prefix-cache-dir",
            str(tmp_path / "snapshots"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        name = _built_in_name()
        assert [m.id for m in client.models.list().data] == [name]
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
        assert list((tmp_path / "snapshots").rglob("*.safetensors")), (
            "the disk tier holds the prompt's snapshot"
        )
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert default_model_note() in out and "warmed up in" in out


def test_serve_places_a_layer_split(tiny_dir):
    """``serve`` takes the same model options as ``generate``: --devices / --layer-split give the server
    a split engine; a malformed split is refused naming the flag."""
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tiny_dir),
            "--devices",
            "cpu,cpu",
            "--layer-split",
            "2,4",
            "--max-context",
            "256",
        ]
    )
    engine, model, dtype = load_engine(args)
    assert isinstance(engine.model, SplitModel) and dtype == "float32" and model == tiny_dir
    assert [len(s.layers) for s in engine.model.shards] == [2, 4] and engine.max_context == 256
    bad = build_parser().parse_args(
        ["serve", "--model", str(tiny_dir), "--devices", "cpu,cpu", "--layer-split", "3,x"]
    )
    with pytest.raises(SystemExit, match="--layer-split: expected comma-separated integers"):
        load_engine(bad)
