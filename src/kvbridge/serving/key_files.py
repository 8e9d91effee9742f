"""Deployment key files: where `kvbridge serve` and `kvbridge proxy` keep the key, created once and reused
(`ensure_key_file`, `default_key_file`), a private one for servers started together (`private_key_file`), and a
warning when others may read it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

KEY_FILE_NAME = "deployment.key"
INSECURE_WARNING = (
    "WARNING: kvbridge runs WITHOUT a deployment key (--keyless-exposes-kv-to-local-processes): the side channel "
    "answers anyone who can reach it, so any local process can fetch the NIXL metadata and read or overwrite every "
    "user's KV cache, and free or pin other users' requests. Use this only on a machine no one else uses."
)


def new_key() -> str:
    """A fresh deployment key: 32 random bytes as 64 hex characters (wire.keys.check_strength wants 32 bytes)."""
    return secrets.token_hex(32)


def ensure_key_file(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """The key file at `path`, created with a fresh key if there is none (owner-only 0600; a directory made for
    it is 0700); returns (path, created). An existing file is used as it is: a race with another command
    creating it at the same moment leaves one key, read by both."""
    path = Path(path).expanduser()
    if path.exists():
        return path, False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path, False
    with os.fdopen(fd, "w") as f:
        f.write(new_key() + "\n")
    return path, True


def default_key_file() -> Path:
    """Where `kvbridge serve` and `kvbridge proxy` keep this user's deployment key unless told otherwise:
    `$XDG_CONFIG_HOME/kvbridge/deployment.key` (default `~/.config/kvbridge/deployment.key`), so that servers and
    the proxy started one by one on this machine share it. Copy it to the other hosts of a deployment."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvbridge" / KEY_FILE_NAME


def key_file_warning(path: str | os.PathLike[str]) -> str | None:
    """A warning when others than the owner may read the key file (anyone who reads it can read the KV)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & 0o077:
        return f"WARNING: the deployment key file {path} is readable by others (mode {mode & 0o777:o}): chmod 600 it"
    return None


@contextlib.contextmanager
def private_key_file(given: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """The key file for servers started together: `given` as it is, else a fresh random key in a file (0600) in
    a new private temporary directory (0700), removed on the way out (also on errors and Ctrl-C)."""
    if given is not None:
        yield Path(given).expanduser()
        return
    directory = tempfile.mkdtemp(prefix="kvbridge-key-")  # mkdtemp makes it 0700
    try:
        path, _ = ensure_key_file(Path(directory) / KEY_FILE_NAME)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
