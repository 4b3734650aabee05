"""The command line: make-tiny, inspect and generate on a fresh checkpoint; bad options and inputs refused in
one line."""

from __future__ import annotations

import json

import pytest

from ds4serve import cli
from ds4serve.cli import main


def test_make_tiny_inspect_generate(tmp_path, capsys, monkeypatch):
    out = tmp_path / "tiny"
    assert (
        main(["make-tiny", str(out), "--seed", "3", "--layers", "4", "--quantize", "fp8+fp4", "--mtp", "1"])
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["compress_ratios"] == [0, 0, 4, 16, 0]
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SSCH" in text and "official layout" in text and "F8_E4M3" in text and "I8" in text
    assert "quant        fp8 block (32, 32), experts fp4" in text
    assert main(["make-tiny", str(tmp_path / "plain"), "--layers", "2"]) == 0
    assert main(["inspect", str(tmp_path / "plain")]) == 0
    assert "quant        none, experts bf16" in capsys.readouterr().out  # no FP8 block of a dense checkpoint

    assert main(["generate", "--model", str(out), "--max-tokens", "5", "Hello"]) == 0
    captured = capsys.readouterr()
    assert "prompt tokens" in captured.err and "decode" in captured.err and "finish length" in captured.err


@pytest.mark.parametrize("shipped", [True, False], ids=["shipped", "random"])
def test_generate_uses_the_cached_default_model(shipped, tmp_path, capsys, monkeypatch):
    """The shipped archive's folder when there is one, else a random tiny model; both kept in the cache."""
    if not shipped:
        monkeypatch.setattr(cli, "SHIPPED_MODEL", tmp_path / "absent.tar.xz")
    elif not cli.SHIPPED_MODEL.is_file():
        pytest.skip("no ds4serve/default_model.tar.xz")
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["generate", "--max-tokens", "2", "Hi"]) == 0
    folder = cli.default_model_dir()
    assert (folder / "config.json").is_file() and tmp_path / "cache" in folder.parents
    assert (folder.name == "tiny-default-v2") != shipped
    assert "2 generated" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,says",
    [
        (["serve", "--port", "99999"], "--port: expected a port in 0..65535"),
        (["serve", "--max-context", "0"], "--max-context: expected at least 1"),
        (["serve", "--max-queue", "many"], "--max-queue: expected an integer"),
        (["serve", "--speculative", "bogus"], "--speculative: expected one of"),
        (
            ["serve", "--allowed-origins", "http://a.example,notaurl"],
            "--allowed-origins: expected origins like",
        ),
        (
            ["serve", "--max-body-mb", "0"],
            "--max-body-mb: expected at least 0.01",
        ),  # every POST would be a 413
        (["serve", "--prefix-cache-dir", "/dev/null"], "--prefix-cache-dir: cannot make a directory at"),
        (["generate", "--speculative", "ngram:99", "hi"], "--speculative: K in 'ngram:99' must be in"),
        (["generate", "--temperature", "-1", "hi"], "--temperature: expected at least 0"),
        (["generate", "--top-p", "2", "hi"], "--top-p: expected a fraction in (0, 1]"),
    ],
)
def test_bad_options_are_refused_before_anything_loads(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,says",
    [
        (["generate", "--model", "{missing}", "hi"], "config.json: not found at"),
        (["generate", "--device", "cuda:99", "hi"], "device 'cuda:99'"),
        (["generate", "--dtype", "float64", "hi"], "dtype: expected one of"),
        (["make-tiny", "{missing}", "--layers", "0"], "--layers: expected at least 1"),
    ],
)
def test_bad_inputs_are_one_line_and_status_2(argv, says, tmp_path, capsys, monkeypatch):
    """A bad model directory, device or option value: one line naming it on stderr, exit status 2, no traceback
    (the log level below DEBUG)."""
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", str(tmp_path))
    assert main([a.replace("{missing}", str(tmp_path / "missing")) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds4serve: error: ") and says in err and "Traceback" not in err
