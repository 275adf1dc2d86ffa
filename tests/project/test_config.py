"""Settings from SHEPHERD_* variables: defaults, overrides, secrets, and clear errors."""

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
        5, "127.0.0.1:8470", "", 256 * 1024, 60.0, 16, True, 300.0, 0, "")
    settings = Settings.from_env({
        "SHEPHERD_BMDB_POOL_SIZE": "12", "SHEPHERD_SERVE_LISTEN": "[::1]:9000",
        "SHEPHERD_SERVE_OPERATOR_LISTEN": ":9001", "SHEPHERD_SERVE_TLS_CERT": "c.pem",
        "SHEPHERD_SERVE_TLS_KEY": "k.pem", "SHEPHERD_SERVE_MAX_BODY": "1000",
        "SHEPHERD_SERVE_CLOCK_WINDOW": "5", "SHEPHERD_SERVE_OPERATOR_VIEWS": "off",
        "SHEPHERD_SERVE_THREADS": "4", "SHEPHERD_RECONCILE_WAIT": "12.5",
        "SHEPHERD_WORKER_METRICS_PORT": "9101", "SHEPHERD_WORKER_METRICS_ADDR": "0.0.0.0",
        "PROMETHEUS_MULTIPROC_DIR": "/run/prom",
    })
    assert settings.bmdb_pool_size == 12
    assert config.parse_listen(settings.serve_listen) == ("::1", 9000)
    assert config.parse_listen(settings.serve_operator_listen) == ("0.0.0.0", 9001)
    assert (settings.serve_tls_cert, settings.serve_tls_key) == ("c.pem", "k.pem")
    assert (settings.serve_max_body, settings.serve_clock_window, settings.serve_threads,
            settings.serve_operator_views) == (1000, 5.0, 4, False)
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
