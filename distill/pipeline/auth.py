"""CurveZMQ authentication: who may talk to the broker, with pyzmq's own CURVE and ZAP.

One rule: with a :class:`CurveConfig`, every socket of the broker is a CURVE server
and every socket of a peer a CURVE client, whatever the transport, so keys on means
every connection is encrypted and authenticated. A ZAP handler
(``zmq.auth.thread.ThreadAuthenticator``) in the broker's context admits only clients
whose public key is in its allow-list directory, so a peer without an allowed key
never completes a handshake and none of its messages reaches the broker.

Each broker socket has a ZAP domain of its own (``distill.<socket>``); a key issued for
a role (``create_keys(..., roles=...)``, in the public key file's metadata) is admitted
only on that role's sockets (:data:`ROLE_SOCKETS`), a key without a role on every
socket. Secret files must be private to the user (no group/other permission bits): a
key anyone can read authenticates anyone.

The key layout :func:`create_keys` writes (``python -m distill mode=keys``), which file
goes to which machine, and the roles: docs/security.md, sections Authentication
(CurveZMQ) and Leaders, roles and numbers (issue 37).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

SERVER_NAME = "server"
CLIENTS_DIR = "clients"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_DOMAIN = "distill"
BROKER_SOCKETS = ("frontend", "backend", "control", "control_pub")
ROLE_SOCKETS: dict[str, frozenset[str]] = {
    "worker": frozenset({"backend", "control_pub"}),
    "student": frozenset({"frontend", "control", "control_pub"}),
}
"""The broker sockets a key of each role may connect to (students lead, follow and read
statistics; workers take work and hear model switches)."""
_ROLE_LINE = re.compile(r"^\s+role\s*=\s*\"?([A-Za-z_]+)\"?\s*$", re.MULTILINE)
REFUSAL_LOG_INTERVAL_S = 60.0
"""A refused key is logged at most once per interval (its peer keeps reconnecting)."""


class AuthError(ValueError):
    """A key file or directory that cannot be used; the message says what to change."""


def require_curve() -> None:
    """Fail clearly when this libzmq was built without CURVE (libsodium/tweetnacl)."""
    if not zmq.has("curve"):
        raise AuthError(f"libzmq {zmq.zmq_version()} has no CURVE support, so authentication cannot "
                        "be turned on; install a pyzmq wheel (bundles libzmq with CURVE) or turn "
                        "authentication off")


@dataclass(frozen=True)
class ServerKeys:
    """What the broker needs: its key pair and the directory of admitted public keys."""

    public: bytes
    secret: bytes
    allowed_dir: Path

    def apply(self, sock: zmq.Socket, socket_name: str) -> zmq.Socket:
        """Make ``sock`` (the broker's ``socket_name`` socket) a CURVE server whose handshakes
        the ZAP handler checks in that socket's domain (before bind)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = zap_domain(socket_name).encode()
        return sock


def zap_domain(socket_name: str) -> str:
    """The ZAP domain of one broker socket: the handler knows which socket a key asks for."""
    if socket_name not in BROKER_SOCKETS:
        raise ValueError(f"no broker socket {socket_name!r}; one of {BROKER_SOCKETS}")
    return f"{ZAP_DOMAIN}.{socket_name}"


@dataclass(frozen=True)
class ClientKeys:
    """What a peer needs: the broker's public key and its own key pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` a CURVE client of the broker (before connect)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        return sock


def secure_client(sock: zmq.Socket, keys: ClientKeys | None) -> zmq.Socket:
    """``keys.apply(sock)``, or ``sock`` unchanged when authentication is off."""
    return sock if keys is None else keys.apply(sock)


HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_SUCCEEDED)


class HandshakeWatch:
    """Why the broker refuses a client socket's handshakes (ZeroMQ's socket monitor).

    A refused CURVE client gets no error from send or recv: its messages just never
    leave. Watching the handshake events turns that silence into a reason a peer can
    report. Create it before ``connect``; :meth:`refusal` is None while handshakes
    succeed (or none has finished yet).
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self._refusal: str | None = None

    def refusal(self) -> str | None:
        """The reason of the latest failed handshake, or None after a successful one."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refusal = None
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refusal = (f"the broker at {endpoint} refused this peer's key (ZAP status "
                                 f"{event['value']}): add its public .key to the broker's allow-list")
            else:
                self._refusal = (f"CurveZMQ handshake with {endpoint} failed: both sides need keys "
                                 "(or neither), and this peer needs the broker's server.key")
        return self._refusal

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)


@dataclass(frozen=True)
class CurveConfig:
    """Where the CurveZMQ keys are. The broker reads the first two, peers the last two.

    Plain paths, so the config pickles into DataLoader workers; keys are read (and
    their permissions checked) by :meth:`server_keys` / :meth:`client_keys`.
    """

    server_secret_file: str | Path | None = None
    """The broker's ``server.key_secret``."""
    allowed_clients_dir: str | Path | None = None
    """The broker's allow-list: a directory of admitted clients' public ``*.key`` files."""
    server_public_file: str | Path | None = None
    """Peers: the broker's ``server.key``."""
    client_secret_file: str | Path | None = None
    """Peers: this peer's ``<name>.key_secret``."""

    @classmethod
    def from_keys_dir(cls, keys_dir: str | Path, client_name: str = "client") -> CurveConfig:
        """The files of the layout ``mode=keys`` writes (module docstring)."""
        root = Path(keys_dir).expanduser()
        return cls(server_secret_file=root / f"{SERVER_NAME}{SECRET_SUFFIX}",
                   allowed_clients_dir=root / CLIENTS_DIR,
                   server_public_file=root / f"{SERVER_NAME}{PUBLIC_SUFFIX}",
                   client_secret_file=root / CLIENTS_DIR / f"{client_name}{SECRET_SUFFIX}")

    def server_keys(self) -> ServerKeys:
        """Read and check the broker's keys; :class:`AuthError` naming the file otherwise."""
        require_curve()
        if self.server_secret_file is None or self.allowed_clients_dir is None:
            raise AuthError("the broker needs server_secret_file and allowed_clients_dir to authenticate")
        public, secret = read_secret_file(self.server_secret_file)
        return ServerKeys(public, secret, check_allow_list(self.allowed_clients_dir))

    def client_keys(self) -> ClientKeys:
        """Read and check a peer's keys; :class:`AuthError` naming the file otherwise."""
        require_curve()
        if self.server_public_file is None or self.client_secret_file is None:
            raise AuthError("a peer needs server_public_file and client_secret_file to authenticate")
        public, secret = read_secret_file(self.client_secret_file)
        return ClientKeys(read_public_file(self.server_public_file), public, secret)


