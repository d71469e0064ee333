import atexit
import os
import shutil
import tempfile

# A compile cache of this test session's own (unless one is given): the engine saves its compiled
# step parts there (graphs/graph_runner.py, CompiledPart), and parts saved by an earlier session
# with the same model, config and source would be loaded instead of compiled, which changes the
# compile counts the tests assert. A fresh machine, as CI's, starts without one too.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="minikv-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import torch  # noqa: E402

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


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test: at tiny shapes more threads only contend (on
    the loaded 2-core machine several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def _threads_per_xdist_worker():
    """Under pytest-xdist (``-n N``), each worker's torch takes its share of the cores, not all
    of them: N workers of all-core OpenMP teams wait on each other's preempted threads (the
    SmolLM2 short-prompt test beside a busy core, 2 cores: 19.2 s and 27.7 CPU-s at 2 threads,
    6.5 s and 10.9 CPU-s at 1). The servers and ranks the tests start take the same share
    (OMP_NUM_THREADS, unless set). A run without xdist keeps torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    n = torch.get_num_threads()
    if workers > 1:
        torch.set_num_threads(max(1, n // workers))
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, n // workers)))
    yield
    torch.set_num_threads(n)
