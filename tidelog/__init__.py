"""tidelog: a replicated, partitioned commit log; SDK and code shared with the services.

The SDK: ``Producer`` (``tidelog.producer``), ``Consumer`` (``tidelog.consumer``) and
``Admin`` (``tidelog.admin``), each talking to a gateway; errors in ``tidelog.errors``.
Imports are lazy so ``import tidelog`` (and the services, which share this package) do not
load the SDK's dependencies until they are used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tidelog.admin import Admin
    from tidelog.consumer import Consumer, ConsumerRecord
    from tidelog.producer import Producer, RecordMetadata

_EXPORTS = {
    "Admin": "tidelog.admin",
    "Consumer": "tidelog.consumer",
    "ConsumerRecord": "tidelog.consumer",
    "Producer": "tidelog.producer",
    "RecordMetadata": "tidelog.producer",
}

__all__ = ["Admin", "Consumer", "ConsumerRecord", "Producer", "RecordMetadata", "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidelog' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
