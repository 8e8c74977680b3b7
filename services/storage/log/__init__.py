"""The storage engine: segment files, sparse indexes, recovery and retention.

Pure library code (no RPC, no threads, no sleeps), layered like Kafka's storage:
``index`` -> ``segment`` -> ``segments`` -> ``log``; ``checkpoint`` for the offset files;
``leader_epoch`` (the leader epoch cache) and ``producer_state`` (idempotent producers),
both owned and kept consistent by ``log``; ``errors`` for the damaged files it finds.
"""

from .config import LogConfig
from .leader_epoch import EpochEntry, LeaderEpochCache
from .log import AppendInfo, Log
from .producer_state import ProducerStateEntry, ProducerStateManager

__all__ = [
    "AppendInfo",
    "EpochEntry",
    "LeaderEpochCache",
    "Log",
    "LogConfig",
    "ProducerStateEntry",
    "ProducerStateManager",
]
