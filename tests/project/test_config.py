"""Settings from SHEPHERD_* variables: defaults, overrides, secrets, and clear errors."""

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

import bmdb
from shepherd import config
from shepherd.config import Settings, SettingsError


def test_defaults_are_embedded():
    settings = Settings.from_env({})
    assert settings.bmdb_url.startswith("sqlite:///")
    assert settings.provider == "simulator"
    assert settings.thresholds == bmdb.Thresholds(first_heartbeat=1800, heartbeat=600)


def test_environment_overrides():
    settings = Settings.from_env({
        "SHEPHERD_BATCH_SIZE": "7",
        "SHEPHERD_HEARTBEAT_TIMEOUT": "3.5",
        "SHEPHERD_AGENT_START_BACKOFF": "1,5,2",
    })
    assert settings.batch_size == 7
    assert settings.thresholds.heartbeat == 3.5
    assert settings.agent_start_backoff == bmdb.Backoff(1, 5, 2)


def test_secret_from_file_stays_out_of_repr(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cr3t-token\n")
    settings = Settings.from_env({"SHEPHERD_PROVIDER_TOKEN_FILE": str(secret)})
    assert settings.provider_token == "s3cr3t-token"
    assert "s3cr3t" not in repr(settings)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("SHEPHERD_BATCH_SIZE", "many", "SHEPHERD_BATCH_SIZE='many' is not a whole number"),
    ("SHEPHERD_BOOT_WAIT", "-1", "must not be negative"),
    ("SHEPHERD_RECOVERY_BACKOFF", "60", "expected initial,maximum,exponent"),
    ("SHEPHERD_PROVIDER_TOKEN_FILE", "/nonexistent/token", "No such file"),
    ("SHEPHERD_BATCH_SIZE", "0", "SHEPHERD_BATCH_SIZE='0' must be at least 1"),
    ("SHEPHERD_IN_FLIGHT_CAP", "-3", "must be at least 0"),
    ("SHEPHERD_PROVIDER_SSH_PORT", "70000", "at least 1 and at most 65535"),
    ("SHEPHERD_SESSION_INTERVAL", "0.5", "must be at least 1"),
    ("SHEPHERD_DISPATCH_TTL", "0", "must be at least 1"),
    ("SHEPHERD_HEARTBEAT_TIMEOUT", "nan", "must be a finite number"),
    ("SHEPHERD_SOURCE_INTERVAL", "inf", "must be a finite number"),
    ("SHEPHERD_BMDB_POOL_SIZE", "0", "SHEPHERD_BMDB_POOL_SIZE='0' must be at least 1"),
    ("SHEPHERD_SERVE_LISTEN", "8470", "SHEPHERD_SERVE_LISTEN='8470': expected host:port"),
    ("SHEPHERD_SERVE_LISTEN", "", "SHEPHERD_SERVE_LISTEN='': expected host:port"),
    ("SHEPHERD_SERVE_LISTEN", "127.0.0.1:99999", "SHEPHERD_SERVE_LISTEN='127.0.0.1:99999'"),
    ("SHEPHERD_SERVE_OPERATOR_LISTEN", "localhost", "SHEPHERD_SERVE_OPERATOR_LISTEN="),
    ("SHEPHERD_SERVE_MAX_BODY", "big", "SHEPHERD_SERVE_MAX_BODY='big' is not a whole number"),
    ("SHEPHERD_SERVE_CLOCK_WINDOW", "nan", "SHEPHERD_SERVE_CLOCK_WINDOW='nan' must be a fin"),
    ("SHEPHERD_SERVE_OPERATOR_VIEWS", "maybe", "SHEPHERD_SERVE_OPERATOR_VIEWS='maybe' is not"),
    ("SHEPHERD_SERVE_THREADS", "0", "SHEPHERD_SERVE_THREADS='0' must be at least 1"),
    ("SHEPHERD_RECONCILE_WAIT", "-1", "SHEPHERD_RECONCILE_WAIT='-1' must not be negative"),
    ("SHEPHERD_WORKER_METRICS_PORT", "70000", "SHEPHERD_WORKER_METRICS_PORT='70000' must be"),
    ("SHEPHERD_WORKER_METRICS_PORT", "http", "SHEPHERD_WORKER_METRICS_PORT='http' is not"),
    # kombu would read 'hun' as the port and quote it in its error (redaction, issue 13).
    ("SHEPHERD_BROKER_URL", "redis://:hun/ter2@redis:6379/0",
     r"^SHEPHERD_BROKER_URL='redis://\*\*\*@redis:6379/0': its user info holds '/'"),
    ("SHEPHERD_RESULT_BACKEND", "redis://u:hun@ter2@redis/1",
     r"^SHEPHERD_RESULT_BACKEND='redis://\*\*\*@redis/1': its user info holds '@'"),
])
def test_bad_values_name_the_variable(name, value, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({name: value})


def test_server_worker_and_pool_settings():
    defaults = Settings.from_env({})
    assert (defaults.bmdb_pool_size, defaults.serve_listen, defaults.serve_operator_listen,
            defaults.serve_max_body, defaults.serve_clock_window, defaults.serve_threads,
            defaults.serve_operator_views, defaults.reconcile_wait,
            defaults.worker_metrics_port, defaults.prometheus_multiproc_dir) == (
        5, "127.0.0.1:8470", "", 256 * 1024, 60.0, 2, True, 300.0, 0, "")
    settings = Settings.from_env({
        "SHEPHERD_BMDB_POOL_SIZE": "12", "SHEPHERD_SERVE_LISTEN": "[::1]:9000",
        "SHEPHERD_SERVE_OPERATOR_LISTEN": ":9001", "SHEPHERD_SERVE_TLS_CERT": "c.pem",
        "SHEPHERD_SERVE_TLS_KEY": "k.pem", "SHEPHERD_SERVE_MAX_BODY": "1000",
        "SHEPHERD_SERVE_CLOCK_WINDOW": "5", "SHEPHERD_SERVE_OPERATOR_VIEWS": "off",
        "SHEPHERD_SERVE_THREADS": "9", "SHEPHERD_RECONCILE_WAIT": "12.5",
        "SHEPHERD_WORKER_METRICS_PORT": "9101", "SHEPHERD_WORKER_METRICS_ADDR": "0.0.0.0",
        "PROMETHEUS_MULTIPROC_DIR": "/run/prom",
    })
    assert settings.bmdb_pool_size == 12
    assert config.parse_listen(settings.serve_listen) == ("::1", 9000)
    assert config.parse_listen(settings.serve_operator_listen) == ("0.0.0.0", 9001)
    assert (settings.serve_tls_cert, settings.serve_tls_key) == ("c.pem", "k.pem")
    assert (settings.serve_max_body, settings.serve_clock_window, settings.serve_threads,
            settings.serve_operator_views) == (1000, 5.0, 9, False)
    assert settings.reconcile_wait == 12.5
    assert (settings.worker_metrics_port, settings.worker_metrics_addr,
            settings.prometheus_multiproc_dir) == (9101, "0.0.0.0", "/run/prom")


def test_server_limit_settings():
    """The callback server's limits (shepherd.server.limits): defaults, and each read."""
    d = Settings.from_env({})
    assert (d.serve_max_headers, d.serve_max_header_bytes, d.serve_header_timeout,
            d.serve_body_timeout, d.serve_max_connections, d.serve_backlog,
            d.serve_tls_handshake_timeout, d.serve_idle_timeout, d.metrics_cache) == (
        100, 16384, 10.0, 10.0, 1000, 2048, 10.0, 5.0, 10.0)
    s = Settings.from_env({
        "SHEPHERD_SERVE_MAX_HEADERS": "20", "SHEPHERD_SERVE_MAX_HEADER_BYTES": "4096",
        "SHEPHERD_SERVE_HEADER_TIMEOUT": "3", "SHEPHERD_SERVE_BODY_TIMEOUT": "4",
        "SHEPHERD_SERVE_MAX_CONNECTIONS": "50", "SHEPHERD_SERVE_BACKLOG": "4096",
        "SHEPHERD_SERVE_TLS_HANDSHAKE_TIMEOUT": "2.5", "SHEPHERD_SERVE_IDLE_TIMEOUT": "1",
        "SHEPHERD_METRICS_CACHE": "0"})
    assert (s.serve_max_headers, s.serve_max_header_bytes, s.serve_header_timeout,
            s.serve_body_timeout, s.serve_max_connections, s.serve_backlog,
            s.serve_tls_handshake_timeout, s.serve_idle_timeout, s.metrics_cache) == (
        20, 4096, 3.0, 4.0, 50, 4096, 2.5, 1.0, 0.0)
    for name, value in (("SERVE_HEADER_TIMEOUT", "0"), ("SERVE_MAX_CONNECTIONS", "0"),
                        ("SERVE_MAX_HEADER_BYTES", "100"), ("METRICS_CACHE", "-1")):
        with pytest.raises(SettingsError, match=f"SHEPHERD_{name}="):
            Settings.from_env({f"SHEPHERD_{name}": value})


def test_environ_is_a_copy(monkeypatch):
    monkeypatch.setenv("SHEPHERD_BATCH_SIZE", "3")
    copied = config.environ()
    assert copied["SHEPHERD_BATCH_SIZE"] == "3"
    copied["SHEPHERD_BATCH_SIZE"] = "4"
    assert Settings.from_env().batch_size == 3


# -- the declaration: each setting said once -------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- settings table: begin -->\n(.*?)<!-- settings table: end -->",
                   re.DOTALL)


