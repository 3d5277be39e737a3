"""The power-cut disk served over FUSE, and the process that mounts it.

    python -m tests.support.powercut.fusefs MOUNTPOINT

mounts a fresh `Disk`, prints `mounted`, then reads commands on stdin: `cut` unmounts
(every process using the disk must be dead by then: `PowerCut.cut` kills them), drops
what was not fsynced, mounts again and prints `mounted`; `stop` or end of input unmounts
and exits. Unmounting between lives also empties the kernel's caches of the old life.

The binding is mfusepy (ctypes over libfuse 3, maintained; fusepy, its origin, is
unmaintained and libfuse 2 only; pyfuse3 needs trio and a C build). The loop is
single-threaded: each call is short and runs under the GIL anyway, and one thread needs no
locks around the `Disk`.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import mfusepy

from tests.support.powercut.disk import Dir, Disk, DiskError, File, Node

_SYNC_FLAGS = os.O_SYNC | os.O_DSYNC


class PowerCutOps(mfusepy.Operations):  # type: ignore[misc]
    """FUSE calls on a `Disk`; open files are handles to nodes, so an unlinked file
    still open keeps working, as on any POSIX filesystem."""

    use_ns = True

    def __init__(self, disk: Disk) -> None:
        self.disk = disk
        self._handles: dict[int, tuple[Node, bool]] = {}  # fh -> (node, writes are synced)
        self._next_fh = 1

    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is not None:
            config.use_ino = 1  # SQLite tells files apart by inode
            config.hard_remove = 1  # unlink means unlink (no .fuse_hidden renames)
            config.nullpath_ok = 1

    def _node(self, path: str | None, fh: int | None = None) -> Node:
        if fh:
            return self._handles[fh][0]
        if path is None:
            raise DiskError(errno.EBADF, "no path and no handle")
        return self.disk.lookup(path)

    def _open(self, node: Node, flags: int) -> int:
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        self._handles[fh] = (node, bool(flags & _SYNC_FLAGS))
        return fh

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        node = self._node(path, fh)
        size = node.data.size if isinstance(node, File) else 4096
        nlink = (
            2 + sum(isinstance(c, Dir) for c in node.entries.values())
            if isinstance(node, Dir)
            else 1
        )
        return {
            "st_ino": node.ino,
            "st_mode": node.mode,
            "st_nlink": nlink,
            "st_size": size,
            "st_blocks": -(-size // 512),
            "st_blksize": 4096,
            "st_atime": node.mtime_ns,
            "st_mtime": node.mtime_ns,
            "st_ctime": node.mtime_ns,
        }

    def readdir(self, path: str | None, fh: int) -> list[tuple[str, dict[str, int], int]]:
        node = self._node(path, fh)
        if not isinstance(node, Dir):
            raise DiskError(errno.ENOTDIR, path)
        parent = node.parent or node
        entries = [(".", node), ("..", parent), *node.entries.items()]
        # With use_ino each entry needs its inode: readdir(3) skips an entry whose is 0.
        return [(name, {"st_ino": n.ino, "st_mode": n.mode}, 0) for name, n in entries]

    def opendir(self, path: str) -> int:
        return self._open(self.disk.lookup(path), 0)

    def releasedir(self, path: str | None, fh: int) -> int:
        self._handles.pop(fh, None)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self.disk.mkdir(path, mode)
        return 0

    def rmdir(self, path: str) -> int:
        self.disk.rmdir(path)
        return 0

    def create(self, path: str, mode: int, flags: int) -> int:
        return self._open(self.disk.create(path, mode), flags)

    def open(self, path: str, flags: int) -> int:
        node = self.disk.lookup(path)
        if isinstance(node, File) and flags & os.O_TRUNC:
            node.data.truncate(0)
        return self._open(node, flags)

    def release(self, path: str | None, fh: int) -> int:
        self._handles.pop(fh, None)
        return 0

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        node = self._node(path, fh)
        if not isinstance(node, File):
            raise DiskError(errno.EISDIR, path)
        return node.data.read(offset, size)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        node, synced = self._handles[fh]
        if not isinstance(node, File):
            raise DiskError(errno.EISDIR, path)
        node.data.write(offset, data)
        node.mtime_ns = time.time_ns()
        if synced:  # O_SYNC / O_DSYNC: durable before write(2) returns
            self.disk.fsync(node)
        return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        node = self._node(path, fh)
        if not isinstance(node, File):
            raise DiskError(errno.EISDIR, path)
        node.data.truncate(length)
        node.mtime_ns = time.time_ns()
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self.disk.fsync(self._node(path, fh))
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self.disk.fsync(self._node(path, fh))
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0  # close(2) promises nothing durable

    def unlink(self, path: str) -> int:
        self.disk.unlink(path)
        return 0

    def rename(self, old: str, new: str) -> int:
        self.disk.rename(old, new)
        return 0

    def chmod(self, path: str | None, mode: int) -> int:
        node = self._node(path)
        node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
        return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        return 0  # everything belongs to the user who mounted it

    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        self._node(path).mtime_ns = times[1] if times else time.time_ns()
        return 0

    def access(self, path: str, amode: int) -> int:
        self.disk.lookup(path)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 1 << 22,
            "f_bfree": 1 << 21,
            "f_bavail": 1 << 21,
            "f_files": 1 << 20,
            "f_ffree": 1 << 19,
            "f_namemax": 255,
        }


class _FUSE(mfusepy.FUSE):  # type: ignore[misc]
    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        # mfusepy drops the handle of ftruncate(2) here; with nullpath_ok the path is None
        # too (SQLite sizes its -shm file so), so pass the handle on as libfuse 2 did.
        result: int = self.ftruncate(path, length, fip)
        return result


def _serve(disk: Disk, mountpoint: str) -> None:
    _FUSE(
        PowerCutOps(disk),
        mountpoint,
        foreground=True,
        nothreads=True,
        fsname="powercut",
        default_permissions=True,
    )


def _mount(disk: Disk, mountpoint: str) -> threading.Thread:
    thread = threading.Thread(target=_serve, args=(disk, mountpoint), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not os.path.ismount(mountpoint):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"could not mount the power-cut disk on {mountpoint}")
        time.sleep(0.01)  # no event tells of a mount (a FUSE thread, outside any loop)
    return thread


def _unmount(mountpoint: str, thread: threading.Thread) -> None:
    fusermount = shutil.which("fusermount3") or "fusermount"
    deadline = time.monotonic() + 10
    while True:
        done = subprocess.run([fusermount, "-u", mountpoint], capture_output=True, text=True)
        if done.returncode == 0:
            break
        if time.monotonic() > deadline:  # still busy: detach it so this process can end
            subprocess.run([fusermount, "-u", "-z", mountpoint], capture_output=True)
            raise SystemExit(f"the power-cut disk stayed busy: {done.stderr.strip()}")
        time.sleep(0.05)  # busy: try the unmount again
    thread.join(10)


def main(mountpoint: str) -> None:
    disk = Disk()
    while True:
        thread = _mount(disk, mountpoint)
        print("mounted", flush=True)
        command = sys.stdin.readline().strip()
        _unmount(mountpoint, thread)
        if command != "cut":
            return
        disk.cut()


if __name__ == "__main__":
    main(sys.argv[1])
