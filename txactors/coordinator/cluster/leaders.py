"""Which log stream leaders to move so the nodes lead about as many partitions each: pure.

JetStream elects a stream's leader among its replicas and leaves it there: a cluster of 3
creating 6 R3 logs put 3 on one node, 3 on another and none on the third, and after a node
restarts every leader sits on the survivors. Kafka's controller moves leadership back
(`auto.leader.rebalance.enable`), `nats stream cluster balance` does it by hand; this says
what to move, the caller (`placement.py`) moves it with a stepdown naming the new leader.

The plan: each node leads at most ceil(streams / nodes) (raised only where the replicas allow
no better), with the fewest leaders moved, and a leader moves only to a replica that is
current; among plans of as few moves, the one that leaves the most logs led by the server
their partition's owner is connected to (its writes then take no hop between servers). It is
a min-cost flow on the nodes: a stream led by a node costs W (more than all streams together)
unless that node led it when planning began, plus 1 unless it is its owner's; a move of s from
u to v costs the difference. Each unit of a node's excess is pushed along the cheapest path of
such moves to a node below the cap. Starting from the current leaders (every move costs at
least W - 1 > 0: no negative cycle), augmenting along shortest paths keeps the plan cheapest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping

import msgspec


class Move(msgspec.Struct, frozen=True, kw_only=True):
    """One stepdown: `stream`'s leadership from `source` to `target`."""

    stream: str
    source: str
    target: str


def leader_cap(streams: int, nodes: int) -> int:
    """The most leaders one node should hold: ceil(streams / nodes)."""
    return math.ceil(streams / nodes) if nodes else streams


def plan_moves(
    leaders: Mapping[str, str],
    eligible: Mapping[str, Collection[str]],
    nodes: Collection[str],
    owners: Mapping[str, str] | None = None,
) -> list[Move]:
    """The fewest moves that leave every node of `nodes` leading at most `leader_cap` of the
    streams (more only where `eligible` allows no better); among plans of as few moves, one
    that leaves the most streams led by their `owners` node (stream -> the server its
    partition's coordinator is connected to).

    `leaders`: stream -> the node leading it now (streams without a leader are left out by the
    caller); `eligible`: stream -> the nodes that may lead it (its current replicas; the
    leader counts as one whether listed or not). A node outside `nodes` is never a target,
    and what it leads counts against no cap. Deterministic: same view, same plan.
    """
    live = sorted(set(nodes))
    if not live:
        return []
    allowed = {s: (set(eligible.get(s, ())) | {lead}) & set(live) for s, lead in leaders.items()}
    cap = leader_cap(sum(1 for lead in leaders.values() if lead in live), len(live))
    while True:  # the lowest cap the replicas allow, then the fewest moves under it
        moves = _plan_under(leaders, allowed, live, cap, owners or {})
        if moves is not None:
            return moves
        cap += 1


def _plan_under(
    leaders: Mapping[str, str],
    allowed: Mapping[str, set[str]],
    live: list[str],
    cap: int,
    owners: Mapping[str, str],
) -> list[Move] | None:
    """The fewest moves that leave no node of `live` above `cap`, then the most streams on
    their owners' node; None if no moves do."""
    where = dict(leaders)
    load = dict.fromkeys(live, 0)
    for leader in where.values():
        if leader in load:
            load[leader] += 1
    # by_edge[(u, v)]: streams led by u now that could move to v, by what the move costs
    by_edge: dict[tuple[str, str], dict[int, set[str]]] = {}

    weight = len(leaders) + 1  # one move more outweighs every stream away from its owner

    def cost(stream: str, node: str) -> int:
        moved = 0 if leaders[stream] == node else weight
        return moved + (0 if owners.get(stream, node) == node else 1)

    def index(stream: str, add: bool) -> None:
        here = where[stream]
        if here not in load:
            return
        for other in allowed[stream] - {here}:
            delta = cost(stream, other) - cost(stream, here)
            bucket = by_edge.setdefault((here, other), {}).setdefault(delta, set())
            (bucket.add if add else bucket.discard)(stream)

    for stream in sorted(where):
        index(stream, add=True)

    while any(count > cap for count in load.values()):
        path = _cheapest_path(live, load, cap, by_edge)
        if path is None:  # the replicas allow no better at this cap
            return None
        for source, target in itertools.pairwise(path):
            classes = by_edge[(source, target)]
            delta = min(d for d, streams in classes.items() if streams)
            stream = min(classes[delta])
            index(stream, add=False)
            where[stream] = target
            index(stream, add=True)
        load[path[0]] -= 1
        load[path[-1]] += 1
    return [
        Move(stream=stream, source=leaders[stream], target=where[stream])
        for stream in sorted(where)
        if where[stream] != leaders[stream]
    ]


def _cheapest_path(
    live: list[str],
    load: Mapping[str, int],
    cap: int,
    by_edge: Mapping[tuple[str, str], Mapping[int, set[str]]],
) -> list[str] | None:
    """The cheapest chain of moves from a node above `cap` to one below it (Bellman-Ford over
    the nodes, from every node above at once; fewest hops among equals), or None."""
    edges = [
        (source, target, min(d for d, streams in classes.items() if streams))
        for (source, target), classes in sorted(by_edge.items())
        if any(classes.values())
    ]
    inf = (math.inf, math.inf)
    best: dict[str, tuple[float, float]] = {n: (0, 0) if load[n] > cap else inf for n in live}
    before: dict[str, str] = {}
    for _ in range(len(live)):
        changed = False
        for source, target, delta in edges:
            cost, hops = best[source]
            if cost == math.inf:
                continue
            candidate = (cost + delta, hops + 1)
            if candidate < best[target]:
                best[target], before[target] = candidate, source
                changed = True
        if not changed:
            break
    ends = [n for n in live if load[n] < cap and best[n] != inf]
    if not ends:
        return None
    end = min(ends, key=lambda n: (best[n], n))
    path = [end]
    while load[path[-1]] <= cap:  # walk back to the node above the cap it came from
        path.append(before[path[-1]])
    return path[::-1]
