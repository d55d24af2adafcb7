"""A block store in a directory (a local disk or a shared file system), safe for many processes.

Layout: <root>/<key[:2]>/<key[2:4]>/<key>.kv2, key = hex sha256(fingerprint || chained block hash),
so a file's name is its content address and nothing but the bytes needs coordinating:
- writes go to a private temp file in the same directory and are renamed into place (atomic on
  POSIX file systems): a reader sees the old file, the new one or none, never a torn one; two
  writers of one key write the same KV, and the last rename wins;
- a file's mtime is its last use (set on write and on every hit), so retention (TTL, default 72 h)
  and the size cap (least recently used first) are decided from the directory alone, by any process;
- a read takes the header and only the sections (cache groups) asked for, each verified
  (block_file.read); a corrupt or truncated file at our address is deleted, a foreign one
  (another fingerprint) is left alone; either way the caller recomputes.
An unusable directory or a full disk logs a warning and turns into misses, never an exception.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import queue
import socket
import threading
import time
import uuid
import weakref

import torch

from shuili.core.kv_tiers.block_file import VERSION, BlockFileError, encode, read

log = logging.getLogger("shuili.kv_tiers")
SUFFIX = f".kv{VERSION}"  # a new file format gets new names: engines of two versions share a directory
OLD_SUFFIXES = (".kv",)  # earlier formats: never read, still swept (TTL, size cap)
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0  # a temp file this old belongs to a writer that died
QUEUE_BYTES = 1 << 30  # host copies waiting for the writer; past this, blocks are dropped, not queued


class DiskStore:
    name = "disk"

    def __init__(self, root: str, fingerprint: str, ttl_s: float = 72 * 3600.0, max_bytes: int | None = None,
                 clock=time.time, background: bool = True):
        if ttl_s <= 0:
            raise ValueError(f"kv_store_ttl must be > 0 seconds, got {ttl_s}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"kv_store_bytes must be >= 0, got {max_bytes}")
        self.root = os.path.abspath(root)
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.writer = f"{socket.gethostname()}:{os.getpid()}"
        self.counts = {"hits": 0, "misses": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0,
                       "write_failures": 0, "rejected_corrupt": 0, "rejected_truncated": 0,
                       "rejected_foreign": 0, "evicted_ttl": 0, "evicted_size": 0}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._since_gc = 0
        self._queued_bytes = 0
        self.usable = self._prepare()
        self._queue: queue.Queue | None = None
        if background and self.usable:
            self._queue = queue.Queue()
            threading.Thread(target=self._drain, name="shuili-kv-store", daemon=True).start()
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref().flush())

    # ------------------------------------------------------------------------------ helpers
    def _warn(self, what: str, msg: str) -> None:
        if what not in self._warned:  # a broken directory would otherwise log every block
            self._warned.add(what)
            log.warning("kv store %s: %s; affected blocks are recomputed", self.root, msg)

    def _prepare(self) -> bool:
        try:
            os.makedirs(self.root, exist_ok=True)
            return os.access(self.root, os.W_OK | os.X_OK)
        except OSError as exc:
            self._warn("open", f"cannot use the directory ({exc.strerror})")
            return False

    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key[2:4], key + SUFFIX)

    def _count(self, k: str, n: int = 1) -> None:
        with self._lock:
            self.counts[k] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    # -------------------------------------------------------------------------------- reads
    def contains(self, key: str) -> bool:
        if not self.usable:
            return False
        try:
            return self.clock() - os.stat(self.path(key)).st_mtime <= self.ttl_s
        except OSError:
            return False

    def get(self, key: str, expect: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor] | None:
        if not self.usable:
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                fd = f.fileno()
                st = os.fstat(fd)
                if self.clock() - st.st_mtime > self.ttl_s:
                    self._count("misses")  # expired: the next sweep deletes it
                    return None
                # the header, then only the sections asked for (a rename over the name meanwhile
                # does not matter: this descriptor keeps reading the one file it opened)
                blocks, nread = read(lambda view, off: os.preadv(fd, [view], off), st.st_size, key,
                                     self.fingerprint, expect)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._warn("read", f"cannot read {path} ({exc.strerror})")
            self._count("misses")
            return None
        except BlockFileError as exc:
            self._reject(path, st, exc)
            return None
        self._count("hits")
        self._count("bytes_read", nread)
        self._touch(path)
        return blocks

    def _reject(self, path: str, st: os.stat_result, exc: BlockFileError) -> None:
        self._count("rejected_" + exc.kind)
        self._count("misses")
        ours = exc.kind != "foreign"
        log.warning("kv store: rejected %s (%s); %s, the prefix is recomputed", path, exc,
                    "deleted it" if ours else "left it (another fingerprint's file)")
        if ours:
            try:  # only the file we read: a writer may have renamed a good one into place since
                if os.stat(path).st_ino == st.st_ino:
                    os.unlink(path)
            except OSError:
                pass

    def _touch(self, path: str) -> None:
        now = self.clock()
        try:
            os.utime(path, (now, now))
        except OSError:
            pass  # swept by another process meanwhile: the read already succeeded

    # ------------------------------------------------------------------------------- writes
    def put(self, key: str, chain_hash: bytes, blocks: dict[str, torch.Tensor], ready=None) -> None:
        if not self.usable:
            return
        if self.contains(key):
            self._touch(self.path(key))  # another engine wrote it: it is in use again
            return
        if self._queue is None:
            self._write(key, chain_hash, blocks, ready)
            return
        size = sum(t.numel() * t.element_size() for t in blocks.values())
        with self._lock:
            full = self._queued_bytes + size > QUEUE_BYTES
            if not full:
                self._queued_bytes += size
        if full:
            self._warn("queue", "the writer is behind; dropping blocks instead of stalling the engine")
            return
        self._queue.put((key, chain_hash, blocks, ready, size))

    def _drain(self) -> None:
        while True:
            *item, size = self._queue.get()
            try:
                self._write(*item)
            except Exception:  # the writer must outlive any one bad block
                log.exception("kv store: writing a block failed")
            finally:
                with self._lock:
                    self._queued_bytes -= size
                self._queue.task_done()

    def _write(self, key: str, chain_hash: bytes, blocks: dict[str, torch.Tensor], ready) -> None:
        if ready is not None:
            ready.synchronize()
        now = self.clock()
        data = encode(key, self.fingerprint, chain_hash, blocks, now, self.writer)
        path = self.path(key)
        tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.utime(tmp, (now, now))
            os.replace(tmp, path)
        except OSError as exc:
            self._count("write_failures")
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._warn("full" if full else "write", "the disk is full" if full else
                       f"cannot write ({exc.strerror})")
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self._count("writes")
        self._count("bytes_written", len(data))
        with self._lock:
            self._since_gc += len(data)
            sweep = self.max_bytes is not None and self._since_gc > self.max_bytes // 8
        if sweep:
            self.gc()

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        self.flush()

    # ---------------------------------------------------------------------------- retention
    def _files(self):
        for d1 in _scandir(self.root):
            if not d1.is_dir(follow_symlinks=False):
                continue
            for d2 in _scandir(d1.path):
                if d2.is_dir(follow_symlinks=False):
                    yield from _scandir(d2.path)

    def gc(self) -> dict[str, int]:
        """Delete expired blocks (mtime older than the TTL), then the least recently used until the
        directory holds at most max_bytes; also dead writers' temp files. Any process may run it."""
        now, live, out = self.clock(), [], {"ttl": 0, "size": 0, "tmp": 0}
        with self._lock:
            self._since_gc = 0
        for e in self._files():
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if e.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S and _unlink(e.path):
                    out["tmp"] += 1
            elif e.name.endswith(SUFFIX) or e.name.endswith(OLD_SUFFIXES):
                if now - st.st_mtime > self.ttl_s:
                    out["ttl"] += _unlink(e.path)
                else:
                    live.append((st.st_mtime, st.st_size, e.path))
        if self.max_bytes is not None:
            total = sum(s for _, s, _ in live)
            for _, size, path in sorted(live):
                if total <= self.max_bytes:
                    break
                if _unlink(path):
                    out["size"] += 1
                total -= size
        self._count("evicted_ttl", out["ttl"])
        self._count("evicted_size", out["size"])
        return out

    def size_bytes(self) -> int:
        return sum(e.stat().st_size for e in self._files()
                   if e.name.endswith(SUFFIX) or e.name.endswith(OLD_SUFFIXES))


def _scandir(path: str):
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
