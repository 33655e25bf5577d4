"""A fresh SSH key pair per run (ed25519), private key 0600 in the run directory.

The private key lives only in ``<run_dir>/ssh/id_ed25519`` (mode 0600, folder 0700); the public key (OpenSSH
one-line format, ``ssh-ed25519 AAAA... broker-<run>``) goes to the provider.  Neither key is logged or written
to the ledger: only the private key's *path* is (``Cluster.ssh_key_path``).

Generation uses the ``cryptography`` library (installed with ``oci`` / ``asyncssh``), imported lazily.
"""

from __future__ import annotations

import hashlib
import base64
import os
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

    An existing key in that folder is reused (a resumed run keeps its key); a private key with wider permissions
    than 0600 is tightened.  Raises OSError when the folder cannot be written.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    d = Path(run_dir) / "ssh"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    priv_path, pub_path = d / "id_ed25519", d / "id_ed25519.pub"
    if priv_path.exists() and pub_path.exists():
        os.chmod(priv_path, 0o600)
        pub = pub_path.read_text().strip()
        return KeyPair(priv_path, pub_path, pub, fingerprint(pub))
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    pub = f"{pub} {comment or 'broker-' + Path(run_dir).name}"
    # create with 0600 from the start: never a moment where the key is world-readable
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, priv)
    finally:
        os.close(fd)
    os.chmod(priv_path, 0o600)
    pub_path.write_text(pub + "\n")
    return KeyPair(priv_path, pub_path, pub, fingerprint(pub))
