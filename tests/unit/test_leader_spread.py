"""The plan that spreads the log streams' leaders over the nodes (coordinator/cluster/leaders.py):
at most ceil(streams / nodes) each, fewest moves, only to current replicas; compared with a
brute-force search on every small view Hypothesis finds."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from txactors.coordinator.cluster.leaders import Move, leader_cap, plan_moves
from txactors.coordinator.cluster.placement import (
    LogPlacement,
    Replica,
    leader_counts,
    plan_spread,
    takes_preferred,
)

NODES = ("n1", "n2", "n3")


def loads(leaders: dict[str, str], moves: list[Move]) -> Counter[str]:
    after = dict(leaders)
    for move in moves:
        assert after[move.stream] == move.source
        after[move.stream] = move.target
    return Counter(after.values())


def test_six_logs_piled_on_one_of_three_nodes_move_four_leaders() -> None:
    leaders = {f"TXN_LOG_{p}": "n1" for p in range(6)}
    moves = plan_moves(leaders, dict.fromkeys(leaders, NODES), NODES)
    assert len(moves) == 4
    assert loads(leaders, moves) == {"n1": 2, "n2": 2, "n3": 2}


def test_after_a_node_returns_the_survivors_hand_it_its_share() -> None:
    leaders = {f"TXN_LOG_{p}": ("n1", "n2")[p % 2] for p in range(6)}
    moves = plan_moves(leaders, dict.fromkeys(leaders, NODES), NODES)
    assert len(moves) == 2 and {m.target for m in moves} == {"n3"}
    assert {m.source for m in moves} == {"n1", "n2"}


def test_an_even_spread_is_left_alone() -> None:
    leaders = {"A": "n1", "B": "n2", "C": "n3", "D": "n1"}
    assert plan_moves(leaders, dict.fromkeys(leaders, NODES), NODES) == []


def test_a_leader_moves_only_to_a_current_replica() -> None:
    # n3 is behind on every stream: nothing may move to it, and n1, n2 split the rest evenly.
    leaders = dict.fromkeys(("A", "B", "C", "D"), "n1")
    moves = plan_moves(leaders, dict.fromkeys(leaders, ("n1", "n2")), NODES)
    assert all(m.target == "n2" for m in moves)
    assert loads(leaders, moves) == {"n1": 2, "n2": 2}


def test_a_chain_of_moves_where_no_single_one_helps() -> None:
    # n1 leads A and B, which only n2 may also lead; n2 leads C, which n3 may lead.
    leaders = {"A": "n1", "B": "n1", "C": "n2"}
    eligible = {"A": ("n1", "n2"), "B": ("n1", "n2"), "C": ("n2", "n3")}
    moves = plan_moves(leaders, eligible, NODES)
    assert loads(leaders, moves) == {"n1": 1, "n2": 1, "n3": 1}
    assert len(moves) == 2


def test_no_nodes_no_moves() -> None:
    assert plan_moves({"A": "n1"}, {"A": ("n1",)}, ()) == []


def brute_force(
    leaders: dict[str, str],
    eligible: dict[str, tuple[str, ...]],
    nodes: tuple[str, ...],
    owners: dict[str, str] | None = None,
) -> tuple[int, int, int]:
    """(the lowest cap any assignment meets, the fewest moves that meet it, the fewest
    streams then led away from their owners' node)."""
    owners = owners or {}
    streams = sorted(leaders)
    choices = [
        sorted((set(eligible[s]) | {leaders[s]}) & set(nodes)) or [leaders[s]] for s in streams
    ]
    counted = sum(1 for s in streams if leaders[s] in nodes)
    best: tuple[int, int, int] | None = None
    for assignment in itertools.product(*choices):
        load = Counter(n for n in assignment if n in nodes)
        cap = max(leader_cap(counted, len(nodes)), *load.values(), 0)
        pairs = list(zip(streams, assignment, strict=True))
        moved = sum(1 for s, n in pairs if n != leaders[s])
        away = sum(1 for s, n in pairs if owners.get(s, n) != n)
        if best is None or (cap, moved, away) < best:
            best = (cap, moved, away)
    assert best is not None
    return best


views = st.integers(min_value=1, max_value=4).flatmap(
    lambda size: st.tuples(
        st.just(tuple(f"n{i}" for i in range(1, size + 1))),
        st.lists(
            st.tuples(
                st.sampled_from([f"n{i}" for i in range(1, size + 1)]),
                st.sets(st.sampled_from([f"n{i}" for i in range(1, size + 1)])),
            ),
            max_size=7,
        ),
    )
)


@settings(max_examples=300, deadline=None)
@given(views)
def test_the_plan_is_as_even_and_as_short_as_brute_force_finds(
    view: tuple[tuple[str, ...], list[tuple[str, set[str]]]],
) -> None:
    nodes, rows = view
    leaders = {f"S{i}": leader for i, (leader, _) in enumerate(rows)}
    eligible = {f"S{i}": tuple(sorted(others)) for i, (_, others) in enumerate(rows)}
    moves = plan_moves(leaders, eligible, nodes)
    for move in moves:
        assert move.target in set(eligible[move.stream]) | {leaders[move.stream]}
    cap, fewest, _ = brute_force(leaders, eligible, nodes)
    after = loads(leaders, moves)
    assert max(after.values(), default=0) <= cap
    assert len(moves) == fewest
    assert plan_moves(leaders, eligible, nodes) == moves  # deterministic


@settings(max_examples=300, deadline=None)
@given(views, st.data())
def test_among_the_fewest_moves_the_plan_leaves_the_most_logs_on_their_owners_node(
    view: tuple[tuple[str, ...], list[tuple[str, set[str]]]], data: st.DataObject
) -> None:
    nodes, rows = view
    leaders = {f"S{i}": leader for i, (leader, _) in enumerate(rows)}
    eligible = {f"S{i}": tuple(sorted(others)) for i, (_, others) in enumerate(rows)}
    owners = {s: data.draw(st.sampled_from(nodes)) for s in leaders}
    moves = plan_moves(leaders, eligible, nodes, owners)
    cap, fewest, away = brute_force(leaders, eligible, nodes, owners)
    after = dict(leaders) | {m.stream: m.target for m in moves}
    assert max(loads(leaders, moves).values(), default=0) <= cap
    assert len(moves) == fewest
    assert sum(1 for s, node in after.items() if owners[s] != node) == away


def test_the_leaders_handed_to_a_returning_node_are_of_the_partitions_owned_there() -> None:
    leaders = {f"TXN_LOG_{p}": ("n1", "n2")[p % 2] for p in range(6)}
    owners = {"TXN_LOG_2": "n3", "TXN_LOG_5": "n3"} | {f"TXN_LOG_{p}": "n1" for p in (0, 1, 3, 4)}
    moves = plan_moves(leaders, dict.fromkeys(leaders, NODES), NODES, owners)
    assert sorted((m.stream, m.target) for m in moves) == [("TXN_LOG_2", "n3"), ("TXN_LOG_5", "n3")]


def placement(partition: int, leader: str | None, behind: str | None = None) -> LogPlacement:
    followers = sorted(set(NODES) - {leader})
    return LogPlacement(
        partition=partition,
        stream=f"TXN_LOG_{partition}",
        leader=leader,
        replicas=[Replica(name=name, current=name != behind) for name in followers],
    )


def test_nothing_is_planned_while_a_log_has_a_replica_behind_or_no_leader() -> None:
    piled = [placement(p, "n1") for p in range(5)]
    moves, waiting = plan_spread([*piled, placement(5, "n1", behind="n3")])
    assert moves == [] and waiting is not None and "TXN_LOG_5" in waiting
    moves, waiting = plan_spread([*piled, placement(5, None)])
    assert moves == [] and waiting is not None and "TXN_LOG_5" in waiting
    moves, waiting = plan_spread([*piled, placement(5, "n1")])
    assert waiting is None and len(moves) == 4


def test_logs_not_created_yet_and_single_replica_logs_are_left_out() -> None:
    missing = LogPlacement(partition=1, stream="TXN_LOG_1", missing=True)
    alone = LogPlacement(partition=2, stream="TXN_LOG_2", leader="n1")
    assert plan_spread([placement(0, "n1"), missing, alone]) == ([], None)
    assert leader_counts([placement(0, "n1"), missing, alone]) == {"n1": 2, "n2": 0, "n3": 0}


def test_only_a_server_that_takes_a_preferred_leader_is_asked_to_move_one() -> None:
    assert takes_preferred(2, 11) and takes_preferred(2, 15) and takes_preferred(3, 0)
    assert not takes_preferred(2, 10) and not takes_preferred(0, 0)  # 0.0: unknown