def read_public_file(path: str | Path) -> bytes:
    """The z85 public key in a ``.key`` file."""
    return _load(path)[0]


def read_secret_file(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) of a ``.key_secret`` file that only its owner can read."""
    path = Path(path)
    public, secret = _load(path)
    if secret is None:
        raise AuthError(f"{path} holds no secret key; give the .key_secret file that mode=keys wrote")
    _check_private(path)
    return public, secret


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise AuthError(f"key file {path} does not exist; create keys with "
                        "`python -m distill mode=keys keys_dir=...` and copy the file there")
    try:
        return zmq.auth.load_certificate(path)
    except OSError as exc:
        raise AuthError(f"cannot read key file {path}: {exc}") from exc
    except ValueError as exc:
        raise AuthError(f"{path} is not a ZeroMQ certificate ({exc}); use the files mode=keys wrote") from exc


def _check_private(path: Path) -> None:
    """A secret must belong to this user and be closed to everyone else."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise AuthError(f"secret key {path} belongs to uid {st.st_uid}, not to this user; "
                        "copy it and own the copy")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise AuthError(f"secret key {path} is readable by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`")


def check_allow_list(directory: str | Path) -> Path:
    """The allow-list directory, checked: it exists and only its owner can add keys to it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AuthError(f"allow-list directory {directory} does not exist; it holds the public "
                        "*.key files of the admitted clients (mode=keys writes <keys_dir>/clients)")
    st = directory.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise AuthError(f"allow-list directory {directory} can be changed by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}): anyone could admit "
                        f"themselves; run `chmod 700 {directory}` as its owner")
    if not list(directory.glob(f"*{PUBLIC_SUFFIX}")):
        log.warning("allow-list %s holds no *%s file: no client will be admitted", directory, PUBLIC_SUFFIX)
    return directory


class AllowList:
    """pyzmq credentials provider: the public keys in a directory.

    The directory is read again when it changes (its mtime), so deleting a client's
    ``.key`` refuses its next connection without restarting the broker. A refusal
    is logged, once per key and interval: the refused peer keeps reconnecting.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.refused = 0
        self._keys: dict[bytes, str | None] = {}
        self._mtime_ns: int | None = None
        self._logged: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may the peer with this z85 public key connect to the socket of ``domain``?"""
        socket_name = domain.removeprefix(f"{ZAP_DOMAIN}.")
        with self._lock:
            keys = self._current()
            if key not in keys:
                self._note_refusal(key, f"is not in the allow-list {self.directory}")
                return False
            role = keys[key]
            if role is not None and socket_name not in ROLE_SOCKETS.get(role, ()):
                self._note_refusal(key, f"has the role {role!r}, which may not connect to the broker's "
                                        f"{socket_name} socket")
                return False
        return True

    def _current(self) -> dict[bytes, str | None]:
        """Public key -> its role (None: any socket), read again when the directory changes."""
        try:
            mtime_ns = self.directory.stat().st_mtime_ns
        except OSError:
            return {}  # the allow-list vanished: admit nobody
        if mtime_ns != self._mtime_ns:
            self._keys = _load_roles(self.directory)
            self._mtime_ns = mtime_ns
        return self._keys

    def _note_refusal(self, key: bytes, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged.get(key, -REFUSAL_LOG_INTERVAL_S) >= REFUSAL_LOG_INTERVAL_S:
            self._logged[key] = now
            log.warning("refused a peer whose public key %s %s", key.decode(errors="replace"), why)


def _load_roles(directory: Path) -> dict[bytes, str | None]:
    """The public keys of ``directory``'s ``*.key`` files, each with its role (or None)."""
    keys: dict[bytes, str | None] = {}
    for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}")):
        try:
            public, _ = zmq.auth.load_certificate(path)
            match = _ROLE_LINE.search(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("allow-list: cannot read %s (%s): skipped", path, exc)
            continue
        role = match.group(1) if match else None
        if role is not None and role not in ROLE_SOCKETS:
            log.warning("allow-list: %s has the unknown role %r: admitted nowhere", path, role)
        keys[public] = role
    return keys


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """The ZAP handler for ``ctx`` (start it before binding CURVE server sockets in it)."""
    authenticator = ThreadAuthenticator(ctx, log=log.getChild("zap"))
    authenticator.start()
    allow_list = AllowList(keys.allowed_dir)
    for socket_name in BROKER_SOCKETS:
        authenticator.configure_curve_callback(domain=zap_domain(socket_name), credentials_provider=allow_list)
    return authenticator


@dataclass(frozen=True)
class KeyFiles:
    """The files :func:`create_keys` wrote."""

    server_public: Path
    server_secret: Path
    clients: dict[str, tuple[Path, Path]]
    """name -> (public, secret)."""


def create_keys(keys_dir: str | Path, client_names: list[str], *, overwrite: bool = False,
                roles: dict[str, str] | None = None) -> KeyFiles:
    """Write a server key pair and one pair per client in the layout of the module docstring.

    Directories are made 0700 and secrets 0600. Existing keys are kept unless
    ``overwrite``: new keys lock out every machine that holds the old ones. ``roles``
    maps a client name to its role (a key of ``ROLE_SOCKETS``); a client not named
    there gets a key without a role (admitted on every socket).
    """
    require_curve()
    names = _check_client_names(client_names)
    roles = _check_roles(roles or {}, names)
    root = Path(keys_dir).expanduser()
    clients_dir = root / CLIENTS_DIR
    targets = [root / SERVER_NAME, *(clients_dir / name for name in names)]
    existing = [str(t) + suffix for t in targets for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX)
                if Path(str(t) + suffix).exists()]
    if existing and not overwrite:
        raise AuthError(f"keys exist already ({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                        "set keys_overwrite=true to replace them (machines holding the old keys "
                        "are then refused), or choose another keys_dir")
    for directory in (root, clients_dir):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
    written = [_create_pair(targets[0]), *(_create_pair(clients_dir / name, roles.get(name)) for name in names)]
    return KeyFiles(*written[0], clients=dict(zip(names, written[1:], strict=True)))


def _check_client_names(client_names: list[str]) -> list[str]:
    names = [str(name) for name in client_names]
    if not names:
        raise AuthError("keys_clients is empty; name at least one client (a worker or student machine)")
    for name in names:
        if not name or name == SERVER_NAME or not all(c.isalnum() or c in "-_." for c in name) \
                or name.startswith("."):
            raise AuthError(f"keys_clients: {name!r} is not a usable key name; use letters, digits, "
                            f"'-', '_' or '.', and not {SERVER_NAME!r}")
    if len(set(names)) != len(names):
        raise AuthError(f"keys_clients {names} names a client twice")
    return names


def _check_roles(roles: dict[str, str], names: list[str]) -> dict[str, str]:
    for name, role in roles.items():
        if name not in names:
            raise AuthError(f"keys_roles names {name!r}, which is not in keys_clients {names}")
        if role not in ROLE_SOCKETS:
            raise AuthError(f"keys_roles: {name!r} has the role {role!r}; use one of {sorted(ROLE_SOCKETS)}")
    return roles


def _create_pair(target: Path, role: str | None = None) -> tuple[Path, Path]:
    """One key pair: ``<target>.key`` (0644) and ``<target>.key_secret`` (0600), of ``role``."""
    public, secret = Path(str(target) + PUBLIC_SUFFIX), Path(str(target) + SECRET_SUFFIX)
    for path in (public, secret):
        path.unlink(missing_ok=True)
    old_umask = os.umask(0o077)  # the secret is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(target.parent, target.name,
                                     metadata=None if role is None else {"role": role})
        if role is not None:  # pyzmq writes metadata into the secret file only; the broker reads the public one
            text = public.read_text(encoding="utf-8")
            public.write_text(text.replace("metadata\n", f"metadata\n    role = {role}\n", 1), encoding="utf-8")
    finally:
        os.umask(old_umask)
    secret.chmod(0o600)
    public.chmod(0o644)
    return public, secret
