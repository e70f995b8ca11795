"""The decode graphs' bookkeeping (`pytgi.engine.execution.cuda_graphs`) without a GPU: which graph a step
replays, and what its fixed input buffers hold (the capture and replay run in tests/model/test_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pytgi.engine.execution.batch import StepBatch
from pytgi.engine.execution.cuda_graphs import DEFAULT_SIZES, DecodeGraphs, parse_sizes


def test_parse_sizes():
    assert parse_sizes(None) == DEFAULT_SIZES
    assert parse_sizes("8, 1,2,2") == (1, 2, 8)
    assert parse_sizes("0") == ()
    with pytest.raises(ValueError):
        parse_sizes("-1")


class _Replay:
    def __init__(self) -> None:
        self.count = 0

    def replay(self) -> None:
        self.count += 1


def graphs(sizes=(1, 2, 4, 8)):
    paged = SimpleNamespace(
        device=torch.device("cpu"),
        block_size=4,
        model=SimpleNamespace(attention=SimpleNamespace(group=4, kv_heads=2, head_dim=16)),
        kv_caches=[],
    )
    g = DecodeGraphs(paged, sizes, max_blocks=6, scratch_block=50)
    g.graphs = {s: (_Replay(), torch.arange(s * 3, dtype=torch.float32).reshape(s, 3)) for s in sizes}  # type: ignore[misc]
    return g


def test_a_decode_step_replays_the_smallest_graph_that_holds_it_with_padding_rows_in_the_scratch_block():
    g = graphs()
    step = StepBatch.build([[7], [8], [9]], [5, 0, 12], [[3, 4], [9], [1, 2, 6, 11]], 4)
    logits = g.run(step, step.last_rows)
    replay, out = g.graphs[4]
    assert replay.count == 1 and logits.data_ptr() == out.data_ptr() and logits.shape == (3, 3)
    assert g.ints[0, :4].tolist() == [7, 8, 9, 0]  # ids
    assert g.ints[1, :4].tolist() == [5, 0, 12, 0]  # positions
    assert g.ints[2, :4].tolist() == [4 * 4 + 1, 9 * 4, 11 * 4, 200]  # slots; the padding row's: scratch
    assert g.ctx[:4].tolist() == [6, 1, 13, 0]  # the padding row attends to nothing
    assert g.tables[:3, :4].tolist() == [[3, 4, 0, 0], [9, 0, 0, 0], [1, 2, 6, 11]]
    assert g.metas[4].programs.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]


def test_steps_a_graph_cannot_replay_run_eagerly():
    g = graphs()
    too_many = StepBatch.build([[1]] * 9, [0] * 9, [[1]] * 9, 4)
    prefill = StepBatch.build([[1, 2], [3]], [0, 4], [[1], [2, 3]], 4)
    too_long = StepBatch.build([[1]], [30], [[1, 2, 3, 4, 5, 6, 7, 8]], 4)  # wider than max_blocks
    for step in (too_many, prefill, too_long):
        assert g.run(step, step.last_rows) is None
    assert all(r.count == 0 for r, _ in g.graphs.values())


def test_rows_other_than_every_row_are_picked_out():
    g = graphs()
    step = StepBatch.build([[7], [8]], [0, 0], [[1], [2]], 4)
    logits = g.run(step, np.array([1]))
    assert logits.tolist() == [[3.0, 4.0, 5.0]]
