import os
import shutil

import pytest

# Triton kernels run on this CPU only through Triton's interpreter, which must be chosen before
# any kernel module is imported. With a GPU the real compiler is used.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from genserve import envs  # noqa: E402


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
