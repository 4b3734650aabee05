"""The command line: make-tiny, inspect and generate on a fresh checkpoint; bad options and inputs refused in
one line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import httpx
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


def test_raw_prompt_is_tokenized_as_completions_tokenize_a_text(tiny_dir, scripted, monkeypatch, capsys):
    """``generate --raw`` gives the engine the ids ``/v1/completions`` forwards for the same text: BOS first,
    once, whether or not the text begins with it."""
    from ds4serve import Engine
    from ds4serve.server.app import ServerConfig, create_app
    from ds4serve.tokenizer import BOS

    from .server_harness import running

    generated: list[list[int]] = []
    real_generate = Engine.generate

    def spy(self, prompt_ids, *args, **kwargs):
        generated.append(list(prompt_ids))
        return real_generate(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", spy)
    texts = ["def f(x):", BOS + "x = 1"]
    for text in texts:
        assert main(["generate", "--raw", "--model", str(tiny_dir), "--max-tokens", "1", text]) == 0
    capsys.readouterr()
    with running(create_app(scripted, ServerConfig(model_name="tiny"))) as base:
        for text in texts:
            scripted.script("Hi.")
            r = httpx.post(f"{base}/v1/completions", json={"prompt": text, "max_tokens": 8}, timeout=60)
            assert r.status_code == 200, r.text
    bos = scripted.tokenizer.bos_id
    assert generated == scripted.prompts[-2:]
    assert [p.count(bos) for p in generated] == [1, 1] and all(p[0] == bos for p in generated)


def test_make_tiny_refuses_a_path_it_cannot_make_in_one_line(tmp_path, capsys):
    """An existing file, a missing parent directory (not made) or a folder that cannot be made: one line
    naming the path, status 2."""
    afile = tmp_path / "afile"
    afile.write_text("kept")
    cases = [
        (afile, f"make-tiny: {afile} exists and is not a directory"),
        (tmp_path / "no" / "x", f"make-tiny: the parent directory {tmp_path / 'no'} does not exist"),
        (afile / "x", f"make-tiny: cannot write {afile / 'x'}: "),
    ]
    for path, says in cases:
        assert main(["make-tiny", str(path), "--layers", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ds4serve: error: {says}") and err.count("\n") == 1, err
    assert not (tmp_path / "no").exists() and afile.read_text() == "kept"


def _drop_from_index(path, name: str) -> None:
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][name]
    index.write_text(json.dumps(data))


def _truncate_a_shard(path) -> None:
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2 + 16])


def _set_config(path, **fields) -> None:
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **fields}))


@pytest.mark.parametrize(
    "damage,argv,says",
    [
        (
            lambda p: _drop_from_index(p, "layers.0.ffn.experts.1.w1.scale"),
            ["inspect"],
            "tensor layers.0.ffn.experts.1.w1.weight is FP4 but layers.0.ffn.experts.1.w1.scale is missing",
        ),
        (_truncate_a_shard, ["generate", "hi"], "cannot read its tensors, truncated or damaged"),
        (
            lambda p: (p / "tokenizer.json").write_text("xx"),
            ["generate", "hi"],
            "not a tokenizer the tokenizers",
        ),
        (
            lambda p: _set_config(p, architectures=["LlamaForCausalLM"], model_type="llama"),
            ["inspect"],
            "model_type: expected 'deepseek_v4'",
        ),
        (
            lambda p: None,
            ["generate", "--speculative", "dspark", "hi"],
            "--speculative dspark: 'dspark' needs",
        ),
        (lambda p: None, ["generate", "--device", "mps", "hi"], "device 'mps': expected cpu, cuda or cuda:N"),
    ],
)
def test_damaged_checkpoints_and_unusable_options_are_one_line(
    tiny_factory, tmp_path, capsys, damage, argv, says
):
    """What a user points the CLI at: a missing MXFP4 scale, a truncated shard (its headers, all inspecting
    needs, intact), a tokenizer file that is not one, another model's config, a draft the checkpoint lacks, a
    device this tool does not run on. One line naming it, status 2, no traceback."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_factory(seed=8, quantize="fp8+fp4"), path)
    damage(path)
    command, *rest = argv
    if command == "inspect":
        argv = [command, str(path)]
    else:
        argv = [command, "--model", str(path), *([] if "--device" in rest else ["--device", "cpu"]), *rest]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds4serve: error: ") and says in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv", [["--mtp", "-1"], ["--window", "0"], ["--format", "hf", "--quantize", "fp8"]]
)
def test_make_tiny_refuses_what_a_load_would_refuse_and_writes_nothing(tmp_path, capsys, argv):
    assert main(["make-tiny", str(tmp_path / "x"), *argv]) == 2
    assert capsys.readouterr().err.startswith("ds4serve: error: ") and not (tmp_path / "x").exists()


def test_serve_refuses_a_port_in_use_before_loading(tmp_path, capsys, caplog):
    """The address is bound before the model loads: a port in use is one line naming host:port (the model
    directory, missing here, is never looked at) and nothing claims to be serving."""
    import ds4serve.server.cli  # noqa: F401 - registers the serve command with the parser

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path / "missing"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds4serve: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1
    assert "serving" not in caplog.text


def test_output_closed_by_its_reader_ends_quietly(tiny_dir):
    """``ds4serve inspect ... | head``: the reader gone, the command stops with SIGPIPE's status and says
    nothing (no traceback)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ds4serve", "inspect", str(tiny_dir)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == cli.BROKEN_PIPE_STATUS and proc.stderr == ""


def test_a_context_past_the_trained_positions_is_warned_of(tiny_dir, caplog):
    """--max-context past max_position_embeddings runs (a user may want it) but says so in the log."""
    from ds4serve import Engine
    from ds4serve.config import ModelConfig

    trained = ModelConfig.from_dir(tiny_dir).max_position_embeddings
    with caplog.at_level("WARNING", logger="ds4serve.engine"):
        Engine.from_pretrained(tiny_dir, max_context=trained)
        assert not caplog.records
        Engine.from_pretrained(tiny_dir, max_context=trained + 1)
    assert (
        f"max_context {trained + 1} is past the checkpoint's max_position_embeddings {trained}" in caplog.text
    )
