"""Cross-mesh resharding, send once and gather on the receiver
(meshplan.cost_model.cross_mesh): the formula against a brute-force count of
the bytes every link carries, on synthetic layouts and clusters."""
import itertools

import pytest

from meshplan.cost_model.cross_mesh import cross_mesh_cost, per_replica_bytes
from meshplan.cost_model.pipeline import stage_send_s


def layout(n: int, tiles: int) -> list[range]:
    """``n`` devices holding a value of ``N`` one-byte elements cut into
    ``tiles`` contiguous tiles, each on ``n // tiles`` devices (as tile
    ids; device d holds tile d // replicas)."""
    reps = n // tiles
    return [d // reps for d in range(n)]


def brute_force(N: int, senders: int, s_tiles: int, receivers: int, r_tiles: int,
                send_once: bool) -> tuple[int, int, int]:
    """(busiest slow link, busiest receiver's all-gather intake, total slow
    bytes) moving every element the way the transport does."""
    s_of, r_of = layout(senders, s_tiles), layout(receivers, r_tiles)
    s_rep, r_rep = senders // s_tiles, receivers // r_tiles
    out_bytes = [0] * senders
    in_bytes = [0] * receivers
    gather = [0] * receivers
    tile_r, tile_s = N // r_tiles, N // s_tiles
    for d in range(receivers):
        t = r_of[d]
        lo, hi = t * tile_r, (t + 1) * tile_r
        if send_once:       # the d-th replica's slice only; the rest comes by all-gather
            j = d % r_rep
            part = tile_r // r_rep
            mine = range(lo + j * part, lo + (j + 1) * part)
            gather[d] = tile_r - part
        else:
            mine = range(lo, hi)
        for e in mine:
            holders = [x for x in range(senders) if s_of[x] == e // tile_s]
            # the holders of a sender tile take turns element by element
            out_bytes[holders[e % s_rep]] += 1
            in_bytes[d] += 1
    return max(out_bytes + in_bytes), max(gather), sum(in_bytes)


CASES = [  # (senders, sender tiles, receivers, receiver tiles)
    (4, 4, 4, 2), (4, 2, 4, 2), (4, 1, 4, 1), (8, 4, 4, 2), (2, 2, 8, 4), (4, 4, 4, 1),
    (8, 8, 8, 2), (1, 1, 4, 1),
]


@pytest.mark.parametrize("senders,s_tiles,receivers,r_tiles", CASES)
def test_slow_link_bytes_match_a_brute_force_count(senders, s_tiles, receivers, r_tiles):
    N = 64
    rep = receivers // r_tiles
    busiest, gathered, total = brute_force(N, senders, s_tiles, receivers, r_tiles, True)
    c = cross_mesh_cost(N, senders, receivers, rep, 1.0, 0.0, 1.0, 0.0)
    assert c.slow_bytes == busiest
    assert c.gather_bytes == gathered
    assert total == N                   # every byte crosses once
    old_busiest, _, old_total = brute_force(N, senders, s_tiles, receivers, r_tiles, False)
    assert per_replica_bytes(N, senders, receivers, rep) == old_busiest
    assert old_total == N * rep         # once per receiver replica


def test_seconds_on_a_two_host_cluster():
    # slow 10 GB/s per device, 10 us; fast 100 GB/s, 2 us; 8 devices each
    # side, the value replicated 4 ways on the receiver (tp = 4 inside a host)
    slow_bw, slow_lat, fast_bw, fast_lat = 10e9, 10e-6, 100e9, 2e-6
    N = 64e6
    c = cross_mesh_cost(N, 8, 8, 4, slow_bw, slow_lat, fast_bw, fast_lat)
    slow = slow_lat + N / 8 / slow_bw
    gather = 3 * fast_lat + (N * 4 / 8) * 3 / 4 / fast_bw
    assert c.seconds == pytest.approx(slow + gather)
    per_replica = slow_lat + per_replica_bytes(N, 8, 8, 4) / slow_bw
    assert c.seconds < per_replica / 3     # 4x the bytes on a 10x slower link


def test_no_replication_is_a_plain_send():
    c = cross_mesh_cost(1000.0, 4, 4, 1, 100.0, 0.5, 1e9, 0.1)
    assert c.gather_bytes == 0
    assert c.seconds == pytest.approx(0.5 + 250 / 100)
    assert cross_mesh_cost(0.0, 4, 4, 2, 1.0, 1.0, 1.0, 1.0).seconds == 0.0


@pytest.mark.parametrize("rep,devices", list(itertools.product([1, 2, 4], [4, 8])))
def test_one_kind_of_link_costs_what_per_replica_sends_cost(rep, devices):
    # with the gather on links as slow as the hop and no latency, sending once
    # and gathering moves the same bytes per link as sending per replica:
    # stage_send_s keeps the old formula's figure there
    cut, bw = 3e6, 5e9
    assert stage_send_s(cut, rep, devices, bw) == pytest.approx(2 * cut * rep / (devices * bw))
    # with faster links for the gather it is cheaper as soon as values repeat
    fast = stage_send_s(cut, rep, devices, bw, 0.0, 10 * bw, 0.0)
    assert (fast < stage_send_s(cut, rep, devices, bw)) == (rep > 1)
