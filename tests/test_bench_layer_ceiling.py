"""bench/layer_ceiling.py: the layers' byte regions it streams (CPU: the layout only; the timing needs a GPU)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def layer_ceiling(load_bench):
    return load_bench("layer_ceiling")


def test_regions_are_whole_tiles_inside_the_buffer_and_consecutive_layers_never_share_bytes(layer_ceiling):
    TILE = layer_ceiling.TILE
    w13 = [7 * TILE + 5, 3 * TILE, 100, 9 * TILE]
    w2 = [2 * TILE, TILE + 1, 5, 4 * TILE + TILE - 1]
    buf = 16 * TILE
    regions = layer_ceiling.layer_regions(w13, w2, buf)
    # rounded down to whole tiles, but never to nothing (a layer always reads something)
    assert [(a, b) for _, a, b in regions] == [(7 * TILE, 2 * TILE), (3 * TILE, TILE), (TILE, TILE),
                                               (9 * TILE, 4 * TILE)]
    for off, a, b in regions:
        assert off % TILE == 0 and off + a + b <= buf
    for (o1, a1, b1), (o2, a2, b2) in zip(regions, regions[1:]):
        assert o2 in (o1 + a1 + b1, 0)  # back to back, or wrapped to the start
        assert o2 + a2 + b2 <= o1 or o2 >= o1 + a1 + b1  # the next layer does not reread this one's bytes
    assert [o for o, _, _ in regions] == [0, 9 * TILE, 13 * TILE, 0]  # the fourth layer would not fit: it wraps


def test_a_layer_larger_than_the_buffer_names_the_fix(layer_ceiling):
    TILE = layer_ceiling.TILE
    with pytest.raises(ValueError, match="does not fit.*raise --gib"):
        layer_ceiling.layer_regions([8 * TILE], [9 * TILE], 16 * TILE)
