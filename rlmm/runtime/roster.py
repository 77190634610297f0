"""Which rank runs where, so that a rank that dies is named with its node.

A gloo collective whose peer is gone fails with the peer's address and nothing else ("Read error
[198.18.0.12]:2478: Connection reset by peer"). Each rank's host name and the address gloo gives its pairs (its
device resolves the host name, as `socket.gethostbyname` does) are gathered once the ranks' group is up
(`take_roster`); `who_is_at` turns the address in such an error into "rank 1 (rlmm-node2)". A rank keeps the
roster in this module: its fault line is written from the same process.
"""
from __future__ import annotations

import re
import socket

ROSTER: list[tuple[str, str]] = []  # rank -> (host name, address); empty with one rank or before take_roster
# gloo's peer in its errors: "[<IPv4 or IPv6>]:<port>"
PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")


def own_entry() -> tuple[str, str]:
    host = socket.gethostname()
    try:
        return host, socket.gethostbyname(host)
    except OSError:  # a host name nothing resolves: gloo then could not have started either
        return host, ""


def take_roster() -> None:
    """Gather every rank's (host name, address); a collective: every rank calls it, at the same point. Nothing with
    one rank (no name to look up: a host name no resolver knows can take seconds to fail)."""
    import torch.distributed as dist

    from rlmm.runtime.collectives import gathered_over_ranks

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        ROSTER.clear()
        return
    ROSTER[:] = gathered_over_ranks(own_entry())


def who_is_at(text: str, me: int | None) -> str | None:
    """The ranks at the peer address that `text` (a collective's error) names, other than rank `me`: "rank 1
    (rlmm-node2)", or "a rank on vm (1, 2 or 3)" where several share the address (one node); None when `text`
    names no address the roster knows."""
    match = PEER.search(text)
    if match is None or not ROSTER:
        return None
    ranks = [rank for rank, (_, address) in enumerate(ROSTER) if address == match.group(1) and rank != me]
    if not ranks:
        return None
    host = ROSTER[ranks[0]][0]
    if len(ranks) == 1:
        return f"rank {ranks[0]} ({host})"
    return f"a rank on {host} ({', '.join(map(str, ranks[:-1]))} or {ranks[-1]})"
