"""The command line and the configuration loader, as an operator meets them."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.asgi import app
from narwhal.cli import main
from narwhal.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_config_is_valid_and_check_config_prints_effective_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check-config", str(ROOT / "config.toml")]) == 0
    out = capsys.readouterr().out
    assert "[serving]" in out and 'model = "llama-3.1-8b-instruct"' in out
    # engine-b does not set token_ids: its effective value is shown anyway.
    engine_b = out.split('name = "engine-b"')[1]
    assert "token_ids = true" in engine_b
    assert "prefill_concurrency = 4" in engine_b


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[admission]\nqueue_limt = 3\n", "admission.queue_limt: unknown key"),
        ("[admission]\nqueue_limit = '3'\n", "admission.queue_limit: expected an integer"),
        ("[admission]\nqueue_limit = 0\n", "admission.queue_limit: must be greater than 0"),
        ("[admission]\nmode = 'closed'\n", "admission.mode: must be one of"),
        ("[serving]\nbind = 'localhost'\n", "serving.bind: must be HOST:PORT"),
        (
            "[[engines]]\nname = 'a'\nurl = 'http://x:1'\ndialect = 'vlm'\n",
            "engines[0].dialect: must be one of",
        ),
        ("[[engines]]\nname = 'a'\n", "engines[0].url: required key is missing"),
        (
            "[[engines]]\nname = 'a'\nurl = 'http://x:1'\n[[engines]]\nname = 'a'\nurl = 'http://y:1'\n",
            "used twice",
        ),
        ("[control]\nlease_ttl_s = true\n", "control.lease_ttl_s: expected a number"),
        ("[serving\n", "not valid TOML"),
    ],
)
def test_bad_configurations_name_the_dotted_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(path)
    assert main(["check-config", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_missing_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "/nonexistent.toml"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_hypercorn_factory_reads_the_config_named_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NARWHAL_CONFIG", str(ROOT / "config.toml"))
    application = app()
    assert application.extensions["narwhal"].config.serving.model == "llama-3.1-8b-instruct"


def test_unknown_command_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "check-config" in capsys.readouterr().out


def test_check_config_loads_the_named_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[serving]\ntokenizer = '{tmp_path / 'missing.json'}'\n")
    assert main(["check-config", str(path)]) == 1
    assert "serving.tokenizer" in capsys.readouterr().err
