"""graceful._options: every option declared once, parsed and checked the same way from the
command line and from ``GRACEFUL_*``, with one-line errors that name the option."""

from __future__ import annotations

import inspect
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graceful
from graceful import _options as _config
from graceful._cli import run as _run
from graceful._core.policy import POLICIES
from graceful._options import OPTIONS, ConfigError, Option

#: Bad text for each kind of value (an option's metavar); "" is bad for every option.
BAD = {
    "SECONDS": ["abc", "-1", "nan", "NaN", "inf", "-inf", "1e400", "604801", "1" * 400, "2s"],
    "PORT": ["abc", "-1", "65536", "1.5", "8_000", "9" * 30, "٣"],
    "N": ["abc", "0", "-2", "1.5", "1025", "9" * 30],
    "COUNT": ["abc", "-1", "1.5", "1001", "9" * 30],
    "PATH": ["relative", "/a b", "/a?b", "/a#b", "/tab\there"],
    "BOOL": ["maybe", "2", "tru", "y", "t"],
    "HOST": ["a..b", "-bad", "bad-", "under_score", "a b", "x" * 64 + ".com", "[::1]"],
}
#: The variables graceful run read before options were declared in one table.
PREVIOUS_VARIABLES = [
    f"GRACEFUL_{name}"
    for name in (
        "SERVER", "HOST", "PORT", "WORKERS", "POLICY", "IDLE", "MIN_WAIT", "MAX_WAIT",
        "DRAIN_TIMEOUT", "GRACE_PERIOD", "KILL_MARGIN", "READINESS_PATH", "LIVENESS_PATH",
        "PRESTOP_PATH", "WEBSOCKET_CLOSE_GRACE", "TIMEOUT_KEEP_ALIVE", "HTTP", "LOOP",
        "LOG_LEVEL",
    )
]  # fmt: skip


def bad_values(opt: Option) -> list[str]:
    if opt.metavar.startswith("{"):
        return ["nope", "uvicorn2", "1"]
    return BAD[opt.metavar]


def cases() -> list[tuple[Option, str]]:
    return [(opt, text) for opt in OPTIONS for text in ["", "   ", *bad_values(opt)]]


def one_line_error(given: dict[str, str], environ: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as caught:
        _config.resolve(given, environ)
    message = str(caught.value)
    assert "\n" not in message
    assert len(message) < 200, message
    return message


@pytest.mark.parametrize(("opt", "text"), cases(), ids=lambda x: getattr(x, "flag", repr(x)))
def test_bad_value_from_the_command_line_names_the_flag(opt: Option, text: str) -> None:
    assert one_line_error({opt.name: text}, {}).startswith(f"{opt.flag}: ")


@pytest.mark.parametrize(("opt", "text"), cases(), ids=lambda x: getattr(x, "flag", repr(x)))
def test_bad_value_from_the_environment_names_the_variable(opt: Option, text: str) -> None:
    assert one_line_error({}, {opt.env: text}).startswith(f"{opt.env}: ")


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.flag)
@settings(database=None)
@given(text=st.text(max_size=30))
def test_any_text_is_a_value_or_one_line_naming_the_option(opt: Option, text: str) -> None:
    try:
        _config.resolve({opt.name: text}, {})
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message
        assert opt.flag in message


def test_the_previous_variables_still_work() -> None:
    assert {opt.env for opt in OPTIONS} >= set(PREVIOUS_VARIABLES)


def test_names_give_flags_and_variables() -> None:
    opt = _config.option("drain_timeout")
    assert (opt.flag, opt.env) == ("--drain-timeout", "GRACEFUL_DRAIN_TIMEOUT")
    assert _config.option("grace_period").env == graceful.GRACE_PERIOD_ENV


def test_command_line_wins_over_environment_which_wins_over_default() -> None:
    environ = {"GRACEFUL_IDLE": "3", "GRACEFUL_DRAIN_TIMEOUT": "20"}
    values = _config.resolve({"idle": "4"}, environ)
    assert (values["idle"], values.label("idle")) == (4.0, "--idle")
    assert (values["drain_timeout"], values.label("drain_timeout")) == (
        20.0,
        "GRACEFUL_DRAIN_TIMEOUT",
    )
    assert (values["kill_margin"], values.given("kill_margin")) == (1.0, False)
    # A bad variable does not matter when the command line sets the option.
    assert _config.resolve({"idle": "4"}, {"GRACEFUL_IDLE": "abc"})["idle"] == 4.0


