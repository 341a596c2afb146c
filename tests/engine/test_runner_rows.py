"""A step's per-request views made where read: `Rows` (each request's part of the flat logits or taps) and `RowOf`
(what a request keeps of a drafting step run ahead: its row of each tap)."""

from __future__ import annotations

import torch

from specchat.engine.runner import RowOf, Rows


def test_rows_split_a_tensor_or_taps_by_request_on_first_use():
    flat = torch.arange(10.0).view(5, 2)
    logits = Rows(flat, [2, 3])
    assert logits._parts is None and len(logits) == 2  # nothing split yet
    assert logits[0].tolist() == [[0, 1], [2, 3]] and logits[1].tolist() == flat[2:].tolist()
    assert [t.shape[0] for t in logits] == [2, 3]  # iterable like the list it stands for
    taps = Rows({7: flat, 9: -flat}, [1, 4])
    first, second = taps
    assert set(first) == {7, 9} and first[9].tolist() == [[-0.0, -1.0]] and second[7].shape == (4, 2)


def test_row_of_reads_as_the_dict_of_its_rows():
    rows = {3: torch.arange(12.0).view(4, 3), 5: torch.zeros(4, 3)}
    kept = RowOf(rows, 2)
    plain = {layer: r[2:3] for layer, r in rows.items()}  # what a request kept before: its newest row, [1, d]
    assert len(kept) == 2 and list(kept) == [3, 5] and 3 in kept and 4 not in kept and bool(kept)
    assert kept.keys() == plain.keys()
    for layer in plain:
        assert torch.equal(kept[layer], plain[layer]) and kept[layer][-1].tolist() == plain[layer][-1].tolist()
    assert {layer: t.tolist() for layer, t in dict(kept).items()} == {k: v.tolist() for k, v in plain.items()}
    assert not RowOf({}, 0)  # a drafter without taps keeps nothing
