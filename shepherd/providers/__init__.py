"""Providers: where machines come from (Equinix Metal, a static inventory, the simulator).

Workflows depend only on ``Provider`` and the dataclasses and errors in ``base``.
"""

from shepherd.providers.base import (
    CallObserver,
    Capacity,
    ConfigError,
    NotFound,
    NotSupported,
    PermanentError,
    Provider,
    ProviderError,
    ProviderMachine,
    RaceLost,
    TransientExhausted,
    no_observer,
    register_provided,
)

__all__ = [
    "CallObserver",
    "Capacity",
    "ConfigError",
    "NotFound",
    "NotSupported",
    "PermanentError",
    "Provider",
    "ProviderError",
    "ProviderMachine",
    "RaceLost",
    "TransientExhausted",
    "no_observer",
    "register_provided",
]
