import pytest

from genserve import envs


def pytest_configure(config):
    threads = envs.GENSERVE_TEST_THREADS.get()
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
