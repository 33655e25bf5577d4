"""Which files of a work folder hold a credential whatever their name: their first bytes hold a private key
(:func:`private_key_content`), or a provider's credential variable names them (:func:`credential_file_paths`).
:func:`broker.run.staging.stage_plan` never stages those."""

from __future__ import annotations

import os
import re

#: files up to this size (bytes) are sniffed for a private key whatever their name (keys, service-account JSON and
#: AWS credentials files are a few KB); only their first :data:`SNIFF_HEAD` bytes are read
SNIFF_MAX_BYTES = 64 * 1024
SNIFF_HEAD = 16 * 1024
#: suffixes of source code and data formats that are never a credential file by themselves: not sniffed, so a work
#: folder of 20,000 source or data files stages as fast as before (a key pasted into a ``.py`` file is a literal in
#: code, not a key file a cloud console hands out); every other name is sniffed, ``key.json`` and ``notes`` alike
NO_SNIFF_SUFFIXES = frozenset(
    ".py .pyi .pyx .pxd .ipynb .c .cc .cpp .cxx .h .hh .hpp .cu .cuh .rs .go .java .scala .kt .js .mjs .ts .tsx .jsx "
    ".md .rst .html .htm .css .svg .tex .csv .tsv .jsonl .parquet .arrow .feather .npy .npz .pt .pth .bin .safetensors "
    ".ckpt .onnx .h5 .hdf5 .pkl .pickle .tfrecord .png .jpg .jpeg .gif .bmp .tif .tiff .webp .wav .mp3 .flac .ogg "
    ".mp4 .avi .mov .zip .gz .tgz .bz2 .xz .zst .tar .so .o .a .whl .lock .idx".split())
_PEM_KEY = re.compile(rb"^-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----", re.M)
_PUTTY_KEY = re.compile(rb"^PuTTY-User-Key-File-\d+:", re.M)
_SA_KEY = re.compile(rb'"private_key"\s*:\s*"')
_AWS_KEY = re.compile(rb"^[ \t]*aws_secret_access_key[ \t]*[=:]", re.M | re.I)


def private_key_content(path: "str | os.PathLike[str]") -> str | None:
    """Why the file at ``path`` holds a private key, judged on its first :data:`SNIFF_HEAD` bytes (a PEM or OpenSSH
    private key block at a line start, a PuTTY key, a service-account JSON's ``"private_key"``, an AWS credentials
    file's ``aws_secret_access_key``); None when it does not look like one or cannot be read.  Never blocks (a FIFO
    put in its place is opened non-blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        head = os.read(fd, SNIFF_HEAD)
    except OSError:
        return None
    finally:
        os.close(fd)
    # cheap substring tests first: almost every file has none of these
    if b"PRIVATE KEY" in head and (m := _PEM_KEY.search(head)):
        kind = m.group(0)[11:-5].decode("ascii", "replace")
        return f"a private key: {kind} block"
    if b"PuTTY-User-Key-File" in head and _PUTTY_KEY.search(head):
        return "a private key: PuTTY key file"
    if b'"private_key"' in head and _SA_KEY.search(head):
        return "a private key: service-account JSON"
    if b"ccess_key" in head.lower() and _AWS_KEY.search(head):
        return "a private key: AWS credentials file (aws_secret_access_key)"
    return None


def credential_file_paths(environ: "dict[str, str] | os._Environ[str] | None" = None) -> dict[str, str]:
    """The real paths (files or folders) that the credential variables of every provider name
    (:data:`broker.providers.CREDENTIAL_FILE_VARS`, read from ``environ``, default this process's) -> the
    variable; relative values are taken from the current folder, as the SDKs do."""
    from broker.providers import CREDENTIAL_FILE_VARS

    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for var in CREDENTIAL_FILE_VARS:
        v = (env.get(var) or "").strip()
        if v:
            out.setdefault(os.path.realpath(os.path.expanduser(v)), var)
    return out
