"""``shepherd up`` as a user runs it: a subprocess in a fresh working directory on the
embedded defaults (SQLite BMDB, SQLite broker, the simulator), until every machine
heartbeats; then Ctrl-C (SIGINT) must stop everything it started."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

import bmdb
from shepherd import state_env
from shepherd.agent import identity
from shepherd.agent.identity import find_debugfs
from shepherd.config import Settings
from shepherd.images import Catalog
from shepherd.os_processes import kill_marked
from shepherd.providers import ssh_keys
from shepherd.runtime import build_provider, check_settings
from shepherd.simulator import Simulator, demo_image
from shepherd.simulator.racks import Racks
from shepherd.up import RUN_MARKER, SIM_SANDBOX, Plan, UpError, UpOptions, plan, racks
from tests.support.up_fixtures import FAST, THRESHOLDS, leftovers, user_env
from tests.support.workers import RACK_DEVICES

MACHINES = 5



def second_terminal(up: Plan, directory: Path) -> Settings:
    """The settings a second terminal reads from what this plan hands over."""
    state_env.write(directory, up.env, "written by a test")
    assert (directory / state_env.FILE_NAME).stat().st_mode & 0o777 == 0o600
    return Settings.from_env(state_env.environment(
        {"SHEPHERD_STATE_DIR": str(directory)}))


def test_a_real_provider_needs_an_endpoint_machines_can_reach(tmp_path: Path) -> None:
    real = {"SHEPHERD_PROVIDER": "equinix", "SHEPHERD_PROVIDER_URL": "https://metal.test/v1"}
    with pytest.raises(UpError, match="SHEPHERD_CALLBACK_URL"):
        plan(UpOptions(workdir=tmp_path), real)


def test_agents_listen_where_asked_and_the_view_stays_on_loopback(tmp_path: Path) -> None:
    up = plan(UpOptions(workdir=tmp_path, serve_port=8470), {
        "SHEPHERD_PROVIDER": "equinix", "SHEPHERD_PROVIDER_URL": "https://metal.test/v1",
        "SHEPHERD_SERVE_LISTEN": "0.0.0.0:8470",
        "SHEPHERD_CALLBACK_URL": "https://shepherd.example.net:8470"})
    env = up.env
    assert env["SHEPHERD_SERVE_LISTEN"] == "0.0.0.0:8470"
    view = env["SHEPHERD_SERVE_OPERATOR_LISTEN"]
    assert view.startswith("127.0.0.1:") and view != "127.0.0.1:8470"  # 8470 is the agents'
    assert up.urls["web"] == f"http://{view}"
    assert env["SHEPHERD_CALLBACK_URL"] == "https://shepherd.example.net:8470"


def test_on_the_simulator_everything_is_on_loopback(tmp_path: Path) -> None:
    up = plan(UpOptions(workdir=tmp_path, serve_port=8470), {})
    env = up.env
    assert env["SHEPHERD_SERVE_LISTEN"] == "127.0.0.1:8470"
    assert "SHEPHERD_SERVE_OPERATOR_LISTEN" not in env
    assert env["SHEPHERD_CALLBACK_URL"] == up.urls["web"] == "http://127.0.0.1:8470"
    assert second_terminal(up, tmp_path).heartbeat_timeout == 30


def test_racks_plan_a_static_provider_over_the_simulators_inventory(tmp_path: Path) -> None:
    up = plan(UpOptions(workdir=tmp_path, racks=True, machines=3, simulator_port=0,
                        ssh_port=0), {})
    env = up.env
    assert up.simulated and up.racks == tmp_path / "racks"
    assert up.inventory == tmp_path / "racks" / "inventory.toml"
    assert (env["SHEPHERD_PROVIDER"], env["SHEPHERD_STATIC_INVENTORY"]) == (
        "static", str(up.inventory))
    assert "SHEPHERD_PROVIDER_URL" not in env and "SHEPHERD_PROVIDER_TOKEN" not in env
    settings = Settings.from_env(env)
    check_settings(settings)
    assert settings.static_inventory == str(up.inventory)
    cli = second_terminal(up, tmp_path)
    assert (cli.provider, cli.static_inventory) == ("static", str(up.inventory))
    argv = racks.simulator_argv(up, 3)
    assert argv[argv.index("--racks") + 1] == str(up.racks)
    assert argv[argv.index("--reservations") + 1] == "3"
    assert argv[argv.index("--http-port") + 1] == str(up.simulator_port)
    assert argv[argv.index("--ssh-port") + 1] == str(up.ssh_port)
    with pytest.raises(UpError, match="--racks"):
        plan(UpOptions(workdir=tmp_path, racks=True), {
            "SHEPHERD_PROVIDER": "equinix", "SHEPHERD_PROVIDER_URL": "https://metal.test/v1"})


@pytest.mark.skipif(bool(demo_image.missing_tools()) or find_debugfs() is None,
                    reason="needs sfdisk, mke2fs and debugfs (fdisk, e2fsprogs)")
def test_racks_build_the_demo_image_and_may_ask_to_install_it(tmp_path: Path) -> None:
    up = plan(UpOptions(workdir=tmp_path, racks=True, machines=3, install=2,
                        simulator_port=0, ssh_port=0), {})
    assert up.image_dir == tmp_path / "images" and up.install == 2
    argv = racks.simulator_argv(up, 3)
    assert argv[argv.index("--install") + 1] == "demo"
    assert argv[argv.index("--install-machines") + 1] == "2"
    said: list[str] = []
    assert racks.prepare_demo_image(up, said.append)
    catalog = Catalog.load(up.image_dir)
    image = catalog.get("demo")
    assert image.file is not None and (up.image_dir / image.file).stat().st_size == image.size
    assert any("listed as 'demo'" in line for line in said), said
    assert second_terminal(up, tmp_path).image_dir == up.image_dir  # shepherd install's
    without = plan(UpOptions(workdir=tmp_path, racks=True, machines=3), {})
    assert "--install" not in racks.simulator_argv(without, 3)
    with pytest.raises(UpError, match="--racks"):
        plan(UpOptions(workdir=tmp_path, install=1), {})
    with pytest.raises(UpError, match="--install 4"):
        plan(UpOptions(workdir=tmp_path, racks=True, machines=3, install=4), {})


def test_without_the_tools_racks_run_and_only_install_refuses(tmp_path: Path,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sfdisk, mke2fs or debugfs anywhere
    monkeypatch.setattr(demo_image, "SBIN", ())
    monkeypatch.setattr(identity, "SBIN", ())
    said: list[str] = []
    up = plan(UpOptions(workdir=tmp_path, racks=True, machines=2), {})
    assert not racks.prepare_demo_image(up, said.append)
    assert said == ["racks: machines cannot be installed here: installing needs debugfs "
                    "(Debian package e2fsprogs): not found on PATH or in sbin"]
    asked = plan(UpOptions(workdir=tmp_path, racks=True, machines=2, install=1), {})
    with pytest.raises(UpError, match=r"^--install: installing needs debugfs"):
        racks.prepare_demo_image(asked, said.append)
    assert not (tmp_path / "images").exists()


@RACK_DEVICES
def test_racks_inventory_lists_each_machine_behind_its_bmc(tmp_path: Path) -> None:
    """What ``up --racks`` prepares, and the inventory the simulator then writes, read
    by the static provider the workers build (a real emulated BMC, no control plane)."""
    up = plan(UpOptions(workdir=tmp_path, racks=True, machines=2, simulator_port=0,
                        ssh_port=0), {})
    (tmp_path / "ssh").mkdir()
    (tmp_path / "racks").mkdir()
    (tmp_path / "racks" / "inventory.toml").write_text("stale")  # an earlier run's
    said: list[str] = []
    racks.prepare(up, said.append)
    assert up.racks is not None and up.inventory is not None
    assert not up.inventory.exists()
    fleet_key = ssh_keys.public_key_openssh(ssh_keys.load_or_create(
        up.env["SHEPHERD_SSH_KEY_PATH"]))
    authorized = up.racks / racks.AUTHORIZED_KEYS
    assert authorized.read_text() == fleet_key + "\n"
    token = up.racks / racks.TOKEN_FILE
    assert token.read_text().strip() == up.env["SHEPHERD_SIMULATOR_TOKEN"]
    assert {oct(p.stat().st_mode & 0o777) for p in (authorized, token)} == {"0o600"}

    sim = Simulator(reservations=2, token=up.env["SHEPHERD_SIMULATOR_TOKEN"],
                    ssh_port=up.ssh_port or 0, http_port=up.simulator_port or 0,
                    per_device_host_keys=True, workdir=tmp_path / "simulator")
    with sim, Racks(sim, up.racks, 2, authorized_keys=[fleet_key]) as rack:
        assert rack.bmc is not None
        provider = build_provider(Settings.from_env(up.env))
        machines = list(provider.list_machines())
        assert [m.provider_id for m in machines] == ["rack1-u01", "rack1-u02"]
        password = rack.password_path.read_text().strip()
        for machine in machines:
            device = sim.devices[machine.provider_id]
            assert (machine.address, machine.ssh_port) == (device.address, up.ssh_port)
            assert machine.ssh_user == "root"
            assert machine.host_key == sim.host_key_line(machine.provider_id)
            bmc = machine.bmc
            assert bmc is not None and bmc.driver == "redfish"
            assert bmc.address == rack.bmc.base_url
            assert bmc.system == rack.bmc.system_path(machine.provider_id)
            assert bmc.username == "admin" and bmc.read_password() == password
            system = requests.get(bmc.address + bmc.system, auth=(bmc.username, password),
                                  timeout=5)
            assert system.json()["PowerState"] == "On"
        assert password not in up.inventory.read_text()
        lines: list[str] = []
        racks.announce(up, lines.append)
        text = "\n".join(lines)
        assert f"2 machines listed in {up.inventory}" in text
        assert rack.bmc.base_url in text
        assert "/_admin/devices/rack1-u01/hang" in text and password not in text
        assert up.env["SHEPHERD_SIMULATOR_TOKEN"] not in text  # read from its file
        assert ("demo --disk device=/dev/sda --reason" in text
                and '$3 == "rack1-u01"' in text), text


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("broker", ["sqlite", "redis-server"])
def test_up_reaches_heartbeating_and_sigint_leaves_nothing(tmp_path: Path, broker: str) -> None:
    if broker == "redis-server" and shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    run_id = uuid.uuid4().hex
    workdir = tmp_path / "var"
    env = {**user_env(**FAST), RUN_MARKER: run_id}
    out = tmp_path / "up.out"
    argv = [sys.executable, "-m", "shepherd.cli", "up", "--workdir", str(workdir),
            "--machines", str(MACHINES), "--port", "0", "--flower-port", "0",
            "--simulator-port", "0", "--ssh-port", "0", "--progress-interval", "1",
            "--broker", broker]
    with open(out, "wb") as sink:
        up = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=sink,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        counts = None
        db = None
        while time.monotonic() < deadline:
            assert up.poll() is None, f"shepherd up exited {up.returncode}:\n" + \
                out.read_text(errors="replace")
            if db is None and (workdir / "logs" / "latest" / "beat.log").exists():
                db = bmdb.connect(f"sqlite:///{workdir / 'bmdb.sqlite'}",
                                  thresholds=THRESHOLDS)
            if db is not None:
                with contextlib.suppress(Exception):  # busy or not yet migrated
                    counts = db.read(lambda tx: bmdb.fleet_counts(tx, THRESHOLDS))
                if counts is not None and counts.heartbeating == MACHINES:
                    break
            time.sleep(1)
        if db is not None:
            db.close()
        text = out.read_text(errors="replace")
        assert counts is not None and counts.heartbeating == MACHINES, \
            f"not all heartbeating within 150 s; last {counts}\n{text}\n" + "\n".join(
                f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                for p in (workdir / "logs" / "latest").glob("*.log"))
        web = next(line.split()[2] for line in text.splitlines()
                   if line.startswith("web view:"))
        client = requests.Session()
        client.trust_env = False
        assert client.get(web.replace("/machines", "/healthz"), timeout=10).status_code == 200
        flower = next(line.split()[1] for line in text.splitlines()
                      if line.startswith("Flower:"))
        assert client.get(flower, timeout=10).status_code == 401  # basic auth on
        if broker == "redis-server":  # Flower sees the workers (not on the SQLite broker)
            user, password = (workdir / "flower-auth").read_text().strip().split(":", 1)
            workers = client.get(f"{flower}/api/workers?refresh=1", auth=(user, password),
                                 timeout=30)
            assert workers.status_code == 200
            assert {name.split("@")[0] for name in workers.json()} == {
                "control", "machines", "installations"}
            tasks: dict = {}
            for _ in range(20):  # task events reach Flower within a beat or two
                tasks = client.get(f"{flower}/api/tasks?limit=5", auth=(user, password),
                                   timeout=10).json()
                if tasks:
                    break
                time.sleep(0.5)
            assert tasks, "Flower saw no task events"
        assert "heartbeating" in text
        # Worker metrics: the control worker's main process serves what its pool
        # children counted (reconcile and update called the provider).
        worker_metrics = next(line.split()[-1] for line in text.splitlines()
                              if line.startswith("control worker metrics:"))
        scraped = client.get(worker_metrics, timeout=10)
        assert scraped.status_code == 200
        assert "shepherd_provider_api_calls_total{" in scraped.text
        server_metrics = client.get(web.replace("/machines", "/metrics"), timeout=10).text
        assert f"shepherd_fleet_heartbeating {float(MACHINES)}" in server_metrics
        assert "shepherd_recovery_paused 0.0" in server_metrics
        assert "shepherd_callback_server_healthy 1.0" in server_metrics
        assert leftovers(run_id, workdir), "the children should be found by their marker"

        started = time.monotonic()
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, out.read_text(errors="replace")
        took = time.monotonic() - started
        time.sleep(0.5)  # let anything orphaned show up in /proc
        assert leftovers(run_id, workdir) == []
        assert took < 60
        assert "stopping everything" in out.read_text(errors="replace")
    finally:
        if up.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
            up.wait(timeout=10)
        kill_marked(RUN_MARKER, run_id)
        kill_marked(SIM_SANDBOX, str(workdir / "simulator"), prefix=True)
