"""`--enable-cuda-graph`: decode batches padded to a bucket and replayed from static buffers give
the eager tokens. On a CPU the graphs are run by the eager capture (the same buckets, buffers,
padding and slicing, with the forward called instead of a graph replayed); asking for CUDA graphs
there, or for a bucket the KV pool cannot hold, is a start-up error."""

from __future__ import annotations

import pytest

from genserve import Engine
from genserve.srt.decode_graphs import cuda_graph_buckets
from tests.srt.test_engine import prompt

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}
GRAPHS = dict(enable_cuda_graph=True, cuda_graph_capture="eager", cuda_graph_max_bs=4)


def test_buckets_are_powers_of_two_then_multiples_of_eight():
    assert cuda_graph_buckets(1) == [1]
    assert cuda_graph_buckets(3) == [1, 2, 3]
    assert cuda_graph_buckets(8) == [1, 2, 4, 8]
    assert cuda_graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_decode_gives_the_eager_tokens(tiny_model_factory, backend):
    """Batches of 1, 3 (padded to 4) and 6 (over the largest bucket: eager) in one engine,
    against an engine without graphs; the triton backend plans its attention the way a CUDA
    graph does (kernels under Triton's interpreter)."""
    folder = str(tiny_model_factory("llama"))
    common = dict(dtype="float32", max_total_tokens=1024, attention_backend=backend)
    eager = Engine(folder, **common)
    graphs = Engine(folder, **common, **GRAPHS)
    runner = graphs.runtime.runner
    assert runner.decode_graphs.buckets == [1, 2, 4]
    assert graphs.runtime.model_info()["cuda_graph_buckets"] == [1, 2, 4]
    prompts = [prompt(i, 12 + i) for i in range(6)]
    steps = GREEDY["max_new_tokens"] - 1  # decode steps per batch (the first token: prefill)
    for batch in (prompts[:1], prompts[:3], prompts):
        runner.decode_graphs.replays = 0
        want = [o["output_ids"] for o in eager.generate(input_ids=batch, sampling_params=GREEDY)]
        got = [o["output_ids"] for o in graphs.generate(input_ids=batch, sampling_params=GREEDY)]
        assert got == want
        assert runner.decode_graphs.replays == (steps if len(batch) <= 4 else 0)
    graphs.check_integrity()  # padding wrote only the padding slot: nothing leaked or clashed
    eager.shutdown()
    graphs.shutdown()


def test_cuda_graphs_on_a_cpu_are_a_clear_error(tiny_model_factory):
    with pytest.raises(ValueError, match="--enable-cuda-graph needs a CUDA device"):
        Engine(
            str(tiny_model_factory("llama")), dtype="float32", device="cpu", enable_cuda_graph=True
        )


def test_a_bucket_larger_than_the_pool_is_a_clear_error(tiny_model_factory):
    with pytest.raises(ValueError, match="use --cuda-graph-max-bs <= 16 or a larger pool"):
        Engine(
            str(tiny_model_factory("llama")),
            dtype="float32",
            max_total_tokens=16,
            **{**GRAPHS, "cuda_graph_max_bs": 17},
        )


@pytest.mark.parametrize("clash", [dict(compile=True), dict(tp_size=2)])
def test_graphs_refuse_what_they_cannot_serve(clash):
    with pytest.raises(ValueError, match="--enable-cuda-graph is not supported with"):
        Engine(enable_cuda_graph=True, **clash)
