"""A disk that keeps only what was fsynced: the pure model behind the power-cut filesystem.

No I/O here (the FUSE glue in `fusefs.py` serves it), so its rules are tested on their own.
Processes see every write at once, as through a page cache; a `cut()` keeps only the
durable image, as a power cut or a kernel crash does. What becomes durable, and when:

- a file's bytes: on `fsync(file)` (fsync and fdatasync alike), or at once for a handle
  opened with O_SYNC/O_DSYNC (the glue calls `fsync` after each such write);
- a directory's entries (creates, renames, unlinks in it): on `fsync(dir)`;
- a file or directory that has no durable name yet also gets its current path when it is
  fsynced, as ext4, XFS and btrfs do for a new file. nats-server relies on that: it fsyncs
  a new message block but not the directory that holds it. A renamed file does not carry
  its new name this way: that takes the directory's fsync (SQLite's rollback journal and
  nats-server's atomic index writes do it).

A file's bytes are pages: a durable image and a dirty overlay, so an fsync costs what was
written since the last one, not the file's size.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import time
from collections.abc import Iterator

PAGE = 4096
_ZERO_PAGE = bytes(PAGE)


class DiskError(OSError):
    """What the matching system call would fail with (the glue passes the errno on)."""


def _error(code: int, path: str) -> DiskError:
    return DiskError(code, os.strerror(code), path)


class FileData:
    """A file's bytes: the durable image (pages and size) under a dirty overlay."""

    def __init__(self) -> None:
        self._durable: dict[int, bytes] = {}
        self._durable_size = 0
        self._dirty: dict[int, bytes | None] = {}  # None: a page a truncate zeroed
        self.size = 0

    def _page(self, index: int) -> bytes:
        if index in self._dirty:
            return self._dirty[index] or _ZERO_PAGE
        return self._durable.get(index, _ZERO_PAGE)

    def read(self, offset: int, size: int) -> bytes:
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        chunks = []
        for index in range(offset // PAGE, (end - 1) // PAGE + 1):
            start = max(offset, index * PAGE) - index * PAGE
            stop = min(end, (index + 1) * PAGE) - index * PAGE
            chunks.append(self._page(index)[start:stop])
        return b"".join(chunks)

    def write(self, offset: int, data: bytes) -> None:
        position = 0
        while position < len(data):
            index, start = divmod(offset + position, PAGE)
            take = min(PAGE - start, len(data) - position)
            page = bytearray(self._page(index))
            page[start : start + take] = data[position : position + take]
            self._dirty[index] = bytes(page)
            position += take
        self.size = max(self.size, offset + len(data))

    def truncate(self, length: int) -> None:
        if length < self.size:
            last = -(-length // PAGE)  # the first page wholly past the new end
            for index in {*self._durable, *self._dirty}:
                if index >= last:
                    self._dirty[index] = None
            if length % PAGE:
                index = length // PAGE
                page = self._page(index)
                self._dirty[index] = page[: length % PAGE] + bytes(PAGE - length % PAGE)
        self.size = length

    def sync(self) -> None:
        """The overlay becomes the durable image."""
        for index, page in self._dirty.items():
            if page is None:
                self._durable.pop(index, None)
            else:
                self._durable[index] = page
        self._dirty.clear()
        self._durable_size = self.size

    def drop(self) -> None:
        """A cut: the overlay is gone."""
        self._dirty.clear()
        self.size = self._durable_size


class Node:
    """A file or a directory; `ino` stays the same across cuts."""

    def __init__(self, ino: int, mode: int) -> None:
        self.ino = ino
        self.mode = mode
        self.mtime_ns = time.time_ns()
        self.durable_names = 0
        """How many durable directory entries name this node (0: it is new)."""
        self.parent: Dir | None = None
        """Where it was last linked (None for the root), with `name`: its current path, if
        that entry still names it."""
        self.name = ""

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class File(Node):
    def __init__(self, ino: int, mode: int) -> None:
        super().__init__(ino, stat.S_IFREG | stat.S_IMODE(mode))
        self.data = FileData()


class Dir(Node):
    def __init__(self, ino: int, mode: int) -> None:
        super().__init__(ino, stat.S_IFDIR | stat.S_IMODE(mode))
        self.entries: dict[str, Node] = {}
        self.durable: dict[str, Node] = {}

    def set_durable(self, name: str, node: Node | None) -> None:
        old = self.durable.pop(name, None)
        if old is not None:
            old.durable_names -= 1
        if node is not None:
            self.durable[name] = node
            node.durable_names += 1


class Disk:
    """The whole filesystem; paths are absolute and `/`-separated, as FUSE passes them."""

    def __init__(self) -> None:
        self._inos = itertools.count(1)
        self.root = Dir(next(self._inos), 0o755)
        self.root.durable_names = 1  # the root is always there
        self.cuts = 0

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, path: str) -> Node:
        node: Node = self.root
        for part in _parts(path):
            if not isinstance(node, Dir) or part not in node.entries:
                raise _error(errno.ENOENT, path)
            node = node.entries[part]
        return node

    def _dir(self, path: str) -> Dir:
        node = self.lookup(path)
        if not isinstance(node, Dir):
            raise _error(errno.ENOTDIR, path)
        return node

    def _split(self, path: str) -> tuple[Dir, str]:
        parts = _parts(path)
        if not parts:
            raise _error(errno.EBUSY, path)  # the root itself
        return self._dir("/" + "/".join(parts[:-1])), parts[-1]

    def listdir(self, path: str) -> list[str]:
        return sorted(self._dir(path).entries)

    # -- namespace changes (current only, until a directory fsync) --------------------------

    def create(self, path: str, mode: int = 0o644) -> File:
        parent, name = self._split(path)
        if name in parent.entries:
            raise _error(errno.EEXIST, path)
        node = File(next(self._inos), mode)
        self._link(parent, name, node)
        return node

    def mkdir(self, path: str, mode: int = 0o755) -> Dir:
        parent, name = self._split(path)
        if name in parent.entries:
            raise _error(errno.EEXIST, path)
        node = Dir(next(self._inos), mode)
        self._link(parent, name, node)
        return node

    def unlink(self, path: str) -> None:
        parent, name = self._split(path)
        node = parent.entries.get(name)
        if node is None:
            raise _error(errno.ENOENT, path)
        if node.is_dir:
            raise _error(errno.EISDIR, path)
        del parent.entries[name]

    def rmdir(self, path: str) -> None:
        parent, name = self._split(path)
        node = parent.entries.get(name)
        if not isinstance(node, Dir):
            raise _error(errno.ENOENT if node is None else errno.ENOTDIR, path)
        if node.entries:
            raise _error(errno.ENOTEMPTY, path)
        del parent.entries[name]

    def rename(self, old: str, new: str) -> None:
        old_parent, old_name = self._split(old)
        new_parent, new_name = self._split(new)
        node = old_parent.entries.get(old_name)
        if node is None:
            raise _error(errno.ENOENT, old)
        target = new_parent.entries.get(new_name)
        if target is node:
            return
        if target is not None:
            if node.is_dir != target.is_dir:
                raise _error(errno.EISDIR if target.is_dir else errno.ENOTDIR, new)
            if isinstance(target, Dir) and target.entries:
                raise _error(errno.ENOTEMPTY, new)
        if isinstance(node, Dir) and _inside(new_parent, node):
            raise _error(errno.EINVAL, new)  # into itself
        del old_parent.entries[old_name]
        self._link(new_parent, new_name, node)

    def _link(self, parent: Dir, name: str, node: Node) -> None:
        parent.entries[name] = node
        node.parent, node.name = parent, name

    # -- durability -----------------------------------------------------------------------

    def fsync(self, node: Node) -> None:
        """fsync(2) of `node`: see the module docstring for what it makes durable."""
        if isinstance(node, File):
            node.data.sync()
        else:
            assert isinstance(node, Dir)
            for name in {*node.entries, *node.durable}:
                if node.durable.get(name) is not node.entries.get(name):
                    node.set_durable(name, node.entries.get(name))
        if node.durable_names == 0:
            self._persist_path(node)

    def _persist_path(self, node: Node) -> None:
        while node.durable_names == 0:
            parent = node.parent
            if parent is None or parent.entries.get(node.name) is not node:
                return  # unlinked since: there is no current path to persist
            parent.set_durable(node.name, node)
            node = parent

    def cut(self) -> None:
        """The power is cut: every directory and file goes back to its durable image."""
        self.cuts += 1
        reachable: list[Node] = []
        stack: list[Dir] = [self.root]
        while stack:
            directory = stack.pop()
            reachable.append(directory)
            directory.entries = dict(directory.durable)
            for name, node in directory.entries.items():
                self._link(directory, name, node)
                if isinstance(node, Dir):
                    stack.append(node)
                else:
                    reachable.append(node)
        for node in reachable:
            node.durable_names = 0
            if isinstance(node, File):
                node.data.drop()
        for node in reachable:
            if isinstance(node, Dir):
                for child in node.durable.values():
                    child.durable_names += 1
        self.root.durable_names = 1

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Every current path and its node, the root first."""
        stack: list[tuple[str, Node]] = [("/", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if isinstance(node, Dir):
                base = path.rstrip("/")
                stack.extend((f"{base}/{name}", child) for name, child in node.entries.items())


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part]


def _inside(directory: Dir, ancestor: Dir) -> bool:
    node: Dir | None = directory
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False
