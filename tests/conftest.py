import os
import random

import pytest
import torch

# Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter. It must be switched on
# before any kernel module is imported (triton.jit reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """Without the compiled extension nearly every test would fail on its own; say once what is wrong instead."""
    import dilated_attn

    info = dilated_attn.build_info()
    if not info["loaded"]:
        pytest.exit(info["error"], returncode=2)


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
