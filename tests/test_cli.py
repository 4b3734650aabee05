"""The command line: make-tiny, inspect and generate on a fresh checkpoint."""

from __future__ import annotations

import json

from ds4serve.cli import main


def test_make_tiny_inspect_generate(tmp_path, capsys, monkeypatch):
    out = tmp_path / "tiny"
    assert main(["make-tiny", str(out), "--seed", "3", "--layers", "4", "--quantize", "fp8+fp4", "--mtp", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["compress_ratios"] == [0, 0, 4, 16, 0]
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SSCH" in text and "official layout" in text and "torch.float8_e4m3fn" in text and "torch.int8" in text

    assert main(["generate", "--model", str(out), "--max-tokens", "5", "Hello"]) == 0
    captured = capsys.readouterr()
    assert "prompt tokens" in captured.err and "decode" in captured.err and "finish length" in captured.err


def test_generate_uses_the_cached_default_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", str(tmp_path))
    assert main(["generate", "--max-tokens", "2", "Hi"]) == 0
    assert (tmp_path / "tiny-default-v1" / "config.json").is_file()
    assert "2 generated" in capsys.readouterr().err
