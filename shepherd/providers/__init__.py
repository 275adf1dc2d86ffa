"""Providers: where machines come from (Equinix Metal, a static inventory, the simulator).

Workflows depend only on ``Provider`` and the dataclasses and errors in ``base``.
"""

from shepherd.providers.base import (
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
    register_provided,
)

__all__ = [
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
    "register_provided",
]