def test_values_are_stripped_and_case_insensitive() -> None:
    values = _config.resolve(
        {"policy": " Serve_Until_Killed ", "http": "H11", "nudge_clients": "ON"}, {}
    )
    assert (values["policy"], values["http"], values["nudge_clients"]) == (
        "serve-until-killed",
        "h11",
        True,
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [(t, True) for t in ("true", "TRUE", "1", "yes", "Yes", "on", "ON")]
    + [(t, False) for t in ("false", "False", "0", "no", "NO", "off", "Off")],
)
def test_booleans(text: str, value: bool) -> None:
    assert _config.boolean(text) is value
    assert _config.resolve({}, {"GRACEFUL_NUDGE_CLIENTS": text})["nudge_clients"] is value


@pytest.mark.parametrize("text", ["none", "off", "NONE"])
def test_endpoints_can_be_turned_off(text: str) -> None:
    assert _config.resolve({"readiness_path": text}, {})["readiness_path"] is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "0.0.0.0", "::", "localhost", "a-b.c."])
def test_hosts(host: str) -> None:
    assert _config.resolve({"host": host}, {})["host"] == host


# --------------------------------------------------------------- checked together


def test_grace_period_must_exceed_the_kill_margin_naming_both() -> None:
    message = one_line_error({"grace_period": "2"}, {"GRACEFUL_KILL_MARGIN": "2"})
    assert message.startswith(
        "--grace-period (2 s) must be greater than twice GRACEFUL_KILL_MARGIN"
    )
    message = one_line_error({}, {"GRACEFUL_GRACE_PERIOD": "0.5"})
    assert "GRACEFUL_GRACE_PERIOD (0.5 s)" in message
    assert "--kill-margin (1 s)" in message
    assert _config.resolve({"grace_period": "2", "kill_margin": "0.9"}, {})


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("readiness_path", "liveness_path"),
        ("readiness_path", "prestop_path"),
        ("liveness_path", "prestop_path"),
    ],
)
def test_health_endpoints_need_distinct_paths(first: str, second: str) -> None:
    message = one_line_error({first: "/same", second: "/same"}, {})
    flags = [_config.option(n).flag for n in (first, second)]
    assert (
        message == f"{flags[0]} and {flags[1]} are both '/same': each endpoint needs its own path"
    )
    message = one_line_error({first: "/same"}, {_config.option(second).env: "/same"})
    assert _config.option(second).env in message


def test_policy_errors_name_options() -> None:
    assert one_line_error({"min_wait": "5", "max_wait": "3"}, {}) == (
        "--min-wait (5) must not exceed --max-wait (3)"
    )
    message = one_line_error({"policy": "refuse-immediately"}, {"GRACEFUL_IDLE": "3"})
    assert "GRACEFUL_IDLE" in message
    assert "refuse-immediately" in message
    assert "idle_s" not in message


def test_unknown_policy_lists_the_policies() -> None:
    message = one_line_error({"policy": "drain-slowly"}, {})
    assert message.startswith("--policy: unknown policy 'drain-slowly'; expected one of ")
    assert all(name in message for name in POLICIES)


# ---------------------------------------------------------------- where they go


def parameters(target: str) -> set[str]:
    import uvicorn

    from graceful.asgi import GracefulMiddleware

    function = {
        "policy": graceful.policy_from_name,
        "coordinator": graceful.ShutdownCoordinator.__init__,
        "middleware": GracefulMiddleware.__init__,
        "uvicorn": uvicorn.Config.__init__,
    }[target]
    return set(inspect.signature(function).parameters)


@pytest.mark.parametrize("opt", [o for o in OPTIONS if o.target != "run"], ids=lambda o: o.flag)
def test_every_option_reaches_its_target(opt: Option) -> None:
    assert opt.keyword in parameters(opt.target)


def test_keyword_arguments_come_from_values() -> None:
    values = _config.resolve(
        {"idle": "3", "drain_timeout": "20", "prestop_path": "/stop", "http": "h11"},
        {"GRACEFUL_WEBSOCKET_CLOSE_GRACE": "0.5"},
    )
    coordinator = _config.coordinator_kwargs(values, hard_exit=True)
    assert coordinator["policy"] == graceful.AcceptUntilIdle(idle_s=3)
    assert (coordinator["drain_timeout_s"], coordinator["hard_exit"]) == (20.0, True)
    assert _config.middleware_kwargs(values) == {
        "readiness_path": "/readyz",
        "liveness_path": "/livez",
        "prestop_path": "/stop",
        "metrics_path": None,
        "websocket_close_grace_s": 0.5,
        "readiness_on_shutdown": "fail",
        "management_port": None,
        "health_on_app_port": False,
    }
    assert _config.uvicorn_kwargs(values)["http"] == "h11"
    # With a management port, its address is the app's unless given.
    values = _config.resolve({"management_port": "9100", "host": "0.0.0.0"}, {})
    kwargs = _config.middleware_kwargs(values)
    assert (kwargs["management_port"], kwargs["management_host"]) == (9100, "0.0.0.0")


