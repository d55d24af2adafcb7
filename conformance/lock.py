"""A lock file that holds across hosts on a shared file system, and atomic file replacement.

Why not `fcntl.flock`: on NFS it is only as good as the mount (host-local under `nolock` or
`local_lock`, a silent no-op across nodes). Why not `O_CREAT | O_EXCL`: broken on old NFS. The
lock is taken with `link(2)` instead, which is atomic on the server: each contender writes a
unique file, then links it to the lock name; the winner is whoever's unique file then has a link
count of 2 (checked even when `link` reports an error, since an NFS retry can lose the reply to
a link that succeeded). A lock whose holder is gone is broken: immediately when the holder is a
dead process on this host, else once it is older than `stale_after` seconds (by the lock file's
own mtime, set by the server's clock, so client clock skew does not matter).

Breaking. Renaming the stale lock aside is not enough on its own: two contenders that both saw
the stale lock can both rename, and the second then removes the lock the first has just taken.
No file system offers "remove this name if it still names that file", so a breaker first wins a
claim on the very lock it inspected, then checks again. A lock is identified by its content,
which carries the holder's random token, and on this host also by device and inode:

1. claim: link a unique file to `<lock>.break.<hash of the content>.<n>`, by the same
   link-count rule as the lock itself; n moves on past a claim whose breaker is stale by the
   lock's own rule (a dead process here, or older than `stale_after`);
2. re-inspect the lock after claiming: if it is no longer the inspected one, someone broke it
   already; drop the claim and start over;
3. rename the lock to a unique name, check that the renamed file is still the inspected one,
   delete it, then delete the claims.

Why one winner: the lock name changes only by a holder's release, by a link onto a free name, or
by a breaker's rename. For a given stale lock L, claims on L are unique while they exist and are
deleted only after L is gone, so of all live breakers that saw L at most one holds a claim while
L is still in place, and step 2 stops every later one (a lock's content carries a fresh random token,
so a new lock never looks like L). Between a winner's step 2 and its rename nothing can remove
L, so the rename takes L and nothing else.

Assumptions (local disk and NFSv2 onwards alike; nothing needs flock, lockd/NLM or O_EXCL):
link(2) fails with EEXIST when the name exists and rename(2) replaces or moves one name
atomically, both decided on the server; open(2) sees the current name (NFS close-to-open); a
process does not stall for `stale_after` seconds between its own steps (a holder or a breaker
judged stale while still running can overlap with the next one: the age rule's price).
See docs/conformance.md "Baselines on a shared file system" for the remaining caveats.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass


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


@dataclass(frozen=True)
class _Seen:
    """One look at a file: identity and holder read through the same open file descriptor."""
    dev: int
    ino: int
    raw: bytes
    mtime: float

    @property
    def holder(self) -> dict:
        try:
            got = json.loads(self.raw)
        except ValueError:
            return {}
        return got if isinstance(got, dict) else {}

    def same_file(self, other: "_Seen | None") -> bool:
        return other is not None and (self.dev, self.ino, self.raw) == (other.dev, other.ino, other.raw)


def _look(path: str) -> _Seen | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return _Seen(st.st_dev, st.st_ino, b"".join(chunks), st.st_mtime)


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
        seen = _look(self.path)
        return seen.holder if seen is not None else {}

    def _stale(self, seen: _Seen) -> bool:
        holder = seen.holder
        if holder.get("host") == self.host and isinstance(holder.get("pid"), int):
            if not _pid_alive(holder["pid"]):
                return True
        return self._server_time() - seen.mtime > self.stale_after

    def _server_time(self) -> float:
        # the directory's clock: touch a probe file and read back its mtime
        probe = f"{self._mine}.now"
        with open(probe, "w"):
            pass
        try:
            return os.stat(probe).st_mtime
        finally:
            os.unlink(probe)

    def _claim_name(self, stale: _Seen, n: int) -> str:
        # content only: every host must derive the same name, and st_dev (and, on clients that
        # squash 64-bit fileids, st_ino) differs between NFS clients of one file
        ident = hashlib.sha256(stale.raw).hexdigest()[:16]
        return f"{self.path}.break.{ident}.{n}"

    def _break(self, stale: _Seen) -> bool:
        """Remove `stale` from the lock name if it is still there and no live breaker is at it
        (the module docstring's steps and why they leave one winner). True once `stale` is gone,
        by us or another breaker; False while another breaker holds the claim."""
        mine = f"{self._mine}.break"
        with open(mine, "w") as f:
            json.dump({"host": self.host, "pid": os.getpid(), "token": self.token}, f)
        claims: list[str] = []  # ours last; the others are stale breakers' claims on `stale`
        gone = False  # claims may go only once `stale` has: till then they keep the winner unique
        try:
            n = 0
            while True:
                name = self._claim_name(stale, n)
                try:
                    os.link(mine, name)
                except OSError:
                    pass  # as in acquire: the link count is the truth
                if os.stat(mine).st_nlink == 2:
                    claims.append(name)
                    break
                other = _look(name)
                if other is None:
                    return True  # its breaker finished and dropped the claim
                if not self._stale(other):
                    return False
                claims.append(name)
                n += 1
            if not stale.same_file(_look(self.path)):
                gone = True  # broken already
                return True
            aside = f"{self.path}.broken.{self.token}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                pass  # an NFS retry whose first try succeeded: the check below reads `aside`
            if not stale.same_file(_look(aside)):
                # unreachable under the module's assumptions; hand back what was taken, if anything
                if os.path.exists(aside):
                    try:
                        os.link(aside, self.path)
                    except OSError:
                        pass
                _unlink(aside)
                raise RuntimeError(f"{self.path}: the lock changed under a claimed break; "
                                   "a process stalled beyond stale_after?")
            _unlink(aside)
            gone = True
            h = stale.holder
            litter = f"{self.path}.{h.get('host')}.{h.get('pid')}.{h.get('token')}"
            if isinstance(h.get("pid"), int) and "/" not in litter[len(self.path):]:
                _unlink(litter)  # the gone holder's unique file; the name check keeps us in this dir
            return True
        finally:
            for name in claims if gone else ():
                _unlink(name)
            _unlink(mine)

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
                seen = _look(self.path)
                if seen is None:
                    continue  # released between our link and our look
                holder = seen.holder
                if self._stale(seen) and self._break(seen):
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
