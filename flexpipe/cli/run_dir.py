"""The private directory of one `flexpipe up`: its admin token (gateway and controller), the
engines' token, its pid and its URLs, so that `flexpipe cluster`, `status`, `top` and
`shifts` find the running `up`'s controller (whatever ports it was given) and its token, and
a later `up` can tell a directory left by a `kill -9` (its pid is dead) and remove it.

    $TMPDIR/flexpipe-up-<gateway port>-<random>/   (0700; files 0600)
        pid            the pid of `up`
        urls.json      {"gateway": "http://...", "controller": "http://..."}
        admin-token    the gateway's and the controller's admin bearer token
        engine-token   the engines' admin token (KV moves)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flexpipe.control.api.client import DEFAULT_CONTROLLER_URL, resolve_token
from flexpipe.launch.process import pid_alive

__all__ = [
    "PREFIX",
    "RunDir",
    "RunningUp",
    "admin_token",
    "controller_url",
    "find_admin_token",
    "remove_stale",
    "run_dir",
    "running_ups",
]

PREFIX = "flexpipe-up-"
_LEGACY_FILES = {"gateway-token", "engine-token"}  # what an `up` before the pid file left


@dataclass(frozen=True, slots=True)
class RunDir:
    path: Path

    @property
    def admin_token_file(self) -> Path:
        return self.path / "admin-token"

    @property
    def engine_token_file(self) -> Path:
        return self.path / "engine-token"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _named_by_a_process(path: Path) -> bool:
    """Whether a running process has `path` on its command line (the children of an `up`
    that wrote no pid file hold their token files there)."""
    needle = str(path).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    return True
    return False


def _mine(path: Path) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return path.is_dir() and not path.is_symlink() and st.st_uid == os.getuid()


def _owner_pid(path: Path) -> int | None:
    try:
        return int((path / "pid").read_text().strip())
    except (OSError, ValueError):
        return None


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove this user's `flexpipe-up-*` directories whose `up` is gone: its recorded pid is
    dead, or (a directory of an older `up`, without a pid file, holding only its token files)
    no running process names it. Returns what it removed."""
    removed: list[Path] = []
    for path in sorted(Path(root or tempfile.gettempdir()).glob(PREFIX + "*")):
        if not _mine(path):
            continue
        pid = _owner_pid(path)
        if pid is not None:
            stale = not pid_alive(pid)
        else:
            names: set[str] = set()
            with contextlib.suppress(OSError):
                names = {p.name for p in path.iterdir()}
            stale = bool(names) and names <= _LEGACY_FILES and not _named_by_a_process(path)
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def run_dir(
    port: int,
    gateway_url: str,
    controller_url: str,
    admin_token: str | None = None,
    root: Path | None = None,
) -> Iterator[RunDir]:
    """Make the directory (removing stale ones first); remove it on the way out."""
    remove_stale(root)
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{port}-", dir=root))  # 0700
    try:
        rd = RunDir(path)
        _write_private(rd.admin_token_file, admin_token or secrets.token_urlsafe(24))
        _write_private(rd.engine_token_file, secrets.token_urlsafe(24))
        _write_private(
            path / "urls.json", json.dumps({"gateway": gateway_url, "controller": controller_url})
        )
        _write_private(path / "pid", str(os.getpid()))  # last: a whole directory
        yield rd
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _same_url(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        return url.strip().rstrip("/").lower().replace("://localhost:", "://127.0.0.1:")

    return norm(a) == norm(b)


@dataclass(frozen=True, slots=True)
class RunningUp:
    """What a running `flexpipe up` of this user recorded in its directory."""

    path: Path
    gateway_url: str
    controller_url: str
    admin_token: str | None


def running_ups(root: Path | None = None) -> list[RunningUp]:
    """This user's `flexpipe up`s whose pid lives, in directory order."""
    out = []
    for path in sorted(Path(root or tempfile.gettempdir()).glob(PREFIX + "*")):
        pid = _owner_pid(path) if _mine(path) else None
        if pid is None or not pid_alive(pid):
            continue
        try:
            urls = json.loads((path / "urls.json").read_text())
            gateway, controller = str(urls["gateway"]), str(urls["controller"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            token = (path / "admin-token").read_text().strip() or None
        except OSError:
            token = None
        out.append(RunningUp(path, gateway, controller, token))
    return out


def find_admin_token(controller_url: str, root: Path | None = None) -> str | None:
    """The admin token of this user's running `up` whose controller is at `controller_url`."""
    for up in running_ups(root):
        if up.admin_token and _same_url(up.controller_url, controller_url):
            return up.admin_token
    return None


def controller_url(given: str | None, root: Path | None = None) -> str:
    """The controller a command talks to: `given` (--controller, $FLEXPIPE_CONTROLLER), else
    the one of this user's running `flexpipe up` (its --port / --controller-port are in its
    directory), else the default one (127.0.0.1:8100). Several running `up`s and none given:
    a ValueError that names them (which one is meant cannot be guessed)."""
    if given:
        return given
    ups = running_ups(root)
    if len(ups) > 1:
        names = ", ".join(u.controller_url for u in ups)
        raise ValueError(
            f"{len(ups)} `flexpipe up` are running (controllers {names}): "
            "say which with --controller"
        )
    return ups[0].controller_url if ups else DEFAULT_CONTROLLER_URL


def admin_token(controller: str, token: str | None, token_file: Path | None) -> str | None:
    """What `flexpipe cluster` and `flexpipe status` send: --token, --token-file,
    $FLEXPIPE_CONTROLLER_TOKEN, else the token of this user's running `flexpipe up` whose
    controller is at `controller`."""
    return resolve_token(token, token_file) or find_admin_token(controller)
