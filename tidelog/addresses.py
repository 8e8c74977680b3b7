"""``HOST:PORT`` addresses, as every command-line flag and ``$TIDELOG_GATEWAY`` take them.

Kept apart from the CLI so that the SDK checks ``$TIDELOG_GATEWAY`` by the same rule as
``--gateway`` (a malformed value used to reach gRPC's resolver, which wrapped port 99999
to another port and took a bare host for port 443).
"""

from __future__ import annotations

import re
from typing import Final

# A host name or IPv4 address of ASCII letters, digits, '.', '-' and '_', or an IPv6
# address in brackets; an ASCII port. Spaces (a quoted YAML value) and other scripts'
# digits passed, and gRPC's resolver then failed every call with a retriable error.
_HOST_PORT: Final = re.compile(
    r"(?:\[(?P<ipv6>[0-9a-fA-F:.]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]{1,5})",
    re.ASCII,
)
_ECHO_MAX_CHARS: Final = 80


def _quoted(text: str) -> str:
    if len(text) <= _ECHO_MAX_CHARS:
        return repr(text)
    return f"{text[:_ECHO_MAX_CHARS]!r}... ({len(text)} chars)"


def parse_host_port(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9092"`` -> ``("127.0.0.1", 9092)``; ``"[::1]:0"`` -> ``("::1", 0)``.
    Raises ValueError with a message for people."""
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        raise ValueError(f"{_quoted(text)} is not HOST:PORT")
    port = int(match["port"])
    if port > 65535:
        raise ValueError(f"port {port} is out of range 0..65535")
    return match["ipv6"] or match["host"], port


def format_host_port(host: str, port: int) -> str:
    """The address to dial: an IPv6 host in brackets (``[::1]:9092``), as
    ``parse_host_port`` reads it back. Bare, gRPC's resolver took ``::1:9092`` for a name
    and every call to a broker registered on IPv6 failed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_connectable(text: str) -> str:
    """``text`` if it is HOST:PORT with a port a connection can use (1..65535); else
    ValueError."""
    _, port = parse_host_port(text)
    if port == 0:
        raise ValueError("port 0 names no server; give the port it listens on")
    return text
