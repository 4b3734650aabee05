"""The environment registry: parsing, the generated doc, and no reads of os.environ outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ds4serve
from ds4serve import envdoc, envs

PACKAGE = Path(ds4serve.__file__).resolve().parent
ENV_ACCESS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def env_reads(source: str) -> list[str]:
    """Every place ``source`` touches the process environment directly, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENV_ACCESS:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name in ENV_ACCESS or a.name == "*"
            ]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and any(isinstance(a, ast.Constant) and a.value in ENV_ACCESS for a in node.args)
        ):
            found.append(f"{node.lineno}: getattr(..., environ)")
    return found


def declarations(source: str) -> list[int]:
    """Lines that call ``_declare`` (registering a variable)."""
    return [
        n.lineno
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call)
        and (getattr(n.func, "id", None) == "_declare" or getattr(n.func, "attr", None) == "_declare")
    ]


@pytest.mark.parametrize(
    "snippet",
    [
        "import os\nx = os.environ['A']",
        "import os\nx = os.environ.get('A')",
        "import os\nx = os.getenv('A')",
        "import os as o\nx = o.environ",
        "from os import environ\nx = environ.get('A')",
        "from os import getenv",
        "import os\nx = getattr(os, 'environ')",
        "import os\nos.environ['A'] = '1'",
    ],
)
def test_scanner_finds_every_form_of_env_access(snippet):
    assert env_reads(snippet)


def test_scanner_ignores_unrelated_code():
    assert env_reads("import os\nx = os.path.join('a', 'b')\nenv = {'environ': 1}") == []


def test_no_module_reads_the_environment_outside_the_registry():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envs.py" and path.parent == PACKAGE:
            continue
        hits = env_reads(path.read_text(encoding="utf-8"))
        if hits:
            offenders[str(path.relative_to(PACKAGE.parent))] = hits
    assert offenders == {}, f"read environment variables through ds4serve.envs: {offenders}"


def test_variables_are_declared_only_in_the_registry_module():
    elsewhere = {
        str(p.relative_to(PACKAGE.parent)): declarations(p.read_text(encoding="utf-8"))
        for p in PACKAGE.rglob("*.py")
        if p != PACKAGE / "envs.py"
    }
    assert {k: v for k, v in elsewhere.items() if v} == {}


def test_environment_doc_is_current():
    path = PACKAGE.parent / "docs" / "ENVIRONMENT.md"
    assert path.read_text(encoding="utf-8") == envs.markdown(), "stale: run python -m ds4serve.envdoc"
    assert envdoc.main(["--check", str(path)]) == 0


def test_doc_check_reports_a_stale_file(tmp_path):
    stale = tmp_path / "ENVIRONMENT.md"
    stale.write_text(envs.markdown().replace("DS4SERVE_GPU_PROFILE", "DS4SERVE_OLD_NAME"))
    assert envdoc.main(["--check", str(stale)]) == 1
    assert envdoc.main([str(stale)]) == 0
    assert envdoc.main(["--check", str(stale)]) == 0


def test_doc_lists_every_variable_machine_independently():
    text = envs.markdown()
    for name in envs.REGISTRY:
        assert f"`{name}`" in text
    assert str(Path.home()) not in text


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", " On "])
def test_bool_on(monkeypatch, raw):
    monkeypatch.setenv("DS4SERVE_GPU_PROFILE", raw)
    assert envs.get(envs.GPU_PROFILE) is True


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", "OFF", ""])
def test_bool_off(monkeypatch, raw):
    monkeypatch.setenv("DS4SERVE_GPU_PROFILE", raw)
    assert envs.get(envs.GPU_PROFILE) is False


def test_bool_unset_is_the_default(monkeypatch):
    monkeypatch.delenv("DS4SERVE_TIMING", raising=False)
    assert envs.get(envs.TIMING) is False


@pytest.mark.parametrize("raw", ["2", "enabled", "y", "1.0", "tru"])
def test_malformed_bool_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("DS4SERVE_TIMING", raw)
    with pytest.raises(envs.EnvError, match="DS4SERVE_TIMING"):
        envs.get(envs.TIMING)


def test_typed_values_parse_and_malformed_ones_name_the_variable(monkeypatch):
    number = envs.EnvVar("DS4SERVE_TEST_NUMBER", "int", 3, "test only")
    monkeypatch.setenv(number.name, " 42 ")
    assert number.get() == 42
    monkeypatch.setenv(number.name, "4x")
    with pytest.raises(envs.EnvError, match="DS4SERVE_TEST_NUMBER='4x': expected an integer"):
        number.get()
    ratio = envs.EnvVar("DS4SERVE_TEST_RATIO", "float", 0.5, "test only")
    monkeypatch.setenv(ratio.name, "half")
    with pytest.raises(envs.EnvError, match="DS4SERVE_TEST_RATIO"):
        ratio.get()


def test_path_values_expand_home(monkeypatch):
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", "~/somewhere")
    assert envs.get(envs.CACHE_DIR) == Path.home() / "somewhere"


def test_declaring_twice_or_with_an_unknown_kind_fails():
    with pytest.raises(ValueError, match="DS4SERVE_TIMING: declared twice"):
        envs._declare("DS4SERVE_TIMING", "bool", False, "again")
    with pytest.raises(ValueError, match="DS4SERVE_NEW: kind"):
        envs._declare("DS4SERVE_NEW", "list", None, "bad kind")
    assert "DS4SERVE_NEW" not in envs.REGISTRY


def test_a_log_level_is_one_of_loggings_and_a_bad_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("DS4SERVE_LOG_LEVEL", "warning")
    assert envs.get(envs.LOG_LEVEL) == "WARNING"
    monkeypatch.setenv("DS4SERVE_LOG_LEVEL", "LOUD")
    with pytest.raises(
        ValueError, match=r"DS4SERVE_LOG_LEVEL='LOUD': expected one of CRITICAL, ERROR, WARNING"
    ):
        envs.get(envs.LOG_LEVEL)
