"""The power-cut disk's rules, without FUSE: a Hypothesis state machine against a plain model.

The reference keeps each file's bytes as processes see them and as they were at its last
fsync, and the root directory's entries as they were at its last fsync (plus a new file's
name when the file itself was fsynced). After any cut the disk must show exactly that.
"""

from __future__ import annotations

import errno

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.powercut.disk import PAGE, Disk, DiskError, File, FileData

NAMES = st.sampled_from(["a", "b", "c", "d"])
OFFSETS = st.integers(0, 3 * PAGE)
DATA = st.binary(min_size=1, max_size=PAGE + 100)


class DiskMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.disk = Disk()
        self.seen: dict[int, bytes] = {}  # ino -> bytes as read now
        self.synced: dict[int, bytes] = {}  # ino -> bytes at its last fsync
        self.names: dict[str, int] = {}  # root entries now
        self.durable_names: dict[str, int] = {}  # root entries that survive a cut

    def _file(self, name: str) -> File:
        node = self.disk.lookup("/" + name)
        assert isinstance(node, File)
        return node

    @rule(name=NAMES)
    def create(self, name: str) -> None:
        if name in self.names:
            with pytest.raises(DiskError) as raised:
                self.disk.create("/" + name)
            assert raised.value.errno == errno.EEXIST
            return
        node = self.disk.create("/" + name)
        self.names[name] = node.ino
        self.seen[node.ino] = self.synced[node.ino] = b""

    @precondition(lambda self: self.names)
    @rule(data=st.data(), offset=OFFSETS, chunk=DATA)
    def write(self, data: st.DataObject, offset: int, chunk: bytes) -> None:
        name = data.draw(st.sampled_from(sorted(self.names)))
        self._file(name).data.write(offset, chunk)
        old = self.seen[self.names[name]]
        old = old.ljust(offset, b"\0")
        self.seen[self.names[name]] = old[:offset] + chunk + old[offset + len(chunk) :]

    @precondition(lambda self: self.names)
    @rule(data=st.data(), length=OFFSETS)
    def truncate(self, data: st.DataObject, length: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.names)))
        self._file(name).data.truncate(length)
        ino = self.names[name]
        self.seen[ino] = self.seen[ino][:length].ljust(length, b"\0")

    @precondition(lambda self: self.names)
    @rule(data=st.data())
    def fsync_file(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.names)))
        ino = self.names[name]
        self.disk.fsync(self._file(name))
        self.synced[ino] = self.seen[ino]
        if ino not in self.durable_names.values():  # a new file's fsync persists its name
            self.durable_names[name] = ino

    @rule()
    def fsync_root(self) -> None:
        self.disk.fsync(self.disk.root)
        self.durable_names = dict(self.names)

    @precondition(lambda self: self.names)
    @rule(data=st.data(), new=NAMES)
    def rename(self, data: st.DataObject, new: str) -> None:
        old = data.draw(st.sampled_from(sorted(self.names)))
        self.disk.rename("/" + old, "/" + new)
        self.names[new] = self.names.pop(old)

    @precondition(lambda self: self.names)
    @rule(data=st.data())
    def unlink(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.names)))
        self.disk.unlink("/" + name)
        del self.names[name]

    @rule()
    def cut(self) -> None:
        self.disk.cut()
        self.names = dict(self.durable_names)
        for ino in self.names.values():
            self.seen[ino] = self.synced[ino]

    @invariant()
    def reads_see_every_write(self) -> None:
        assert self.disk.listdir("/") == sorted(self.names)
        for name, ino in self.names.items():
            node = self._file(name)
            assert node.ino == ino
            assert node.data.read(0, node.data.size + 10) == self.seen[ino]


TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_cut_drops_what_was_written_after_the_last_fsync() -> None:
    data = FileData()
    data.write(0, b"x" * (PAGE + 10))
    data.sync()
    data.truncate(5)
    data.write(PAGE * 2, b"tail")
    assert data.read(0, PAGE * 3) == b"xxxxx" + bytes(PAGE * 2 - 5) + b"tail"
    data.drop()
    assert data.read(0, PAGE * 3) == b"x" * (PAGE + 10)


def test_a_subdirectory_made_durable_by_a_files_fsync_keeps_only_that_file() -> None:
    disk = Disk()
    disk.mkdir("/store")
    kept = disk.create("/store/block")
    disk.create("/store/other")
    kept.data.write(0, b"acked")
    disk.fsync(kept)  # as nats-server fsyncs a new message block, not its directory
    disk.cut()
    assert disk.listdir("/") == ["store"]
    assert disk.listdir("/store") == ["block"]
    node = disk.lookup("/store/block")
    assert isinstance(node, File) and node.data.read(0, 100) == b"acked"
