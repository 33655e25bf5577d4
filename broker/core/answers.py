"""What broker accepts from a provider's answer about a machine before it records it: an answer is input, never
authority (docs/security.md), and a malformed id or address written to the ledger or a run's ``cluster.json``
would later name a host to log in to, a URL or a shell word."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

#: a provider's machine id as broker accepts it from an answer (no spaces, no control or shell characters)
PROVIDER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,254}")


def is_ip(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def instance_answer_problem(info: Any, provider_id: str | None) -> str | None:
    """What is wrong with a ``describe_instance`` answer (an :class:`~broker.core.records.InstanceInfo`) for the
    machine ``provider_id`` (``returned ... which is not ...``), or None when every id and address in it can be
    recorded: the id is the one asked about in the provider's id format, ``public_ip`` / ``private_ip`` are IP
    addresses, ``ssh_host`` an IP address or DNS name, the port 0-65535 (0: none assigned yet; None: not said)."""
    from broker.core.runfolder import valid_host

    pid = str(info.provider_id or "")
    if not PROVIDER_ID.fullmatch(pid) or pid != str(provider_id):
        return f"returned the id {pid!r}, not the id {provider_id!r} that was asked about"
    for field in ("public_ip", "private_ip"):
        v = getattr(info, field)
        if v is not None and not (isinstance(v, str) and is_ip(v)):
            return f"returned {field} {str(v)[:80]!r}, which is not an IP address"
    host = info.ssh_host
    numeric = isinstance(host, str) and re.fullmatch(r"[0-9.]+", host)
    if host is not None and (not isinstance(host, str) or not valid_host(host) or (numeric and not is_ip(host))):
        return f"returned ssh_host {str(host)[:80]!r}, which is not an IP address or DNS name"
    port = info.ssh_port
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        return f"returned ssh_port {port!r}, which is not a port number"
    return None
