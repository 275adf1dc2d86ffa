"""What signing costs the machine: the agent's two Ed25519 paths, side by side.

Each path runs in a python3 of its own, importing the agent from the real bundle
(``agent_bundle()``, through zipimport, as on a machine): ``cryptography`` (the venv's
python3, which has it) and the bundled pure-Python ``ecdsa`` (``python3 -S``: the
standard library only, as on a stock machine). With ``--rootfs`` the same runs on a
stock system's own python3 too (a root filesystem of ``tests.support.minimal_systems``, e.g.
bullseye's Python 3.9), through chroot.

Per path: the one-off cost at takeover (import the agent and its Ed25519, make the
key, self-test), then per heartbeat what the agent does with Ed25519: sign the
request and verify the server's signed answer. The share of one core is that CPU
time over the heartbeat interval (``--interval``, 60 s: the default, a tenth of the
10-minute heartbeat timeout).

    .venv/bin/python -m bench.agent_signing [--rounds 500] [--interval 60]
        [--rootfs /var/cache/shepherd-tests/rootfs/bullseye-stock-...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from shepherd.agent import BUNDLE_NAME, agent_bundle

#: Run by each python3 under test, with the bundle's path and the rounds as arguments.
#: Python 3.9 syntax: it also runs on a stock bullseye's python3.
CHILD = r"""
import base64, json, sys, time
started = time.process_time()
sys.path.insert(0, sys.argv[1])
import shepherd_agent as agent
signing, _ = agent.ed25519()
key = signing.new_key()
ready = time.process_time() - started
rounds = int(sys.argv[2])
server = signing.new_key()  # stands in for the servers' answer key
verify = signing.verifier(server.public)
wire = agent.protocol
payload = wire.signing_payload("6b1c2e0a-8a9e-4f57-9d0e-2f3c4b5a6d7e", key.public,
                               "n" * 43, "POST", wire.HEARTBEAT_PATH, "1767225600.000000",
                               json.dumps({"machine_id": "x" * 36}).encode())
answer = wire.answer_payload("6b1c2e0a-8a9e-4f57-9d0e-2f3c4b5a6d7e", "1767225600.000000",
                             200, b"{}")
answer_signature = server.sign(answer)
start = time.process_time()
for _ in range(rounds):
    base64.b64encode(key.sign(payload))
signed = time.process_time()
for _ in range(rounds):
    verify(answer_signature, answer)
verified = time.process_time()
print(json.dumps({"implementation": signing.name, "python": sys.version.split()[0],
                  "takeover_s": ready, "sign_s": (signed - start) / rounds,
                  "verify_s": (verified - signed) / rounds}))
"""


class Measured(NamedTuple):
    """What CHILD printed, in seconds."""

    implementation: str
    python: str
    takeover_s: float
    sign_s: float
    verify_s: float

    @property
    def per_heartbeat(self) -> float:
        return self.sign_s + self.verify_s


def measure(argv: list[str], bundle: str, rounds: int) -> Measured:
    done = subprocess.run([*argv, "-c", CHILD, bundle, str(rounds)], capture_output=True,
                          text=True, timeout=600, check=True)
    return Measured(**json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--rootfs", type=Path, action="append", default=[],
                        help="a stock root filesystem whose python3 to measure too")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        bundle = Path(temporary) / BUNDLE_NAME
        bundle.write_bytes(agent_bundle())
        runs = [("this python3", [sys.executable], str(bundle)),
                ("this python3 -S", [sys.executable, "-S"], str(bundle))]
        for root in args.rootfs:
            inside = root / "tmp" / "shepherd-agent-bench.pyz"
            shutil.copyfile(bundle, inside)
            runs.append((f"{root.name} python3", ["chroot", str(root), "python3"],
                         "/tmp/shepherd-agent-bench.pyz"))
        try:
            results = [(label, measure(argv, path, args.rounds)) for label, argv, path in runs]
        finally:
            for root in args.rootfs:
                (root / "tmp" / "shepherd-agent-bench.pyz").unlink(missing_ok=True)
    report(results, args.interval)
    if args.json:
        args.json.write_text(json.dumps(as_json(results, args.interval), indent=1))


def as_json(results: list[tuple[str, Measured]], interval: float) -> dict[str, object]:
    """Each run's figures in seconds, and its share of one core at ``interval``."""
    return {"interval_s": interval, "runs": [
        {"run": label, **result._asdict(), "per_heartbeat_s": result.per_heartbeat,
         "core_share": result.per_heartbeat / interval} for label, result in results]}


def report(results: list[tuple[str, Measured]], interval: float) -> None:
    fastest = min(result.per_heartbeat for _, result in results)
    print(f"{'run':<52} {'Ed25519':<20} {'python':<7} {'takeover':>9} {'sign':>9} "
          f"{'verify':>9} {'x fast':>7} {'core share':>11}")
    for label, result in results:
        print(f"{label:<52} {result.implementation:<20} {result.python:<7} "
              f"{result.takeover_s * 1e3:>7.1f}ms {result.sign_s * 1e6:>7.0f}us "
              f"{result.verify_s * 1e6:>7.0f}us {result.per_heartbeat / fastest:>7.1f} "
              f"{result.per_heartbeat / interval:>11.6%}")
    print(f"core share: Ed25519 CPU per heartbeat (sign + verify) over a {interval:g} s "
          "interval")


if __name__ == "__main__":
    main()
