"""The CPU thread split between the runtimes (genserve/thread_split.py): the rule, the flags that
override it, and that `genserve serve` hands it to the processes."""

from __future__ import annotations

import argparse

import pytest

from genserve.thread_split import split_threads


@pytest.mark.parametrize(
    "cores, llms, diffusion, llm, diff, rule",
    [
        (2, 2, True, 1, 1, "split"),  # the default server: SmolLM2 + shapes-vl + diffusion
        (16, 2, True, 8, 8, "split"),
        (16, 1, True, 8, 8, "split"),
        (7, 1, True, 4, 3, "split"),
        (1, 2, True, 1, 1, "split"),  # never below one thread
        (8, 1, False, 8, 0, "llm only"),
        (8, 2, False, 8, 0, "llm only"),  # each LLM the whole share
        (8, 0, True, 0, 8, "diffusion only"),
    ],
)
def test_the_rule(cores, llms, diffusion, llm, diff, rule):
    split = split_threads(cores, llms, diffusion)
    assert (split.llm_threads, split.diffusion_threads, split.rule) == (llm, diff, rule)
    if llms and diffusion and cores >= 2:  # enough cores: the two kinds share none
        assert split.llm_threads + split.diffusion_threads <= cores


def test_flags_override_one_side_and_bad_values_are_refused():
    split = split_threads(16, 2, True, diffusion_override=2)
    assert (split.llm_threads, split.diffusion_threads, split.rule) == (8, 2, "override")
    split = split_threads(16, 2, True, llm_override=3)
    assert (split.llm_threads, split.diffusion_threads) == (3, 8)
    assert split_threads(16, 0, True, llm_override=3).llm_threads == 0  # no LLM runs
    with pytest.raises(ValueError, match="--diffusion-num-threads must be >= 1"):
        split_threads(4, 1, True, diffusion_override=0)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        split_threads(0, 1, True)


def test_serve_hands_the_split_to_each_runtime(monkeypatch):
    from genserve.entrypoints.cli import build_parser
    from genserve.entrypoints.serve import engine_args_from, plan_threads
    from genserve.multimodal_gen.launch import worker_config_from_args

    monkeypatch.delenv("GENSERVE_NUM_THREADS", raising=False)
    args = build_parser().parse_args(["serve", "--model-path", "a", "--model-path", "b"])
    split = plan_threads(args, True, True, cores=12)
    assert (split.llm_threads, split.diffusion_threads) == (6, 6)
    assert args.num_threads == 6 and args.diffusion_num_threads == 6
    assert worker_config_from_args(["shapes-image"], args).num_threads == 6
    assert engine_args_from(args, "a").num_threads == 6
    args = build_parser().parse_args(["serve", "--diffusion-num-threads", "2"])
    assert plan_threads(args, True, True, cores=12).diffusion_threads == 2
    # Tensor-parallel ranks compute at once: they divide the LLMs' share; a flag is kept.
    args = build_parser().parse_args(["serve", "--model-path", "a", "--tp", "2"])
    assert plan_threads(args, True, False, cores=12).llm_threads == 6 == args.num_threads
    args = build_parser().parse_args(["serve", "--model-path", "a", "--tp", "4"])
    assert plan_threads(args, True, False, cores=2).llm_threads == 1
    args = build_parser().parse_args(["serve", "--model-path", "a", "--tp", "2",
                                      "--num-threads", "3"])
    assert plan_threads(args, True, False, cores=12).llm_threads == 3
    # Several diffusion workers keep their own division of the cores.
    args = argparse.Namespace(
        model_path=None,
        num_threads=2,
        diffusion_num_threads=None,
        diffusion_workers=2,
        diffusion_cp=None,
    )
    split = plan_threads(args, False, True, cores=12)
    assert split.diffusion_threads == 12 and args.diffusion_num_threads is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_processes_run_with_their_share(shapes_demo_server):
    """The session's demo server (shapes-vl + the diffusion worker): /get_server_info shows the
    split, and each process reports the torch threads it really runs with."""
    import httpx

    from genserve.thread_split import available_cores

    info = httpx.get(shapes_demo_server + "/get_server_info", timeout=30).json()
    split = info["thread_split"]
    expected = split_threads(available_cores(), 1, True).as_dict()
    assert split == expected
    assert info["num_threads"] == split["llm_threads"]  # the scheduler process's own count
    assert info["diffusion"]["num_threads"] == split["diffusion_threads"]


def test_omp_num_threads_caps_the_cores_split(monkeypatch):
    """A server started under OMP_NUM_THREADS=1 (a test runner's worker, a container's quota)
    splits one core, not the machine's: more OpenMP threads than cores stall each other."""
    from genserve.thread_split import available_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = available_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert available_cores() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(machine + 8))
    assert available_cores() == machine  # a cap, never more than the process may run on
    for unset in ("", "0", "auto"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert available_cores() == machine
