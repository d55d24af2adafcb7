"""A lock file that holds across hosts on a shared file system, and atomic file replacement.

Why not `fcntl.flock`: on NFS it is only as good as the mount (host-local under `nolock` or
`local_lock`, a silent no-op across nodes). Why not `O_CREAT | O_EXCL`: broken on old NFS. The
lock is taken with `link(2)` instead, which is atomic on the server: each contender writes a
unique file, then links it to the lock name; the winner is whoever's unique file then has a link
count of 2 (checked even when `link` reports an error, since an NFS retry can lose the reply to
a link that succeeded). A lock whose holder is gone is broken: immediately when the holder is a
dead process on this host, else once it is older than `stale_after` seconds (by the lock file's
own mtime, set by the server's clock, so client clock skew does not matter).
See docs/conformance.md "Baselines on a shared file system" for the remaining caveats.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import time


class LockTimeout(TimeoutError):
    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostSafeLock:
    def __init__(self, path: str, timeout: float = 300.0, stale_after: float = 1800.0,
                 poll: float = 0.05):
        self.path = path
        self.timeout, self.stale_after, self.poll = timeout, stale_after, poll
        self.host = socket.gethostname()
        self.token = secrets.token_hex(8)
        self._mine = f"{path}.{self.host}.{os.getpid()}.{self.token}"
        self.held = False

    def _holder(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _stale(self, holder: dict) -> bool:
        if holder.get("host") == self.host and isinstance(holder.get("pid"), int):
            if not _pid_alive(holder["pid"]):
                return True
        try:
            server_now = self._server_time()
            return server_now - os.stat(self.path).st_mtime > self.stale_after
        except FileNotFoundError:
            return False

    def _server_time(self) -> float:
        # the directory's clock: touch a probe file and read back its mtime
        probe = f"{self._mine}.now"
        with open(probe, "w"):
            pass
        try:
            return os.stat(probe).st_mtime
        finally:
            os.unlink(probe)

    def _break(self) -> None:
        aside = f"{self.path}.broken.{self.token}"
        try:
            os.rename(self.path, aside)  # atomic: only one breaker wins, the others see ENOENT
        except FileNotFoundError:
            return
        os.unlink(aside)

    def acquire(self) -> "HostSafeLock":
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self._mine, "w") as f:
            json.dump({"host": self.host, "pid": os.getpid(), "token": self.token,
                       "since": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        deadline = time.monotonic() + self.timeout
        delay = self.poll
        try:
            while True:
                try:
                    os.link(self._mine, self.path)
                except FileExistsError:
                    pass
                except OSError:
                    pass  # e.g. a lost NFS reply: the link count below is the truth
                if os.stat(self._mine).st_nlink == 2:
                    self.held = True
                    return self
                holder = self._holder()
                if self._stale(holder):
                    self._break()
                    continue
                if time.monotonic() > deadline:
                    raise LockTimeout(
                        f"could not lock {self.path} within {self.timeout:.0f} s: held by "
                        f"{holder.get('host', '?')} pid {holder.get('pid', '?')}. If that process is "
                        f"gone, delete the file (it is broken automatically after "
                        f"{self.stale_after:.0f} s).")
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            if not self.held:
                _unlink(self._mine)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._holder().get("token") == self.token:  # not broken and re-taken meanwhile
            _unlink(self.path)
        _unlink(self._mine)

    def __enter__(self) -> "HostSafeLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def atomic_write(path: str, text: str) -> None:
    """Replace `path` by `text`: temp file in the same directory, fsync, rename, fsync the dir.
    Readers see the old file or the new one, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        _unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable only once the directory is
    finally:
        os.close(fd)
