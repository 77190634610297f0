"""A rank that dies is named with its node: the peer address of gloo's error, looked up in the ranks' roster
(rlmm/runtime/roster.py), in the machine-fault line (rlmm/launch/apps.py::machine_fault)."""
from __future__ import annotations

import pytest

from rlmm.launch.apps import machine_fault
from rlmm.runtime import roster

# gloo's text when rank 0's peer was SIGKILLed (a RuntimeError from its pair, as seen on the emulated nodes)
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [{}]:2478: "
        "Connection reset by peer")


@pytest.fixture
def two_nodes(monkeypatch):
    monkeypatch.setattr(roster, "ROSTER", [("rlmm-node1", "198.18.0.11"), ("rlmm-node2", "198.18.0.12")])
    monkeypatch.setenv("RANK", "0")


def test_the_rank_at_the_peer_address_is_named_with_its_node(two_nodes):
    assert roster.who_is_at("Read error [198.18.0.12]:2478: Connection reset by peer", me=0) == "rank 1 (rlmm-node2)"
    assert roster.who_is_at("Read error [198.18.0.11]:2478: Connection reset by peer", me=1) == "rank 0 (rlmm-node1)"
    assert roster.who_is_at("Read error [198.18.0.99]:2478: Connection reset by peer", me=0) is None  # no rank's
    assert roster.who_is_at("Connection reset by peer", me=0) is None  # no address


def test_ranks_sharing_a_node_are_listed(monkeypatch):
    monkeypatch.setattr(roster, "ROSTER", [("vm", "127.0.0.1")] * 4)
    assert roster.who_is_at("[127.0.0.1]:31618", me=0) == "a rank on vm (1, 2 or 3)"
    monkeypatch.setattr(roster, "ROSTER", [("vm", "127.0.0.1")] * 2)
    assert roster.who_is_at("[127.0.0.1]:31618", me=0) == "rank 1 (vm)"  # the only other rank


def test_the_machine_fault_line_names_the_rank_and_its_node(two_nodes):
    line = machine_fault(RuntimeError(GLOO.format("198.18.0.12")))
    assert line == "rank 1 (rlmm-node2) failed or is gone (RuntimeError: Read error [198.18.0.12]:2478: " \
                   "Connection reset by peer)"


def test_without_a_roster_the_line_says_a_rank(monkeypatch):
    monkeypatch.setattr(roster, "ROSTER", [])
    assert machine_fault(RuntimeError(GLOO.format("198.18.0.12"))).startswith("a rank of the run failed or is gone (")


def test_the_own_entry_is_this_host_and_an_address_it_resolves_to():
    host, address = roster.own_entry()
    assert host
    assert address.count(".") == 3 or ":" in address, address
