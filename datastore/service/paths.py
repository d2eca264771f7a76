"""Where the service's Unix socket lives, and how a path is claimed and given back.

The default socket is ``$XDG_RUNTIME_DIR/datastore/datastore.sock`` or, without a runtime
directory, ``/tmp/datastore-$UID/datastore.sock``. The directory is private (0700, owned by
this user; anything else is refused) and the socket is 0600, so only its user reaches it.

A path a client names is checked before anything resolves it (:func:`checked_path`): at most
:data:`MAX_PATH` bytes (so at most 2,048 components: resolving costs time in the length), no
NUL byte, absolute; a message quotes at most its first 120 characters (:func:`shown`).

A path is claimed with an ``flock`` on ``<socket>.lock`` held for the server's life: a second
server on the same path fails at once, and a socket left by a dead server (``kill -9``) is
found stale (the lock is free and nothing answers on it) and removed on the next start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from datastore.service.errors import ServiceError

__all__ = [
    "ADDRESS_ENV",
    "MAX_PATH",
    "SOCKET_NAME",
    "AddressInUse",
    "Claim",
    "UnsafeDirectory",
    "checked_path",
    "claim_socket",
    "default_socket",
    "default_state_file",
    "named_address",
    "service_address",
    "shown",
    "socket_answers",
    "socket_held",
    "unix_target",
]

SOCKET_NAME = "datastore.sock"
ADDRESS_ENV = "DATASTORE_ADDRESS"
"""The environment variable naming the service clients call (a socket path or ``HOST:PORT``)."""
MAX_UNIX_PATH = 105  # gRPC binds no longer path (sun_path is 108 bytes; 106 refused by grpcio 1.85)
MAX_PATH = 4096
"""The longest path a request may name, in bytes (Linux's ``PATH_MAX``)."""


class AddressInUse(RuntimeError):
    """Another live server holds the socket path."""


class UnsafeDirectory(RuntimeError):
    """The socket's directory is not private to this user."""


def default_socket(env: dict[str, str] | None = None) -> Path:
    """The default socket path: under ``$XDG_RUNTIME_DIR`` or ``/tmp/datastore-$UID``.

    Args:
        env: the environment to read. Default: ``os.environ``.
    """
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "datastore" / SOCKET_NAME
    return Path(f"/tmp/datastore-{os.getuid()}") / SOCKET_NAME


def named_address(given: str | None, env: dict[str, str] | None = None) -> str | None:
    """The service a client names: ``given``, else ``$DATASTORE_ADDRESS``; ``None`` when
    neither is set (an empty value counts as unset)."""
    env = os.environ if env is None else env
    return given or env.get(ADDRESS_ENV) or None


def service_address(
    given: str | None, option: str = "--address", env: dict[str, str] | None = None
) -> str:
    """The service a client command calls: :func:`named_address`, else the default socket
    when something is there.

    Args:
        given: the address on the command line (``option``), or ``None``.
        option: the command's option for the address, named in the error.
        env: the environment to read. Default: ``os.environ``.

    Raises:
        ValueError: no address is named and nothing is at the default socket.
    """
    named = named_address(given, env)
    if named is not None:
        return named
    default = default_socket(env)
    if not os.path.exists(default):
        raise ValueError(
            f"no service named ({option} ADDRESS or ${ADDRESS_ENV}) and none at the default "
            f"socket {default} (is `datastore serve` running?)"
        )
    return str(default)


def default_state_file(socket: Path, env: dict[str, str] | None = None) -> Path:
    """Where a service on ``socket`` lists its resident datasets across restarts:
    ``$XDG_STATE_HOME/datastore/resident-<hash of the socket path>.json`` (or under
    ``~/.local/state``), so services on different sockets keep different lists."""
    env = os.environ if env is None else env
    base = Path(env.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    digest = hashlib.sha1(os.fsencode(os.path.abspath(socket))).hexdigest()[:12]
    return base / "datastore" / f"resident-{digest}.json"


def shown(text: str, limit: int = 120) -> str:
    """``text`` (a path, a name a client sent) for a message: its start when long, so a
    refusal never echoes megabytes."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def checked_path(path: str, what: str) -> None:
    """Refuse a path a client named that is unfit to resolve.

    Args:
        path: the path.
        what: its name in a refusal (``"dataset_path"``, ``"a source"``...).

    Raises:
        ServiceError: ``INVALID_ARGUMENT``: empty, longer than :data:`MAX_PATH` bytes, holding
            a NUL byte, or relative.
    """
    if not path:
        raise ServiceError("INVALID_ARGUMENT", f"{what} is empty")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise ServiceError(
            "INVALID_ARGUMENT", f"{what} {shown(path)} is longer than {MAX_PATH} bytes"
        )
    if "\0" in path:
        raise ServiceError("INVALID_ARGUMENT", f"{what} {shown(path)} holds a NUL byte")
    if not os.path.isabs(path):
        raise ServiceError("INVALID_ARGUMENT", f"{what} must be absolute, got {shown(path)}")


def unix_target(path: Path | str) -> str:
    """The gRPC address of a Unix socket path (absolute)."""
    return "unix://" + os.path.abspath(path)


def socket_answers(path: Path | str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.fspath(path))
    except OSError:
        return False
    else:
        return True
    finally:
        s.close()


def socket_held(path: Path | str) -> bool:
    """Whether a server holds the Unix socket ``path``: its ``<socket>.lock`` is locked (a
    server keeps it until its process ends; gRPC removes the socket itself as it drains)."""
    try:
        fd = os.open(f"{os.fspath(path)}.lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # (and with it the shared lock)
    return False


@dataclass
class Claim:
    """A socket path held by this process: the lock, and what to remove when done."""

    socket: Path
    lock_path: Path
    lock_fd: int
    created_dir: Path | None = None
    removed_stale: bool = False
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Remove the socket, the lock file and (if this claim created it, and it is empty)
        the directory. Idempotent."""
        if self._released:
            return
        self._released = True
        for p in (self.socket, self.lock_path):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        os.close(self.lock_fd)
        if self.created_dir is not None:
            with contextlib.suppress(OSError):  # not empty: someone else's files; leave it
                self.created_dir.rmdir()


def _private_dir(directory: Path) -> Path | None:
    """Create ``directory`` 0700 if missing (returning it), else check it is safe (None).
    Its parent must exist (a bare "[Errno 2] No such file or directory" named no directory)."""
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise FileNotFoundError(
            f"cannot create the socket's directory {directory}: {directory.parent} does not "
            "exist (serve creates only the socket's own directory)"
        ) from None
    else:
        os.chmod(directory, 0o700)  # mkdir's mode is subject to the umask
        return directory
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{directory} is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{directory} belongs to uid {st.st_uid}, not to this user")
    return None


def claim_socket(path: Path | str, *, private: bool) -> Claim:
    """Claim ``path`` for a server: make its directory, lock it, clear a stale socket.

    Args:
        path: the socket path.
        private: the directory is the default one: it must be 0700 and this user's (a
            directory the user named with ``--socket`` is only created, 0700, if missing).

    Raises:
        AddressInUse: a live server holds ``path``.
        UnsafeDirectory: the default directory is not private.
        ValueError: the path is too long for a Unix socket.
    """
    sock = Path(os.path.abspath(path))
    if len(os.fsencode(sock)) > MAX_UNIX_PATH:
        raise ValueError(
            f"socket path is {len(os.fsencode(sock))} bytes, over the "
            f"{MAX_UNIX_PATH}-byte limit of a Unix socket: {sock}"
        )
    created = _private_dir(sock.parent) if not sock.parent.exists() or private else None
    if private and created is None:
        mode = stat.S_IMODE(sock.parent.stat().st_mode)
        if mode & 0o077:
            raise UnsafeDirectory(
                f"{sock.parent} is mode {mode:04o}; it must be 0700 (chmod 700 {sock.parent})"
            )
    lock_path = sock.with_name(sock.name + ".lock")
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise AddressInUse(
                    f"{sock} is served by a live server (its lock {lock_path} is held)"
                ) from None
            raise
        # the holder may have unlinked the lock file between our open and our flock
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    claim = Claim(socket=sock, lock_path=lock_path, lock_fd=fd, created_dir=created)
    if sock.exists() or sock.is_symlink():
        if socket_answers(sock):  # not one of ours (it would hold the lock), but alive
            _give_up(claim)
            raise AddressInUse(f"{sock} answers connections: another server listens there")
        if not stat.S_ISSOCK(sock.lstat().st_mode):
            _give_up(claim)
            raise AddressInUse(f"{sock} exists and is not a socket; refusing to remove it")
        sock.unlink()
        claim.removed_stale = True
    return claim


def _give_up(claim: Claim) -> None:
    """Drop a claim without touching the socket: unlock, remove the lock file."""
    with contextlib.suppress(FileNotFoundError):
        claim.lock_path.unlink()
    os.close(claim.lock_fd)
    claim._released = True
