"""``shepherd inventory check FILE [--probe] [--json]``: is this inventory file right,
and (``--probe``) do its machines answer as it says?

Exit status: 2 the file is invalid (one line on stderr naming file, entry and field),
1 a probe failed (a BMC or SSH endpoint did not answer, showed another host key than
the pin, or manages another system than the machine's own DMI says), 0 otherwise.
Needs no BMDB: an operator checks a file before any shepherd uses it; with one, the
machines it knows have their BMC's system compared with their agent's DMI report.
Passwords are never read except by the BMC probe, and never shown.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import bmdb
from shepherd import operations, text_tables
from shepherd.cli.context import Context
from shepherd.inventory.fields import InventoryError
from shepherd.inventory.file import load_inventory, ssh_endpoint
from shepherd.inventory.host_keys import parse_host_key
from shepherd.inventory.probe import probe_machines
from shepherd.inventory.provider import NAME as STATIC_PROVIDER
from shepherd.operations import BadArgument
from shepherd.power import SystemIdentity
from shepherd.providers.base import ProviderMachine

EXIT_PROBE_FAILED = 1


def check(ctx: Context) -> int:
    path: Path = ctx.args.file
    try:
        machines = load_inventory(path)
    except InventoryError as error:
        raise BadArgument(str(error)) from None
    probes, note = None, None
    if ctx.args.probe:
        known, note = _known_identities(ctx, machines)
        probes = probe_machines(machines, timeout=ctx.args.timeout, known=known)
    failed = sum(not p.ok for p in probes or [])
    listed = [_machine(m) for m in machines]
    for row, found in zip(listed, probes or [], strict=False):
        row["probe"] = dataclasses.asdict(found) | {"ok": found.ok}
    document = {"file": str(path), "valid": True, "machines": listed}
    if probes is not None:
        document["probes_failed"] = failed
        document["identities"] = note or "compared where the BMDB knows the machine"
    ctx.emit(document, lambda: _text(path, machines, probes, failed, note))
    return EXIT_PROBE_FAILED if failed else 0


def _known_identities(ctx: Context, machines: list[ProviderMachine]
                      ) -> tuple[dict[str, SystemIdentity], str | None]:
    """The machines' own DMI identities from the BMDB, and a note when there are none to
    compare with: the check needs no BMDB, and says so rather than guessing."""
    ids = [m.provider_id for m in machines]
    try:
        known = ctx.db.read(lambda tx: operations.machine_identities(tx, STATIC_PROVIDER, ids))
    except (bmdb.BMDBError, BadArgument) as error:
        return {}, f"identities not compared: no BMDB to read them from ({error})"
    return known, None


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
          failed: int, note: str | None) -> str:
    headers = ["ID", "SSH", "USER", "PIN", "BMC"]
    rows: list[list[object]] = [
        [m.provider_id, ssh_endpoint(m), m.ssh_user, "yes" if m.host_key else "no",
         m.bmc.description if m.bmc else None] for m in machines]
    lines = [f"{path}: valid, {len(machines)} machine(s)"]
    problems: list[str] = []
    if probes is not None:
        headers += ["BMC SYSTEM", "POWER", "HOST KEY"]
        for row, found in zip(rows, probes, strict=True):
            row += [_identity(found), _power(found), _host_key(found)]
            problems += _problems(found)
    lines.append(text_tables.table(headers, rows, max_width=90))
    if probes is not None:
        lines.append(f"probes: {len(probes) - failed} machine(s) answered as listed, "
                     f"{failed} did not")
        lines += problems + ([note] if note else [])
    return "\n".join(lines)


def _power(found: Any) -> str | None:
    if found.bmc is None:
        return None
    return found.bmc.power if found.bmc.ok else "FAILED"


def _identity(found: Any) -> str | None:
    """The BMC's system against the machine's DMI, when compared (a mismatch shouts)."""
    verdict: str | None = found.identity
    return "MISMATCH" if verdict == "mismatch" else verdict


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
    if found.identity == "mismatch":
        lines.append(f"  {found.machine_id}: BMC MISMATCH: {found.identity_reason} (a "
                     "swapped inventory line? no BMC action will touch it)")
    return lines
