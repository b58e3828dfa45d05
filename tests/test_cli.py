"""The command line and the configuration loader, as an operator meets them."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import narwhal
from narwhal.asgi import app
from narwhal.bench.cli import _parser as bench_parser
from narwhal.cli import listen_failure, main, run_listening
from narwhal.config import Config, ConfigError, load_config
from narwhal.demo import demo_config, examples

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
    path.write_text(f"[serving]\ntokenizer = '{tmp_path / 'missing.json'}'\n{ENGINE}")
    assert main(["check-config", str(path)]) == 1
    assert "serving.tokenizer" in capsys.readouterr().err


# -- command-line errors are one line ----------------------------------------------------------

ENGINE = "[[engines]]\nname = 'a'\nurl = 'http://127.0.0.1:9'\n"


def one_line(err: str) -> str:
    """The one line a failed command printed (never a traceback, never an exception group)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Exceptions from Trio nursery" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--config", "CONFIG", "--bind", "nonsense"], "narwhal serve: --bind must be"),
        (["serve", "--config", "CONFIG", "--bind", "127.0.0.1:99999"], "'127.0.0.1:99999'"),
        (["serve", "--config", "CONFIG", "--bind", "h:8²"], "narwhal serve: --bind must be"),
        (["demo", "--bind", "nonsense"], "narwhal demo: --bind must be HOST:PORT"),
        (["demo", "--bind", "127.0.0.1:99999"], "narwhal demo: --bind must be HOST:PORT"),
        (["demo", "--time-scale", "-1"], "narwhal demo: --time-scale must be"),
        (["demo", "--time-scale", "inf"], "narwhal demo: --time-scale must be"),
        (["sim", "--bind", "nonsense", "--model", "m"], "narwhal sim: --bind must be"),
        (["sim", "--bind", "127.0.0.1:99999", "--model", "m"], "narwhal sim: --bind must be"),
        (["sim", "--bind", ":0", "--model", "m", "--time-scale", "-1"], "narwhal sim: --bind"),
        (
            ["sim", "--bind", "127.0.0.1:0", "--model", "m", "--time-scale", "-1"],
            "narwhal sim: --time-scale must be a finite number of at least 0, got -1",
        ),
        (
            ["sim", "--bind", "127.0.0.1:0", "--model", "m", "--jitter", "2"],
            "narwhal sim: --jitter must be between 0 and 1, got 2",
        ),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(ENGINE)
    argv = [str(config) if arg == "CONFIG" else arg for arg in argv]
    assert main(argv) == 2
    assert message in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the file: Is a directory"),
        (b"[serving]\nmodel = '\xff\xfe'\n" + ENGINE.encode(), "not UTF-8 text (byte 19)"),
        (b"[serving]\nmodel = 'm'\n", "engines: no [[engines]] table"),
        (b"", "engines: no [[engines]] table"),
    ],
)
def test_unusable_config_files_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, message: str
) -> None:
    path = tmp_path / "config.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        load_config(path)
    assert main(["serve", "--config", str(path)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"narwhal serve: {path}: {message}")
    assert main(["check-config", str(path)]) == 1
    assert one_line(capsys.readouterr().err).startswith(f"{path}: {message}")


ENGINE_WITH_KEY = "[[engines]]\nname = 'a'\nurl = 'http://x:1'\napi_key_env = {!r}\n"


def test_check_config_shows_the_api_keys_variable_never_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_A_KEY", "sk-secret-42")
    path = tmp_path / "config.toml"
    path.write_text(ENGINE_WITH_KEY.format("ENGINE_A_KEY"))
    assert load_config(path).engines[0].api_key() == "sk-secret-42"
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert 'api_key_env = "ENGINE_A_KEY"' in out and "sk-secret-42" not in out
    # What check-config prints loads back, and an engine without a key shows an empty name.
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    assert load_config(printed).engines[0].api_key_env == "ENGINE_A_KEY"
    path.write_text(ENGINE_WITH_KEY.replace("api_key_env = {!r}\n", ""))
    assert main(["check-config", str(path)]) == 0
    assert 'api_key_env = ""' in capsys.readouterr().out
    assert load_config(path).engines[0].api_key() is None


@pytest.mark.parametrize(
    ("value", "environment", "message"),
    [
        ("ENGINE_A_KEY", None, "the environment variable ENGINE_A_KEY is not set"),
        ("ENGINE_A_KEY", "", "the environment variable ENGINE_A_KEY is empty"),
        (
            "ENGINE_A_KEY",
            "sk secret",
            "the environment variable ENGINE_A_KEY does not hold a usable API key",
        ),
        (
            "ENGINE_A_KEY",
            "sk-\u00e9t\u00e9",
            "the environment variable ENGINE_A_KEY does not hold a usable API key",
        ),
        ("sk-secret-42", None, "must be the name of an environment variable holding the key"),
    ],
)
def test_an_unusable_api_key_env_names_the_key_never_the_value(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    environment: str | None,
    message: str,
) -> None:
    if environment is None:
        monkeypatch.delenv("ENGINE_A_KEY", raising=False)
    else:
        monkeypatch.setenv("ENGINE_A_KEY", environment)
    path = tmp_path / "config.toml"
    path.write_text(ENGINE_WITH_KEY.format(value))
    with pytest.raises(ConfigError, match=re.escape(f"engines[0].api_key_env: {message}")):
        load_config(path)
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert "sk-" not in err
    assert main(["serve", "--config", str(path)]) == 2
    assert "sk-" not in capsys.readouterr().err


def test_a_config_built_in_code_may_have_no_engines() -> None:
    assert Config().engines == ()


def test_check_config_names_the_file_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[admission]\nqueue_limt = 3\n")
    assert main(["check-config", str(path)]) == 1
    assert one_line(capsys.readouterr().err).startswith(f"{path}: admission.queue_limt: unknown")
    assert main(["check-config", str(tmp_path / "missing.toml")]) == 1
    assert one_line(capsys.readouterr().err) == f"{tmp_path / 'missing.toml'}: no such file"


@pytest.mark.realtime
@pytest.mark.parametrize("command", ["serve", "demo", "sim"])
def test_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(ENGINE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        extra = {
            "serve": ["--config", str(config), "--bind", bind],
            "demo": ["--bind", bind],
            "sim": ["--bind", bind, "--model", "m"],
        }[command]
        done = subprocess.run(
            [sys.executable, "-m", "narwhal", command, *extra],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert line == f"narwhal {command}: cannot listen on {bind}: Address already in use"


def test_listen_failure_unwraps_only_a_lone_os_error() -> None:
    refused = OSError(98, "Address already in use")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [refused])])
    assert listen_failure(nested) is refused
    assert listen_failure(refused) is refused
    assert listen_failure(ExceptionGroup("two", [refused, OSError(1, "x")])) is None
    assert listen_failure(ExceptionGroup("other", [ValueError("x")])) is None