def test_the_readme_table_is_the_declaration() -> None:
    found = TABLE.search((ROOT / "README.md").read_text())
    assert found, "README.md has no settings table between its markers"
    assert found.group(1) == config.settings_table(), (
        "regenerate README's table: python -c 'from shepherd.config import "
        "settings_table; print(settings_table())'")


def test_every_default_has_its_fields_type() -> None:
    """The kind of a setting follows from its default's type: ``setting(300, ...)`` on a
    float field would parse '2.5' as a whole number and refuse it."""
    hints = typing.get_type_hints(Settings)
    wrong = {}
    for declared in dataclasses.fields(Settings):
        expected = typing.get_origin(hints[declared.name]) or hints[declared.name]
        default = declared.default
        if not isinstance(default, expected) or (
                expected in (bool, int, float) and type(default) is not expected):
            wrong[declared.name] = type(default).__name__
    assert wrong == {}


def test_every_variable_named_in_a_refusal() -> None:
    """A value no kind accepts (a NUL byte in a number, a listener, a URL...) is refused
    with its variable's name first; text settings take any value."""
    unnamed = {}
    for variable, name in config.variables().items():
        if variable.endswith("_FILE"):
            continue
        try:
            Settings.from_env({variable: "\0bad"})
        except SettingsError as error:
            if not str(error).startswith(f"{variable}="):
                unnamed[variable] = str(error)
        else:
            assert isinstance(getattr(Settings(), name), str | Path | tuple), variable
    assert unnamed == {}