def test_build_server_uses_every_value() -> None:
    import uvicorn

    values = _config.resolve({"policy": "serve-until-killed", "kill_margin": "2"}, {})
    from graceful.uvicorn import build_server

    server = build_server(values, uvicorn.Config("examples.asgi_app:app"), hard_exit=True)
    assert server.coordinator.policy == graceful.ServeUntilKilled()
    assert (server.coordinator.kill_margin_s, server.coordinator.hard_exit) == (2.0, True)


# ------------------------------------------------------------------------ help


def test_help_shows_real_defaults() -> None:
    text = " ".join(_run.help_text().split())
    assert "[default: 2 with accept-until-idle; env GRACEFUL_IDLE]" in text
    assert "default: 30 with accept-until-idle, none with serve-until-killed" in text
    for opt in OPTIONS:
        assert f"[default: {_config.help_default(opt)}; env {opt.env}]" in text, opt.flag
    assert "default None" not in text


def test_every_policy_is_explained_in_the_help() -> None:
    text = _run.help_text()
    assert set(_run.POLICY_HELP) == set(POLICIES)
    assert all(re.search(rf"^  {name}: ", text, re.M) for name in _run.POLICY_HELP)


# ------------------------------------------------------------------- gunicorn


def gunicorn_values(
    graceful_timeout: float, environ: dict[str, str]
) -> tuple[_config.Values, list[str]]:
    pytest.importorskip("gunicorn")
    from graceful._options import gunicorn_values as _values

    warnings: list[str] = []
    return _values(graceful_timeout, environ, warnings.append), warnings


def test_gunicorn_graceful_timeout_is_the_grace_period() -> None:
    values, warnings = gunicorn_values(30, {"GRACEFUL_GRACE_PERIOD": "10", "GRACEFUL_IDLE": "1"})
    assert (values["grace_period"], values["idle"]) == (30.0, 1.0)
    assert warnings == [
        "graceful: GRACEFUL_GRACE_PERIOD is ignored under gunicorn (use --graceful-timeout)"
    ]


def test_gunicorn_short_graceful_timeout_shrinks_the_default_margin() -> None:
    values, warnings = gunicorn_values(1, {})
    assert (values["grace_period"], values["kill_margin"]) == (1.0, 0.1)
    assert len(warnings) == 1
    assert "the kill margin is 0.1 s" in warnings[0]
    values, warnings = gunicorn_values(4, {})  # a tenth of it, quietly
    assert (values["kill_margin"], warnings) == (0.4, [])
    values, warnings = gunicorn_values(30, {})
    assert (values["kill_margin"], warnings) == (1.0, [])


def test_gunicorn_explicit_margin_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^--graceful-timeout \(1 s\) must be greater than "):
        gunicorn_values(1, {"GRACEFUL_KILL_MARGIN": "1"})
    with pytest.raises(ConfigError, match=r"^--graceful-timeout 0 leaves no time"):
        gunicorn_values(0, {})


def test_gunicorn_ignores_the_settings_it_owns_even_when_bad() -> None:
    values, warnings = gunicorn_values(30, {"GRACEFUL_PORT": "abc", "GRACEFUL_HTTP": "h11"})
    assert values["port"] == 8000
    assert [w.split(" is ")[0] for w in warnings] == [
        "graceful: GRACEFUL_PORT",
        "graceful: GRACEFUL_HTTP",
    ]


def test_the_reference_documents_every_option() -> None:
    from pathlib import Path

    # The option table is generated from OPTIONS (tools/gen_configuration.py).
    reference = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    rows = {
        line.split("`")[1].split()[0]: line
        for line in reference.splitlines()
        if line.startswith("| `--")
    }
    for opt in OPTIONS:
        row = rows.get(opt.flag, "")
        assert f"`{opt.env}`" in row, opt.flag
        assert f"| {_config.help_default(opt)} |" in row, opt.flag


# ------------------------------------------------------- graceful run's command line


def test_uvicorn_options_come_from_uvicorns_own_command() -> None:
    from uvicorn.main import main as uvicorn_main

    names = {p.name for p in _run.build_command().params}
    theirs = {p.name for p in uvicorn_main.params if p.name not in ("app", "version")}
    assert theirs <= names  # a new uvicorn option appears by itself
    assert set(_run.shared_options()) >= {"host", "port", "workers", "loop", "log_level"}
    flags = [f for p in _run.build_command().params for f in getattr(p, "opts", [])]
    assert len(flags) == len(set(flags))  # nothing declared twice


