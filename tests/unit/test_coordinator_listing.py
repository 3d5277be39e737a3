"""Which transactions a ListTransactions selects, without a server
(coordinator/partition/listing.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from txactors.coordinator.core.states import TxnState
from txactors.coordinator.core.transactions import TxnView
from txactors.coordinator.partition.listing import select
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions

NOW = 10_000.0
GROUPS = st.sampled_from(["g", "billing", "shop"])
TOPICS = st.sampled_from(["orders", "payments", "mail"])

views = st.lists(
    st.builds(
        TxnView,
        txid=st.uuids().map(str),
        state=st.sampled_from(list(TxnState)),
        group=GROUPS,
        producer=st.just("p1"),
        topics=st.lists(TOPICS, min_size=1, max_size=3, unique=True).map(tuple),
        half_seqs=st.just((1,)),
        born=st.floats(0, NOW),
        check_times=st.just(0),
        last_check=st.none(),
        next_check_at=st.none(),
        discard_reason=st.none(),
    ),
    max_size=30,
)
queries = st.builds(
    ListTransactions,
    states=st.lists(st.sampled_from([s.value for s in TxnState]), max_size=3),
    group=st.none() | GROUPS,
    topic=st.none() | TOPICS,
    older_than=st.none() | st.floats(0, NOW),
    limit=st.none() | st.integers(1, 40),
)


def matches(view: TxnView, query: ListTransactions) -> bool:
    checks = [
        not query.states or view.state.value in query.states,
        query.group in (None, view.group),
        query.topic is None or query.topic in view.topics,
        query.older_than is None or NOW - view.born >= query.older_than,
    ]
    return all(checks)


@given(views, queries)
def test_select_keeps_order_and_counts_what_the_limit_left_out(
    table: list[TxnView], query: ListTransactions
) -> None:
    chosen, more = select(table, query, NOW)
    wanted = [view for view in table if matches(view, query)]
    assert chosen == wanted[: len(chosen)], "the first matches, in the table's order"
    assert len(chosen) + more == len(wanted)
    if query.limit is None:
        assert more == 0
    else:
        assert len(chosen) == min(query.limit, len(wanted))


def test_every_filter_narrows() -> None:
    def view(txid: str, group: str, topics: tuple[str, ...], born: float) -> TxnView:
        return TxnView(
            txid=txid,
            state=TxnState.DISCARDED if txid.startswith("d") else TxnState.PREPARED,
            group=group,
            producer="p1",
            topics=topics,
            half_seqs=(1,),
            born=born,
            check_times=0,
            last_check=None,
            next_check_at=None,
            discard_reason=None,
        )

    table = [
        view("d1", "g", ("orders",), 100.0),
        view("p1", "g", ("orders", "payments"), 9_000.0),
        view("d2", "billing", ("payments",), 9_500.0),
    ]

    def txids(**query: Any) -> list[str]:
        return [
            v.txid
            for v in select(table, ListTransactions(**query, version=PROTOCOL_VERSION), NOW)[0]
        ]

    assert txids() == ["d1", "p1", "d2"]
    assert txids(states=["discarded"]) == ["d1", "d2"]
    assert txids(group="g") == ["d1", "p1"]
    assert txids(topic="payments") == ["p1", "d2"]
    assert txids(older_than=1000.0) == ["d1", "p1"]
    assert txids(older_than=1000.0, topic="payments", group="g", states=["prepared"]) == ["p1"]
