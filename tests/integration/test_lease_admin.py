"""`txactors lease list` (txactors.ops.leases): who owns which partition, read from the
TXN_LEASE bucket of a real coordinator, and what is left once it gave its leases back."""

from __future__ import annotations

import io
import time

import pytest
from nats.aio.client import Client
from rich.console import Console

from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.ops import leases as lease_admin


def _text(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


async def test_owners_revisions_and_expiry_then_free_after_a_clean_stop(
    private_nc: Client,
) -> None:
    with pytest.raises(lease_admin.NoLeases, match="no coordinator"):
        await lease_admin.list_leases(private_nc)
    options = CoordinatorOptions(partitions=3, lease_ttl=10.0)
    async with run_coordinator(private_nc, options=options, owner="coord-a"):
        table = await lease_admin.list_leases(private_nc, partitions=4)
        now = time.time()
        assert table.ttl == 10.0
        assert [(lease.partition, lease.owner) for lease in table.leases] == [
            (0, "coord-a"),
            (1, "coord-a"),
            (2, "coord-a"),
            (3, None),
        ]
        for lease in table.leases[:3]:
            assert lease.revision is not None and lease.renewed_at is not None
            assert now - 10 < lease.renewed_at <= now + 1
            assert lease.expires_at == pytest.approx(lease.renewed_at + 10.0)
        [member] = table.members
        assert (member.owner, member.held, member.share, member.partitions) == ("coord-a", 3, 3, 3)
        shown = _text(lease_admin.render_leases(table, now=now))
        assert "3 partition(s) held by 1 coordinator(s)" in shown and "free" in shown
        assert "1 live coordinator(s)" in shown and "3 / 3" in shown
        assert [
            lease.partition for lease in (await lease_admin.list_leases(private_nc)).leases
        ] == [
            0,
            1,
            2,
        ], "without --partitions: the keys in the bucket"
    after = await lease_admin.list_leases(private_nc)
    assert [lease.owner for lease in after.leases] == [None, None, None], "given back"
    assert after.members == [], "withdrawn"


def test_an_expired_lease_is_shown_as_such() -> None:
    table = lease_admin.LeaseTable(
        ttl=10.0,
        leases=[
            lease_admin.LeaseInfo(
                partition=0, owner="gone", revision=7, renewed_at=100.0, expires_at=110.0
            )
        ],
    )
    shown = _text(lease_admin.render_leases(table, now=125.0))
    assert "gone" in shown and "25s ago" in shown and "expired" in shown
