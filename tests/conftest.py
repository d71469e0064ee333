import os

import torch

# On a machine without CUDA the Triton kernels can only run through the interpreter; it must be
# switched on before triton.jit decorates anything, i.e. before the project is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    # Triton kernels on CPU tensors run only under the interpreter, which this file switches on
    # exactly when CUDA is absent; on a GPU machine the `gpu` tests cover the same kernels.
    skip_interp = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
