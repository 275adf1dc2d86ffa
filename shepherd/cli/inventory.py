"""``shepherd inventory check FILE [--probe] [--json]``: is this inventory file right,
and (``--probe``) do its machines answer as it says?

Exit status: 2 the file is invalid (one line on stderr naming file, entry and field),
1 a probe failed (a BMC or SSH endpoint did not answer, or showed another host key
than the pin), 0 otherwise. Needs no BMDB: an operator checks a file before any
shepherd uses it. Passwords are never read except by the BMC probe, and never shown.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shepherd import text_tables
from shepherd.cli.context import Context
from shepherd.inventory.fields import InventoryError
from shepherd.inventory.file import load_inventory, ssh_endpoint
from shepherd.inventory.host_keys import parse_host_key
from shepherd.inventory.probe import probe_machines
from shepherd.operations import BadArgument
from shepherd.providers.base import ProviderMachine

EXIT_PROBE_FAILED = 1


def check(ctx: Context) -> int:
    path: Path = ctx.args.file
    try:
        machines = load_inventory(path)
    except InventoryError as error:
        raise BadArgument(str(error)) from None
    probes = None
    if ctx.args.probe:
        probes = probe_machines(machines, timeout=ctx.args.timeout)
    failed = sum(not p.ok for p in probes or [])
    listed = [_machine(m) for m in machines]
    for row, found in zip(listed, probes or [], strict=False):
        row["probe"] = dataclasses.asdict(found) | {"ok": found.ok}
    document = {"file": str(path), "valid": True, "machines": listed}
    if probes is not None:
        document["probes_failed"] = failed
    ctx.emit(document, lambda: _text(path, machines, probes, failed))
    return EXIT_PROBE_FAILED if failed else 0


def _machine(machine: ProviderMachine) -> dict[str, Any]:
    """A machine as ``--json`` shows it: where the password is, never what it is."""
    bmc = None
    if machine.bmc is not None:
        bmc = dataclasses.asdict(machine.bmc) | {"description": machine.bmc.description}
    return {
        "id": machine.provider_id, "address": machine.address, "ssh_port": machine.ssh_port,
        "ssh_user": machine.ssh_user, "location": machine.location,
        "host_key": machine.host_key,
        "host_key_fingerprint": (parse_host_key(machine.host_key).fingerprint
                                 if machine.host_key else None),
        "bmc": bmc,
    }


def _text(path: Path, machines: list[ProviderMachine], probes: list[Any] | None,
          failed: int) -> str:
    headers = ["ID", "SSH", "USER", "PIN", "BMC"]
    rows: list[list[object]] = [
        [m.provider_id, ssh_endpoint(m), m.ssh_user, "yes" if m.host_key else "no",
         m.bmc.description if m.bmc else None] for m in machines]
    lines = [f"{path}: valid, {len(machines)} machine(s)"]
    problems: list[str] = []
    if probes is not None:
        headers += ["POWER", "HOST KEY"]
        for row, found in zip(rows, probes, strict=True):
            row += [_power(found), _host_key(found)]
            problems += _problems(found)
    lines.append(text_tables.table(headers, rows, max_width=90))
    if probes is not None:
        lines.append(f"probes: {len(probes) - failed} machine(s) answered as listed, "
                     f"{failed} did not")
        lines += problems
    return "\n".join(lines)


def _power(found: Any) -> str | None:
    if found.bmc is None:
        return None
    return found.bmc.power if found.bmc.ok else "FAILED"


def _host_key(found: Any) -> str:
    ssh = found.ssh
    if ssh.error is not None:
        return "FAILED"
    verdict = {None: "no pin", True: "matches pin", False: "PIN MISMATCH"}[ssh.matches]
    return f"{ssh.fingerprint} ({verdict})"


def _problems(found: Any) -> list[str]:
    """Full reasons, below the table: a table cell would cut them."""
    lines = []
    if found.bmc is not None and found.bmc.error is not None:
        lines.append(f"  {found.machine_id}: BMC: {found.bmc.error}")
    ssh = found.ssh
    if ssh.error is not None:
        lines.append(f"  {found.machine_id}: SSH: {ssh.error}")
    elif ssh.matches is False:
        lines.append(f"  {found.machine_id}: SSH: {ssh.endpoint} shows host key "
                     f"{ssh.fingerprint}, the inventory pins {ssh.pinned}")
    return lines
