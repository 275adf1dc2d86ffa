"""Settings from SHEPHERD_* variables: defaults, overrides, secrets, and clear errors."""

import pytest

import bmdb
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
    ("SHEPHERD_REBOOT_WAIT", "-1", "must not be negative"),
    ("SHEPHERD_RECOVERY_BACKOFF", "60", "expected initial,maximum,exponent"),
    ("SHEPHERD_PROVIDER_TOKEN_FILE", "/nonexistent/token", "No such file"),
    ("SHEPHERD_BATCH_SIZE", "0", "SHEPHERD_BATCH_SIZE='0' must be at least 1"),
    ("SHEPHERD_IN_FLIGHT_CAP", "-3", "must be at least 0"),
    ("SHEPHERD_PROVIDER_SSH_PORT", "70000", "at least 1 and at most 65535"),
    ("SHEPHERD_SESSION_INTERVAL", "0.5", "must be at least 1"),
    ("SHEPHERD_DISPATCH_TTL", "0", "must be at least 1"),
    ("SHEPHERD_HEARTBEAT_TIMEOUT", "nan", "must be a finite number"),
    ("SHEPHERD_SOURCE_INTERVAL", "inf", "must be a finite number"),
])
def test_bad_values_name_the_variable(name, value, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({name: value})
