"""What operator commands print for people: tables and paragraphs from the operator's
views (``shepherd.operations``). Scripts get ``--json`` instead, so nothing here is parsed.

Pure functions of the views: no BMDB, no settings, so the wording can be read and
changed in one place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shepherd import operations, text_tables
from shepherd.operations.stored import printable


def fleet(c: Any, refusals: Sequence[Any] = (), stopped_up: Path | None = None,
          heartbeat_timeout: float = 0.0) -> str:
    """The counts as people read them: the fleet on one line, holds on the next, one
    row per process, then any reconcile refusal with what resolves it, and a note
    when the ``shepherd up`` they come from no longer runs (``stopped_up``)."""
    rows = [(process, c.backlog.get(process), work, c.active_backoffs.get(process, 0))
            for process, work in c.active_work.items()]
    held = "   ".join(f"{kind} {n}" for kind, n in c.held.items())
    lines = [
        f"machines {c.machines}   provided {c.provided}   agent started "
        f"{c.agent_started}   heartbeating {c.heartbeating}",
        f"held (in no backlog): {held or 'none'}", "",
        text_tables.table(["PROCESS", "BACKLOG", "WORK", "BACKOFFS"], rows),
        "(backlog: what a claim could take, held and backing-off machines excluded; "
        "the Recovery guard is not asked: `shepherd explain`)",
    ]
    lines += [f"RECONCILE REFUSING: {operations.refusal_text(r)}" for r in refusals]
    if stopped_up is not None:
        lines.append(f"note: shepherd up is not running on {stopped_up.resolve()}: nothing "
                     f"heartbeats or works now; 'heartbeating' counts machines heard in the "
                     f"last {heartbeat_timeout:g} s, so it falls to 0 as that passes")
    return "\n".join(lines)


def machines(found: Any, looks: dict[Any, Any], now: Any) -> str:
    """The list; POWER is the last reading with its age, and what the power and health
    sync found wrong with the BMC (``operations.power_shown``)."""
    counts = "  ".join(f"{tag}={n}" for tag, n in found.tag_counts.items())
    rows = [(m.id, m.provider, m.provider_id,
             operations.status_text(m.provider_status, m.provider), m.address,
             _power_cell(looks.get(m.id), m, now),
             [operations.short_tag(t) for t in m.tags], m.work, m.backoffs, m.holds)
            for m in found.machines]
    matched = f"~{found.matched} (estimated)" if found.matched_estimated else found.matched
    shown = (f"{len(found.machines)} of {matched} matching" if
             found.next_cursor or found.matched_estimated else f"{matched} matching")
    lines = [
        f"fleet: {found.total} machines  {counts}",
        text_tables.table(["MACHINE", "PROVIDER", "PROVIDER ID", "STATUS", "ADDRESS", "POWER",
                           "TAGS", "WORK", "BACKOFF", "HELD"], rows),
        f"({shown}; tags: {operations.TAG_LEGEND})",
    ]
    if found.next_cursor:
        lines.append(f"next page: add --after {found.next_cursor}")
    return "\n".join(lines)


def _power_cell(look: Any, m: Any, now: Any) -> str:
    if look is None:
        return "—"
    return str(operations.power_shown(look.power, m.provider, m.provider_status, now,
                                      look.bmc).text)


#: Causes are shown whole: they are the answer to "why", and a rung's cause cut at 80
#: characters ("ssh: ConnectionRefused: 127.10…") hid the address it failed at. The
#: bound only keeps a runaway provider message from flooding the terminal.
CAUSE_WIDTH = 2000


def show(d: Any) -> str:
    lines = [f"machine {d.id}  (created {text_tables.when(d.created_at)}; "
             f"BMDB time {text_tables.when(d.now)} UTC)"]
    lines += _holds(d.holds)
    lines += ["", "TAGS"]
    if not d.tags:
        lines.append("  (none)")
    for name, values in d.tags.items():
        shown = ", ".join(f"{k}={_value(v)}" for k, v in values.items()
                          if k not in ("agent_started", "heartbeat_seen"))
        lines.append(f"  {name}: {shown}")
        if name == "Provided" and values.get("provider_status") == "Missing":
            lines.append(f"    {operations.status_text('Missing', values.get('provider'))}: "
                         "left alone, never deleted")
    lines += ["", "INSTALLATION"]
    i = d.installation
    lines.append(f"  {i.state}: {i.text}" if i is not None else "  (none wanted)")
    lines += ["", "HOST KEY"]
    lines.append(f"  {d.host_key_origin}: {d.host_key_fingerprint}" if d.host_key
                 else "  none recorded (an inventory pin, if any, is in the file; else the "
                      "next takeover records one)")
    lines += ["", "POWER AND BMC", *_power(d)]
    lines += ["", "WORK"]
    if not d.work:
        lines.append("  (none)")
    for w in d.work:
        lines.append(f"  {w.process} work {w.id} since {text_tables.when(w.started_at)}")
        lines.append(f"    {session_line(w, d.now)}")
        if w.dispatch_deadline is not None:
            lines.append(f"    waiting to be adopted until {text_tables.when(w.dispatch_deadline)}")
    lines += ["", "BACKOFFS", _backoffs(d)]
    lines += ["", "HISTORY (newest first)"]
    if d.history:
        lines.append(text_tables.table(
            ["AT", "PROCESS", "EVENT", "SESSION", "CAUSE"],
            [(h["at"], h["process"], h["event"], h["session_id"], _safe(h["cause"]))
             for h in d.history], max_width=CAUSE_WIDTH))
    else:
        lines.append("  (none)")
    return "\n".join(lines)


def _power(d: Any) -> list[str]:
    """The last power reading or action, and the power and health sync's last read."""
    provided = d.tags.get("Provided") or {}
    shown = operations.power_shown(d.power, provided.get("provider"),
                                   provided.get("provider_status"), d.now)
    lines = [f"  power: {shown.text}" + (f" ({shown.title})" if shown.title else "")]
    if d.bmc is None:
        lines.append("  sync: never read (no BMC in the inventory, or not booked yet)")
    else:
        worry, story = operations.bmc_said(d.bmc, d.now)
        lines.append(f"  sync: {_safe(story)}")
        if worry:
            lines.append(f"  LOOK: {worry}")
    return lines