@pytest.mark.parametrize(("old", "new", "field"), [
    ("SHEPHERD_BMAAS_ENDPOINT", "SHEPHERD_CALLBACK_URL", "callback_url"),
    ("SHEPHERD_BMAAS_CA_FILE", "SHEPHERD_CALLBACK_CA_FILE", "callback_ca_file"),
])
def test_former_names_are_read_and_the_new_one_wins(old: str, new: str, field: str) -> None:
    """Operators' environment files still say the former names."""
    assert getattr(Settings.from_env({old: "former"}), field) == "former"
    assert getattr(Settings.from_env({old: "former", new: "current"}), field) == "current"
    assert getattr(Settings.from_env({new: "current"}), field) == "current"


def test_a_secret_is_never_shown_nor_its_file_read_twice(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-the-file")
    settings = Settings.from_env({"SHEPHERD_PROVIDER_TOKEN_FILE": str(secret),
                                  "SHEPHERD_PROVIDER_TOKEN": "from-the-environment"})
    assert settings.provider_token == "from-the-file"
    assert "from-the" not in repr(settings) and "from-the" not in config.settings_table()


def test_the_cli_help_names_only_settings_that_exist() -> None:
    """A flag's help that says "default: SHEPHERD_X" goes stale when X is renamed (the
    CLI's API mode reads its few variables itself: ``shepherd.client_settings``)."""
    from shepherd import client_settings
    from shepherd.cli.arguments import parser
    from shepherd.server.serve import build_parser

    helps = _all_help(parser()) + _all_help(build_parser(Settings()))
    named = set(re.findall(r"\bSHEPHERD_[A-Z_]+[A-Z]", helps))
    known = set(config.variables()) | set(client_settings.VARIABLES)
    assert named and named - known == set()


def _all_help(parser: argparse.ArgumentParser) -> str:
    texts = [parser.description or ""]
    for action in parser._actions:
        texts.append(action.help or "")
        if isinstance(action, argparse._SubParsersAction):
            texts += [_all_help(sub) for sub in action.choices.values()]
    return "\n".join(texts)
