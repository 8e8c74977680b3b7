"""Structured logging for tidelog services: one JSON object per line on stderr.

``configure("storage", broker_id=1)`` once at process start; afterwards
``get_logger(topic=..., partition=...)`` anywhere. Every event carries ``timestamp`` (UTC,
ISO 8601), ``level``, ``service``, ``event`` and the fields bound at ``configure`` time
(e.g. ``broker_id``), plus whatever the call site adds (topic, partition, epoch, ...).

The process-wide fields are added by a processor rather than through contextvars: gRPC
handlers run on pool threads, which start with an empty context, and the broker id must
be on their lines too.

Thread-safety: after ``configure`` returns, loggers may be used from any thread; structlog's
PrintLogger serializes writes to the stream, so lines never interleave.
"""

from __future__ import annotations

import contextlib
import logging as _stdlib_logging
import sys
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import FilteringBoundLogger, WrappedLogger

_LEVELS: dict[str, int] = {
    "debug": _stdlib_logging.DEBUG,
    "info": _stdlib_logging.INFO,
    "warning": _stdlib_logging.WARNING,
    "error": _stdlib_logging.ERROR,
}


class _SafePrintLogger(structlog.PrintLogger):
    """structlog's PrintLogger, except that a line the stream cannot take is dropped
    (and counted), as Python's logging and log4j do. A log write raised into its caller:
    once stderr's reader died (a killed ``| tee`` or log shipper) or the log disk filled,
    every request that logged failed - the gateway's InitProducerId among them - and a
    thread logging in an ``except`` (a metadata watch's) died, while the health check
    still answered SERVING (found by an audit)."""

    dropped_lines = 0

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (OSError, ValueError):  # ValueError: the stream was closed
            type(self).dropped_lines += 1

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _SafePrintLoggerFactory:
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, *args: Any) -> _SafePrintLogger:
        return _SafePrintLogger(self._stream)


class _AddStaticFields:
    """A processor that adds fixed fields (service, broker_id) unless the event sets them."""

    def __init__(self, fields: Mapping[str, object]) -> None:
        self._fields = dict(fields)

    def __call__(
        self, logger: WrappedLogger, method_name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        for key, value in self._fields.items():
            event_dict.setdefault(key, value)
        return event_dict


def configure(
    service: str, *, level: str = "info", stream: TextIO | None = None, **bound: object
) -> FilteringBoundLogger:
    """Route structlog output to JSON lines on ``stream`` (stderr) and bind process fields.

    ``service`` names the role (``storage``, ``controller``, ...); ``bound`` holds fields
    that belong on every line of this process, such as ``broker_id``. Returns a logger.
    Calling it again replaces the configuration (tests start several roles in-process).
    """
    if level not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {sorted(_LEVELS)}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _AddStaticFields({"service": service, **bound}),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            # Without the frames' local variables: rendering them repr()s whatever a
            # frame holds, a request of 100 MiB of records included (seconds of CPU and a
            # string as large, for one error line).
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_SafePrintLoggerFactory(stream or sys.stderr),
        # Not cached, so loggers created before a later configure() follow the new settings.
        cache_logger_on_first_use=False,
    )
    return get_logger()


class _IntoStructlog(_stdlib_logging.Handler):
    """The standard library's records (gRPC's Python side, concurrent.futures') as JSON
    lines of this log, with the logger's name."""

    def emit(self, record: _stdlib_logging.LogRecord) -> None:
        # A line that cannot be made is dropped (handleError would print plain text).
        with contextlib.suppress(Exception):
            get_logger().bind(logger=record.name).log(
                record.levelno, record.getMessage(), exc_info=record.exc_info or False
            )


def capture_process_output() -> None:
    """For a service's process (its ``main``, after ``configure``): uncaught exceptions of
    threads and the standard library's logging go into the JSON log too. They were
    written as plain, multi-line text among the JSON lines, where a collector of JSON
    lines mangles exactly the crash reports. Not for ``configure`` itself: tests
    configure roles in-process, and pytest has hooks of its own there."""
    log = get_logger()

    def thread_crashed(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        log.error(
            "thread_crashed",
            thread=None if args.thread is None else args.thread.name,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )

    threading.excepthook = thread_crashed
    root = _stdlib_logging.getLogger()
    root.handlers[:] = [_IntoStructlog()]
    root.setLevel(_stdlib_logging.WARNING)


def get_logger(**bound: object) -> FilteringBoundLogger:
    """A logger with ``bound`` fields on every event it emits. Lazy: assembled at its
    first event, after ``configure`` (modules call this at import). Bound at once, it was
    built from structlog's defaults: those modules' events went to stdout as console
    text, without the level filter, instead of into the JSON log (found by an audit)."""
    logger: FilteringBoundLogger = structlog.get_logger(**bound)
    return logger
