"""AD-PSGD's pairing (:mod:`~gtc_lightning.algorithms.averaging.adpsgd`): which ranks start exchanges
(the even, *active* ones), which answer (the odd, *passive* ones), and the schedule that gives an
active rank's n-th exchange its peer, keeping no state but the exchange counter."""

from __future__ import annotations

PEERINGS = ("ring", "random")


def actives(world: int) -> list[int]:
    """The ranks that start exchanges: the even ones."""
    return list(range(0, world, 2))


def passives(world: int) -> list[int]:
    """The ranks that answer them: the odd ones."""
    return list(range(1, world, 2))


def check_world(world: int, peering: str) -> None:
    """At least 2 ranks; the ring pairing needs an even number (on an odd ring two even ranks are
    neighbours, and neither would answer the other)."""
    if peering not in PEERINGS:
        raise ValueError(f"Expect peering in {PEERINGS}, got {peering!r}")
    if world < 2:
        raise ValueError(
            f"adpsgd averages each rank with a peer, so it needs at least 2 ranks; got {world}. "
            "Train with more devices (or num_nodes), or with a single-device strategy"
        )
    if peering == "ring" and world % 2:
        raise ValueError(
            f"adpsgd with peering='ring' pairs each even rank with its odd ring neighbours, which needs an even "
            f"number of ranks; got {world}. Use an even number of ranks, or peering='random' (each even rank draws "
            "an odd peer)"
        )


def _mix(*words: int) -> int:
    """splitmix64 over the words: a stateless, seeded hash (the schedule needs no saved generator)."""
    x = 0x9E3779B97F4A7C15
    for w in words:
        x = (x ^ (w & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


def schedule_peer(rank: int, world: int, exchange: int, peering: str = "ring", seed: int = 0) -> int:
    """The passive peer of active ``rank``'s ``exchange``-th exchange (from 0).

    ``"ring"``: the right neighbour on even exchanges, the left one on odd ones (the one other rank
    when ``world == 2``): the active ranks' ``n``-th exchanges form disjoint pairs. The ranks reach
    their ``n``-th exchange at different times, though (there is no lockstep), so a passive rank may
    be asked by two active ranks at once; it answers them in turn. ``"random"``: a passive rank drawn
    from a hash of (``seed``, ``rank``, ``exchange``)."""
    if rank % 2:
        raise ValueError(f"rank {rank} is passive: only even ranks start exchanges")
    if peering == "ring":
        return (rank + 1) % world if exchange % 2 == 0 else (rank - 1) % world
    choices = passives(world)
    return choices[_mix(seed, rank, exchange) % len(choices)]