def test_timeout_graceful_shutdown_is_the_drain_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = _run.parse(["m:app", "--timeout-graceful-shutdown", "7"], {})
    assert (inv.values["drain_timeout"], inv.values.label("drain_timeout")) == (
        7.0,
        "--timeout-graceful-shutdown",
    )
    assert _run.uvicorn_config(inv).timeout_graceful_shutdown is None
    # uvicorn's variables are read by click, from the process's environment.
    monkeypatch.setenv("UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN", "8")
    inv = _run.parse(["m:app"], {"UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN": "8"})
    assert (inv.values["drain_timeout"], inv.values.label("drain_timeout")) == (
        8.0,
        "UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN",
    )
    inv = _run.parse(
        ["m:app"], {"UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN": "8", "GRACEFUL_DRAIN_TIMEOUT": "9"}
    )
    assert inv.values["drain_timeout"] == 9.0


def test_shared_options_read_uvicorn_variables_after_ours() -> None:
    assert _run.parse(["m:app"], {"UVICORN_PORT": "9001"}).values["port"] == 9001
    inv = _run.parse(["m:app"], {"UVICORN_PORT": "9001", "GRACEFUL_PORT": "9002"})
    assert inv.values["port"] == 9002
    assert _run.parse(["m:app", "--port", "9003"], {"UVICORN_PORT": "9001"}).values["port"] == 9003


def test_uvicorn_config_takes_uvicorns_options_then_ours() -> None:
    inv = _run.parse(
        ["m:app", "--root-path", "/api", "--header", "x-a: 1", "--no-access-log",
         "--limit-concurrency", "5", "--http", "h11", "--port", "9000"],
        {},
    )  # fmt: skip
    config = _run.uvicorn_config(inv)
    assert (config.root_path, config.access_log, config.limit_concurrency) == ("/api", False, 5)
    assert (config.http, config.port) == ("h11", 9000)
    assert ("x-a", " 1") in [tuple(h) for h in config.headers] or (b"x-a", b" 1") in config.headers


def test_hypercorn_config_maps_the_options_that_apply() -> None:
    pytest.importorskip("hypercorn")
    inv = _run.parse(
        ["m:app", "--server", "hypercorn", "--loop", "trio", "--root-path", "/api",
         "--timeout-keep-alive", "7", "--backlog", "50", "--no-access-log", "--host", "::1"],
        {},
    )  # fmt: skip
    config = _run.hypercorn_config(inv)
    assert (config.worker_class, config.root_path, config.backlog) == ("trio", "/api", 50)
    assert (config.keep_alive_timeout, config.accesslog, config.bind) == (7.0, None, ["[::1]:8000"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server", "hypercorn", "--limit-concurrency", "3"],
         "--limit-concurrency is not taken by --server hypercorn"),
        (["--server", "aiohttp", "--http", "h11"], "--http is not taken by --server aiohttp"),
        (["--loop", "trio"], "--loop trio needs --server hypercorn"),
        (["--server", "aiohttp", "--loop", "zuvloop"],
         "--loop zuvloop is not taken by --server aiohttp (it takes auto, asyncio, uvloop)"),
        (["--server", "hypercorn", "--loop", "m:factory"],
         "--loop m:factory is not taken by --server hypercorn"),
        (["--http", "nope"], "--http: must be one of auto, h11, httptools"),
        (["--loop", "a b:c"], "--loop: must be one of "),
    ],
)  # fmt: skip
def test_options_a_server_does_not_take_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        _run.parse(["m:app", *args], {})


def test_every_uvicorn_choice_passes_through() -> None:
    """``--http`` and ``--loop`` take what the installed uvicorn takes: its names
    (read from uvicorn, so a name a new uvicorn adds works) and import strings."""
    from uvicorn import config

    for name in config.HTTP_PROTOCOLS:
        assert _run.parse(["m:app", "--http", name], {}).values["http"] == name
    for name in config.LOOP_FACTORIES:
        assert _run.parse(["m:app", "--loop", name], {}).values["loop"] == name
    inv = _run.parse(["m:app", "--loop", "mypkg.loops:factory", "--http", "p.q:Proto"], {})
    assert (inv.values["loop"], inv.values["http"]) == ("mypkg.loops:factory", "p.q:Proto")
    assert _run.uvicorn_config(inv).loop == "mypkg.loops:factory"


def test_unknown_variables_name_the_closest_option() -> None:
    environ = {
        "GRACEFUL_IDEL": "3", "GRACEFUL_XYZZY": "1", "GRACEFUL_IDLE": "2",
        "GRACEFUL_DEMO_NAME": "x", "OTHER_IDEL": "3",
    }  # fmt: skip
    assert _config.unknown_variables(environ) == [
        "GRACEFUL_IDEL is not a graceful option and is ignored (did you mean GRACEFUL_IDLE?)",
        "GRACEFUL_XYZZY is not a graceful option and is ignored (see graceful run --help)",
    ]
