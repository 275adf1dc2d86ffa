"""``shepherd up``: the whole control plane in the foreground (``shepherd.up``)."""

from __future__ import annotations

from shepherd import config
from shepherd.cli.context import Context
from shepherd.up import UpOptions, main


def up(ctx: Context) -> int:
    """Its children get this process's environment, with ``--bmdb-url`` over it."""
    args = ctx.args
    env = config.environ()
    if getattr(args, "bmdb_url", None):
        env["SHEPHERD_BMDB_URL"] = args.bmdb_url
    return main(UpOptions(
        workdir=args.workdir or ctx.settings.state_dir, machines=args.machines,
        serve_port=args.port, flower_port=args.flower_port,
        simulator_port=args.simulator_port, ssh_port=args.ssh_port,
        machine_concurrency=args.concurrency, progress_interval=args.progress_interval,
        flower=not args.no_flower, broker=args.broker, racks=args.racks,
        install=args.install, fresh=args.fresh), env)
