"""Topic-level configuration: the settings a topic may override, their defaults, validation.

Names are Kafka's (``retention.ms``, ``min.insync.replicas`` ...), so operators can read
Kafka's documentation for their meaning. A topic stores only its *overrides* (in
``topics/<t>``, see ``docs/METADATA.md``); every key it does not set takes the default
below. Validation is pure (no I/O) and all-or-nothing: the first bad entry raises
``InvalidConfigError`` with a message naming the key, the value and the rule, and nothing
is created.

Defaults (``TOPIC_CONFIG_DEFAULTS``)::

    cleanup.policy                  delete       only "delete": log compaction is not supported
    file.delete.delay.ms            60000        retired segments linger as *.deleted this long
    flush.messages                  9223372036854775807   (Long.MAX_VALUE = never; the OS flushes)
    flush.ms                        9223372036854775807   (never)
    index.interval.bytes            4096         bytes of log between sparse index entries
    max.message.bytes               1048588      largest batch accepted (Kafka's 1 MiB + 12)
    message.timestamp.type          CreateTime   or LogAppendTime: the leader stamps each batch
                                                 with its clock at the append (as Kafka)
    message.timestamp.before.max.ms 9223372036854775807   a CreateTime batch may be any age
    message.timestamp.after.max.ms  3600000      ... and at most an hour ahead of the leader's
                                                 clock (Kafka 4.0's defaults, KIP-937)
    min.insync.replicas             1            acks=all needs this many in-sync replicas
    replica.lag.time.max.ms         30000        a follower this far behind leaves the ISR
                                                 (a broker setting in Kafka; per topic here,
                                                 the storage node's flag overrides it)
    page.cache.window.bytes         67108864     newest 64 MiB per partition stay in the page
                                                 cache; older bytes are written back and dropped
                                                 (tidelog's own; 0 keeps all, as Kafka does)
    retention.bytes                 -1           no size limit
    retention.ms                    604800000    7 days; -1 keeps forever
    segment.bytes                   1073741824   1 GiB
    segment.index.bytes             10485760     10 MiB per .index / .timeindex
    segment.jitter.ms               0
    segment.ms                      604800000    7 days
    unclean.leader.election.enable  false        an out-of-sync replica never leads

The log settings are checked by ``LogConfig.from_topic_config`` (one source of truth for
their ranges, shared with the storage node that applies them); the cluster-level settings
(``min.insync.replicas``, ``unclean.leader.election.enable``) and ``cleanup.policy``, of
which only one value is implemented, are checked here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final

from services.storage.log.config import STRING_FIELDS, TOPIC_CONFIG_FIELDS, LogConfig
from services.storage.partition import DEFAULT_REPLICA_LAG_TIME_MAX_MS
from tidelog.errors import InvalidConfigError

_LONG_MAX: Final = str((1 << 63) - 1)
_LOG_DEFAULTS: Final = LogConfig()


def _log_default(key: str) -> str:
    value = getattr(_LOG_DEFAULTS, TOPIC_CONFIG_FIELDS[key])
    # None means "never" for the flush triggers; Kafka spells that Long.MAX_VALUE.
    return _LONG_MAX if value is None else str(value)


TOPIC_CONFIG_DEFAULTS: Final[Mapping[str, str]] = {
    **{key: _log_default(key) for key in TOPIC_CONFIG_FIELDS},
    "min.insync.replicas": "1",
    "replica.lag.time.max.ms": str(DEFAULT_REPLICA_LAG_TIME_MAX_MS),
    "unclean.leader.election.enable": "false",
    "cleanup.policy": "delete",
}
"""Every key a topic may set, with the value it has when the topic does not set it."""

MAX_CONFIG_ENTRIES: Final = 64
"""Entries in one topic's config; far above the number of known keys, so only abuse hits it."""
MAX_CONFIG_NAME_CHARS: Final = 255
MAX_CONFIG_VALUE_CHARS: Final = 1024
"""Bounds on one entry, so a request cannot make etcd hold (or logs print) huge strings."""

# A plain decimal integer: int() alone would also take " 5", "+5" and "1_000", which Kafka
# (and people reading the stored config) would not.
_INTEGER: Final = re.compile(r"-?[0-9]+")
_BOOLEANS: Final = {"true": "true", "false": "false"}