def _holds(holds: list[Any]) -> list[str]:
    """HELD lines: why the machine is in no backlog, and how to let it back."""
    return [f"HELD: {operations.hold_text(h)} — in no backlog; `{operations.lift_command(h)}`"
            for h in holds]


def _backoffs(d: Any) -> str:
    if not d.backoffs:
        return "  (none)"
    return text_tables.table(
        ["PROCESS", "UNTIL", "STATE", "INTERVAL", "CAUSE"],
        [(b.process, b.until, "active, " + text_tables.relative(b.until, d.now) if b.active
          else "expired", text_tables.duration(b.interval_s), _safe(b.cause)) for b in d.backoffs],
        max_width=CAUSE_WIDTH)


def _value(value: Any) -> str:
    """A tag's value on one terminal line. Documents (reports) come bounded from
    ``show_machine``; as JSON they are ASCII, their control characters escaped.
    Nothing (a machine of an inventory has no reservation) is ``-``, as in tables."""
    if value is None:
        return "-"
    if isinstance(value, bytes):
        return value.hex()[:16] + "…"
    if hasattr(value, "astimezone"):
        return text_tables.when(value)
    return json.dumps(value) if isinstance(value, dict | list) else printable(value)


def _safe(value: Any) -> Any:
    """Text from outside (a provider's error, say) with its control characters shown,
    not acted on by the terminal."""
    return printable(value) if isinstance(value, str) else value


def session_line(work: Any, now: Any) -> str:
    s = work.session
    if s is None:
        return f"session {work.session_id}: gone (the sweep releases this work)"
    state = (f"alive, deadline {text_tables.relative(s.deadline, now)}" if s.alive else
             f"DEAD since {text_tables.when(s.deadline)} (the sweep releases this work)")
    return f"session {s.id} ({s.component} on {s.holder}): {state}"


def explain(e: Any) -> str:
    lines = [f"machine {e.id}  tags: {', '.join(e.tags) or '(none)'}",
             f"BMDB time {text_tables.when(e.now)} UTC"]
    lines += _holds(e.holds)
    for p in e.processes:
        lines += ["", f"{p.process}: {p.verdict}"]
        lines.append(f"  backlog: {'yes' if p.in_backlog else 'no'} — {p.backlog}")
        if p.work is None:
            lines.append("  work:    none in its exclusion group")
        else:
            lines.append(f"  work:    {p.work.process} work {p.work.id} since "
                         f"{text_tables.when(p.work.started_at)}")
            lines.append(f"           {session_line(p.work, e.now)}")
        lines.append(f"  backoff: {_backoff_line(p.backoff, e.now)}")
        if p.guard:
            lines.append(f"  guard:   {_guard_line(p)}")
    return "\n".join(lines)


def _backoff_line(b: Any, now: Any) -> str:
    if b is None:
        return "none"
    if b.active:
        return (f"until {text_tables.when(b.until)} ({text_tables.relative(b.until, now)}) "
                f"after: {b.cause}")
    return f"expired at {text_tables.when(b.until)} (was: {b.cause})"


def _guard_line(p: Any) -> str:
    if p.paused:
        return f"PAUSED — {p.paused}"
    g = p.guard
    callback = (f"callback server {g['callback_server']} healthy" if g.get("callback_server")
                else "callback server not checked")
    return (f"not paused ({g['silent']} of {g['started']} started agents silent, max share "
            f"{g['max_share']:.0%}; {g['reboots_last_hour']} of {g['reboots_per_hour']} "
            f"reboots in the last hour; {callback})")


def sessions(now: Any, found: list[Any]) -> str:
    rows = [(s.id, s.component, s.holder, s.started_at, _deadline(s, now), s.work)
            for s in found]
    header = ["SESSION", "COMPONENT", "HOLDER", "STARTED", "DEADLINE", "WORK"]
    return text_tables.table(header, rows) + f"\n({len(found)} sessions)"


