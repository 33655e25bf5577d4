"""A fresh SSH key pair per run (ed25519), private key 0600 in the run directory.

The private key lives only in ``<run_dir>/ssh/id_ed25519`` (mode 0600, folder 0700); the public key (OpenSSH
one-line format, ``ssh-ed25519 AAAA... broker-<run>``) goes to the provider.  Neither key is logged or written
to the ledger: only the private key's *path* is (``Cluster.ssh_key_path``).

Generation uses the ``cryptography`` library (installed with ``oci`` / ``asyncssh``), imported lazily.
"""

from __future__ import annotations

import hashlib
import base64
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KeyPair:
    """Where the private key is and the public key text.

    ``public_key``: OpenSSH authorized_keys line.  ``fingerprint``: ``SHA256:<base64>`` as ``ssh-keygen -l`` prints.
    """

    private_key_path: Path
    public_key_path: Path
    public_key: str
    fingerprint: str

    def __repr__(self) -> str:  # never the key material beyond the public part
        return f"KeyPair(private_key_path={str(self.private_key_path)!r}, fingerprint={self.fingerprint!r})"


def fingerprint(public_key: str) -> str:
    """``SHA256:...`` fingerprint of an OpenSSH public key line (same as ``ssh-keygen -lf``)."""
    blob = base64.b64decode(public_key.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def generate(run_dir: Path | str, *, comment: str | None = None) -> KeyPair:
    """Create ``<run_dir>/ssh/id_ed25519`` (0600) and ``id_ed25519.pub``; returns the pair.

    Both files are created 0600 in a 0700 folder (under any umask).  An existing key in that folder is reused (a
    resumed run keeps its key); a private key with wider permissions than 0600 is tightened.  Raises OSError when
    the folder cannot be written.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from broker.core.private import private_dir, tighten_dir, tighten_file, write_private

    d = private_dir(Path(run_dir) / "ssh")
    tighten_dir(d)  # a folder an older broker made 0755
    priv_path, pub_path = d / "id_ed25519", d / "id_ed25519.pub"
    if priv_path.exists() and pub_path.exists():
        tighten_file(priv_path)
        pub = pub_path.read_text().strip()
        return KeyPair(priv_path, pub_path, pub, fingerprint(pub))
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    pub = f"{pub} {comment or 'broker-' + Path(run_dir).name}"
    # created 0600 (O_NOFOLLOW): never a moment where the key is readable by another user, no chmod after
    write_private(priv_path, priv)
    write_private(pub_path, pub + "\n")
    return KeyPair(priv_path, pub_path, pub, fingerprint(pub))


# ------------------------------------------------------------------------------------------- pinned host keys
#: a resource id that can be written into known_hosts as it is (no pattern characters, no spaces)
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,100}")


def host_key_name(host: str, port: int = 22, resource_id: str | None = None) -> str:
    """The name a machine's host key is pinned under in a run's ``known_hosts``.

    A machine broker rented is named by its resource id (``broker-res-<id>``, OpenSSH's ``HostKeyAlias``), never
    by its address: a cloud hands a freed address to the next machine it rents (a re-rented preemptible VM gets
    the old address with a new host key) and a stopped machine started again gets a new address with the same
    key.  A node with no resource id is named by its address (``host`` or ``[host]:port``), as OpenSSH does.
    """
    if resource_id:
        rid = str(resource_id)
        if _SAFE_ID.fullmatch(rid):
            return f"broker-res-{rid}"
        return "broker-res-h" + hashlib.sha256(rid.encode()).hexdigest()[:24]
    return host if int(port) == 22 else f"[{host}]:{int(port)}"


def pinned_keys(known_hosts: Path | str, name: str) -> list[str]:
    """The host keys (``<type> <base64>``) pinned under exactly ``name`` in ``known_hosts`` (none when the file is
    missing).  Only lines whose name list holds ``name`` itself count: an address line never pins a machine that
    is named by its resource id."""
    p = Path(known_hosts)
    try:
        text = p.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return []
    keys = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and not line.startswith(("#", "@")) and name in parts[0].split(","):
            keys.append(f"{parts[1]} {parts[2]}")
    return keys


def pin_host_key(known_hosts: Path | str, name: str, key: str) -> None:
    """Append ``name <type> <base64>`` to ``known_hosts`` unless it is there (the file created 0600 under any umask, its folder 0700,
    never through a symlink).  Raises OSError when it cannot be written."""
    from broker.core.private import private_dir, private_opener

    p = Path(known_hosts)
    fields = key.split()
    if f"{fields[0]} {fields[1]}" in pinned_keys(p, name):  # simulated nodes of one machine: pinned once
        return
    private_dir(p.parent)
    with open(p, "a", opener=private_opener) as f:
        f.write(f"{name} {fields[0]} {fields[1]}\n")