def validate_topic_configs(
    entries: Mapping[str, str] | Iterable[tuple[str, str]], replication_factor: int
) -> dict[str, str]:
    """The validated overrides of a topic with ``replication_factor`` replicas.

    ``entries`` is a mapping or ``(name, value)`` pairs (pairs as they come off the wire,
    so that a name given twice is caught). Returns the overrides in canonical form
    (booleans lower-cased); raises InvalidConfigError for an unknown key, a duplicate, an
    oversized entry, a value out of range, ``min.insync.replicas`` above the replication
    factor, or a setting whose value is not implemented (compaction).
    """
    pairs = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
    if len(pairs) > MAX_CONFIG_ENTRIES:
        raise InvalidConfigError(
            f"{len(pairs)} config entries; a topic may set at most {MAX_CONFIG_ENTRIES}"
        )
    out: dict[str, str] = {}
    for name, value in pairs:
        if len(name) > MAX_CONFIG_NAME_CHARS or len(value) > MAX_CONFIG_VALUE_CHARS:
            raise InvalidConfigError(
                f"config entry {name[:60]!r} is too long (names up to {MAX_CONFIG_NAME_CHARS} "
                f"characters, values up to {MAX_CONFIG_VALUE_CHARS})"
            )
        if name not in TOPIC_CONFIG_DEFAULTS:
            raise InvalidConfigError(
                f"unknown topic config {name!r}; known configs: "
                f"{', '.join(sorted(TOPIC_CONFIG_DEFAULTS))}"
            )
        if name in out:
            raise InvalidConfigError(f"topic config {name!r} is given more than once")
        out[name] = _check_value(name, value, replication_factor)
    log_entries = {name: value for name, value in out.items() if name in TOPIC_CONFIG_FIELDS}
    # The log settings' ranges live in LogConfig (the storage node applies the same rules).
    LogConfig.from_topic_config(log_entries)
    return out


def _check_value(name: str, value: str, replication_factor: int) -> str:
    if TOPIC_CONFIG_FIELDS.get(name) in STRING_FIELDS:
        return value  # a name: LogConfig checks it (validate_topic_configs, below)
    if name in TOPIC_CONFIG_FIELDS:
        if _INTEGER.fullmatch(value) is None:
            raise InvalidConfigError(f"invalid {name}={value!r}: not an integer")
        if int(value) > int(_LONG_MAX):
            raise InvalidConfigError(f"invalid {name}={value!r}: larger than {_LONG_MAX}")
        return value
    if name == "min.insync.replicas":
        if _INTEGER.fullmatch(value) is None:
            raise InvalidConfigError(f"invalid {name}={value!r}: not an integer")
        count = int(value)
        if count < 1:
            raise InvalidConfigError(f"invalid {name}={value}: must be at least 1")
        if count > replication_factor:
            raise InvalidConfigError(
                f"invalid {name}={value}: larger than the replication factor "
                f"{replication_factor}, so acks=all produce requests could never succeed"
            )
        return value
    if name == "replica.lag.time.max.ms":
        # Documented (docs/DEPLOY.md) and read by the leaders (services/storage/partition.py)
        # but refused here as unknown, so it could never be set (found by an audit).
        if _INTEGER.fullmatch(value) is None or not 1 <= int(value) <= int(_LONG_MAX):
            raise InvalidConfigError(f"invalid {name}={value!r}: must be an integer >= 1")
        return value
    if name == "unclean.leader.election.enable":
        canonical = _BOOLEANS.get(value.strip().lower())
        if canonical is None:
            raise InvalidConfigError(f"invalid {name}={value!r}: must be true or false")
        return canonical
    if name == "cleanup.policy":
        policies = {part.strip().lower() for part in value.split(",")}
        if policies == {"delete"}:
            return "delete"
        if "compact" in policies:
            raise InvalidConfigError(
                f"invalid {name}={value!r}: log compaction is not supported; only "
                "cleanup.policy=delete (time and size retention) is"
            )
        raise InvalidConfigError(f"invalid {name}={value!r}: the only supported policy is delete")
    raise AssertionError(f"no rule for known config {name!r}")  # pragma: no cover


def effective_configs(overrides: Mapping[str, str]) -> dict[str, str]:
    """Every known key with its value for a topic with ``overrides``: defaults plus overrides."""
    return {**TOPIC_CONFIG_DEFAULTS, **overrides}


# Every known key has a rule: adding a key to the defaults without one fails at import.
for _key, _default in TOPIC_CONFIG_DEFAULTS.items():
    _check_value(_key, _default, replication_factor=1)
