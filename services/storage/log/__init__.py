"""The storage engine: segment files, sparse indexes, recovery and retention.

Pure library code (no RPC, no threads, no sleeps), layered like Kafka's storage:
``index`` -> ``segment`` -> ``segments`` -> ``log``; ``checkpoint`` for the offset files.
"""

from .config import LogConfig
from .log import AppendInfo, Log

__all__ = ["AppendInfo", "Log", "LogConfig"]