def test_ctrl_c_out_of_a_nursery_is_a_quiet_exit() -> None:
    """Ctrl-C while the demo's router starts reached ``run_listening`` inside the demo's
    nursery's exception group, and printed a traceback (seen with the suite on three processes
    on two cores, Ctrl-C at 1.2 s, as ``create_app`` ran)."""

    async def interrupted() -> None:
        async def starting(*, task_status: trio.TaskStatus[None]) -> None:
            raise KeyboardInterrupt

        async with trio.open_nursery() as nursery:
            await nursery.start(starting)

    assert run_listening("demo", "127.0.0.1:0", interrupted) == 0

    async def interrupted_and_failed() -> None:
        async def fails() -> None:
            raise ValueError("not Ctrl-C")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails)
            raise KeyboardInterrupt

    with pytest.raises(BaseExceptionGroup) as raised:  # anything else still propagates
        run_listening("demo", "127.0.0.1:0", interrupted_and_failed)
    assert raised.group_contains(ValueError)


def test_version_and_help_list_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"narwhal {narwhal.__version__}"
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "--version" in usage
    bench_commands = bench_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(bench_commands) == {"overhead", "admission", "projection", "report", "probes"}
    for name in bench_commands:
        assert f"bench {name} " in usage


def test_the_demo_banner_names_the_live_view_and_the_dashboard() -> None:
    banner = examples("http://127.0.0.1:8000", "m")
    assert "narwhal top --url http://127.0.0.1:8000" in banner
    assert "http://127.0.0.1:8000/dashboard" in banner
    admin = demo_config().admin
    assert admin.allow_loopback_without_token and not admin.token  # from this machine only


def test_the_demo_banner_says_the_python_example_needs_openai() -> None:
    banner = examples("http://127.0.0.1:8000", "m")
    python = banner.index("from openai import OpenAI")
    assert "pip install openai" in banner[:python]
    assert "pip install -e '.[demo]'" in banner[:python]


# -- Ctrl-C before a command handles it ---------------------------------------------------------


class _InterruptedImport:
    """A meta-path finder under which importing ``narwhal.cli`` is a Ctrl-C."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "narwhal.cli":
            raise KeyboardInterrupt
        return None


def test_a_ctrl_c_while_the_command_loads_is_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from narwhal import _entry

    monkeypatch.delitem(sys.modules, "narwhal.cli")
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport(), *sys.meta_path])
    assert _entry.main() == 130
    captured = capsys.readouterr()
    assert captured.err == "narwhal: interrupted\n" and captured.out == ""


@pytest.mark.realtime
@pytest.mark.parametrize("after_s", [0.25, 0.6, 1.2])
def test_a_ctrl_c_early_in_a_command_is_never_a_traceback(after_s: float) -> None:
    """Whenever it comes (while the command loads its modules, while its engines join, once
    it serves), Ctrl-C ends ``narwhal demo`` at once and without a traceback. (Before, one in
    the first half second printed a traceback, and one while the engines joined left the demo
    waiting 30 s for a router that had shut down, then printed one.) The interpreter's own
    start-up, before any of Narwhal runs, is not tried: what Python prints there is its own."""
    with subprocess.Popen(
        [sys.executable, "-m", "narwhal", "demo", "--bind", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            process.wait(timeout=after_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            # Not stopped: a failure to read, not a test run that waits for ever (leaving the
            # ``with`` waits for the process).
            process.kill()
            _, err = process.communicate()
            pytest.fail(f"narwhal demo did not stop within 15 s of SIGINT at {after_s} s: {err}")
    assert "Traceback" not in err, err
    assert process.returncode in (0, 130, -signal.SIGINT), (process.returncode, err)