def _deadline(found: Any, now: Any) -> str:
    """When a live session's lease ends; a dead one's deadline, marked."""
    if found.alive:
        return text_tables.relative(found.deadline, now)
    return f"DEAD {text_tables.when(found.deadline)}"


def cleared(machine_id: Any, process: str, backoff: Any) -> str:
    if backoff is None:
        return f"machine {machine_id} had no {process} backoff"
    state = "active" if backoff.active else "already expired"
    return (f"cleared {process} backoff of machine {machine_id} ({state}, until "
            f"{text_tables.when(backoff.until)}, after: {backoff.cause})")


def swept(result: Any) -> str:
    return (f"sweep: {result.abandoned} work of dead sessions released (Abandoned), "
            f"{result.unadopted} claims nobody adopted cancelled, "
            f"{result.sessions_deleted} dead sessions deleted")


def hold_change(c: Any) -> str:
    """What ``maintenance on|off``, ``quarantine clear`` or ``bmc-mismatch clear`` did,
    and what still applies."""
    m = c.machine
    if c.action == "on":
        lines = [f"machine {m}: {'now' if c.changed else 'already'} "
                 f"{operations.hold_text(c.hold)}"]
    elif c.changed:
        lines = [f"machine {m}: out of {c.kind} (was: {operations.hold_text(c.hold)})"]
    else:
        was = operations.HOLD_STATE.get(c.kind, c.kind)
        lines = [f"machine {m} was not {was}; nothing changed"]
    others = [h for h in c.remaining if h.kind != c.kind or c.action == "on"]
    if c.action != "on" and others:
        lines += [f"  still held: {operations.hold_text(h)} (`{operations.lift_command(h)}`)"
                  for h in others]
    elif c.action != "on" and c.changed:
        lines.append("  back in the backlogs: AgentStart and Recovery may claim it again")
    for w in c.work:
        lines.append(f"  note: {w.process} work {w.id} holds it now; a hold stops new "
                     "claims, not work under way")
    if c.backoff is not None and c.action != "on":
        lines.append(f"  note: Recovery backoff until {text_tables.when(c.backoff.until)} "
                     f"(`shepherd clear-backoff {m} recovery` to retry sooner)")
    return "\n".join(lines)


def install_change(c: Any) -> str:
    """What ``install`` or ``install --cancel`` did, and what happens next."""
    m, wanted = c.machine, c.installation.wanted
    if c.action == "cancel":
        if not c.changed:
            return f"machine {m}: no installation was pending; nothing changed"
        lines = [f"machine {m}: installation of {wanted.image} withdrawn"]
        lines += [f"  note: {w.process} work {w.id} holds it now: it stops at its next look, "
                  "and a disk it began writing is left undefined" for w in c.work]
        return "\n".join(lines)
    lines = [f"machine {m}: install {wanted.image} on disk {wanted.disk} (asked by "
             f"{wanted.requested_by}: {wanted.reason})",
             "  next: dispatched to its agent once it heartbeats (`shepherd explain "
             f"{m}` says why it waits)"]
    lines += [f"  note: {w.process} work {w.id} holds it now; the installation waits for it"
              for w in c.work]
    return "\n".join(lines)


def host_key_forgotten(f: Any) -> str:
    if f.host_key is None:
        return (f"machine {f.machine} had no recorded host key; nothing changed (the next "
                "takeover records the key it meets)")
    return (f"machine {f.machine}: forgot host key {f.fingerprint}; the next takeover "
            "records the key it meets (trust on first use)")


def host_key_accepted(a: Any) -> str:
    replaced = f" in place of {a.replaced}" if a.replaced else ""
    lines = [f"machine {a.machine}: host key {a.fingerprint} pinned{replaced}; the host-key "
             "hold is lifted and its backoffs cleared: the next AgentStart or Recovery takes "
             "the machine over"]
    if a.remaining:
        kinds = ", ".join(h.kind for h in a.remaining)
        lines.append(f"still held ({kinds}): nothing automatic touches it until that is lifted")
    return "\n".join(lines)


def ssh_key(k: dict[str, str]) -> str:
    return "\n".join([
        f"private key: {k['private_key']}",
        f"public key:  {k['public_key']}",
        "add this line to ~/.ssh/authorized_keys of each machine's SSH user "
        "(inventory ssh_user, default root):",
        k["authorized_keys"],
    ])


def power_status(s: Any) -> str:
    return (f"machine {s.machine} ({s.provider} {s.provider_id}): power {s.power} "
            f"(via {s.bmc})")


def power_result(r: Any) -> str:
    lines = [f"machine {r.machine}: power {r.command} verified after {r.seconds:.1f}s, "
             f"power {r.power} (via {r.bmc}): {r.detail}",
             f"  work {r.work}; history: Power, Finished"]
    if r.command in ("off", "cycle") and not r.holds:
        lines.append(f"  note: not in maintenance: if it runs an agent, Recovery powers it "
                     f"back once the agent falls silent (`shepherd maintenance on {r.machine} "
                     "--reason ...` first to keep it off)")
    return "\n".join(lines)
