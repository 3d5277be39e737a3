"""How partitions spread over the live coordinators: pure, so every member computes the same.

Each coordinator announces itself (a `member.<owner>` key of TXN_LEASE, see leases.py) with its
`max_partitions`. From one view of the bucket (who is a member, who holds which partition) every
member computes the same shares: the partitions are dealt out evenly, each member's share capped
by its `max_partitions`; when they do not divide evenly, the extra ones go to the members that
hold the most already (then by owner id), so a balanced split is left as it is. A member above
its share hands its surplus over, a few at a time; one below takes free partitions.

Which partitions, among those it may take or must give, is where a member's server counts:
a partition whose log stream is led by the server the member is connected to (`near`) is
taken first and given last, so that its writes take no hop between servers (and one server's
loss pauses both together, not either).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

MEMBER_PREFIX = "member."
"""Member keys of the lease bucket: `member.<owner>`; partition keys are plain numbers."""


class MemberInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a member key: what the others need to compute its share."""

    partitions: int
    """Its `--partitions` (members should agree; `txactors lease list` shows it)."""
    max_partitions: int
    server: str | None = None
    """The NATS server it is connected to, as of its last renewal (`txactors partitions
    list` compares it with its logs' leaders); None from a coordinator older than the field."""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """One rebalancing step of one member."""

    share: int
    give: tuple[int, ...] = ()
    """Partitions to hand over now (stop serving, give the lease back)."""
    take: tuple[int, ...] = ()
    """Partitions worth trying to take (free, or held by no live member), in order; take at
    most `share - len(owned)` of them."""


def shares(partitions: int, caps: Mapping[str, int], held: Mapping[str, int]) -> dict[str, int]:
    """Each member's share: `partitions` dealt out evenly under each member's cap.

    `caps` maps the live members to their `max_partitions`, `held` to how many they hold now.
    The sum is min(partitions, sum of caps); no two shares differ by more than one unless a cap
    forces it.
    """
    order = sorted(caps, key=lambda member: (-held.get(member, 0), member))
    result = dict.fromkeys(order, 0)
    remaining = partitions
    open_ = [member for member in order if caps[member] > 0]
    while remaining and open_:
        base, extra = divmod(remaining, len(open_))
        for index, member in enumerate(open_):
            given = min(base + (1 if index < extra else 0), caps[member] - result[member])
            result[member] += given
            remaining -= given
        open_ = [member for member in open_ if result[member] < caps[member]]
    return result


def plan(
    *,
    me: str,
    partitions: int,
    members: Mapping[str, MemberInfo],
    holders: Mapping[int, str],
    owned: frozenset[int],
    batch: int,
    near: frozenset[int] = frozenset(),
) -> Plan:
    """What `me` should do now, from a view of the bucket (`holders`: partition → owner).

    `owned` (what `me` holds by its own account) overrides the view for `me`. Surplus is
    handed over only to the extent other members are under their share by more than what is
    free already (someone will take it), highest partitions first, and while fewer than
    `batch` are free: at most `batch` partitions are in transit (served by nobody) at a time.
    Partitions in `near` (their log led by `me`'s server) are given last and taken first.
    """
    caps = {member: info.max_partitions for member, info in members.items()}
    if me not in caps:
        raise ValueError(f"{me} is not among the members")
    held: dict[str, int] = {}
    for partition, holder in holders.items():
        if holder in caps and holder != me and partition not in owned:
            held[holder] = held.get(holder, 0) + 1
    held[me] = len(owned)
    dealt = shares(partitions, caps, held)
    share = dealt[me]
    free = tuple(
        sorted(
            (
                p
                for p in range(partitions)
                if p not in owned and (holders.get(p) is None or holders[p] not in caps)
            ),
            key=lambda p: (p not in near, p),
        )
    )
    if len(owned) > share:
        wanted = sum(max(0, dealt[m] - held.get(m, 0)) for m in caps if m != me)
        count = max(0, min(len(owned) - share, batch - len(free), wanted - len(free)))
        surplus = sorted(owned, key=lambda p: (p in near, -p))
        return Plan(share=share, give=tuple(surplus[:count]))
    if len(owned) < share:
        return Plan(share=share, take=free)
    return Plan(share=share)
