"""``shepherd serve``: the callback server (``shepherd.server.serve``) with the
operators' API (``api_server``) on its operators' routes.

Composed here, not in the server, because the API runs the CLI's own commands and the
server sits below the CLI (docs/ARCHITECTURE.md §2): the server takes the API as
routes built over its runtime, and knows nothing of what they run.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from shepherd.cli.api_server import Api
from shepherd.runtime import Runtime
from shepherd.server.pool import ApiPools
from shepherd.server.serve import main as serve_main
from shepherd.server.throttle import FailureThrottle


def operator_api(runtime: Runtime, pools: ApiPools, throttle: FailureThrottle
                 ) -> list[BaseRoute]:
    return Api(runtime, pools, throttle=throttle).routes()


def main(argv: list[str] | None = None) -> int:
    return serve_main(argv, operator_api=operator_api)


if __name__ == "__main__":
    raise SystemExit(main())
