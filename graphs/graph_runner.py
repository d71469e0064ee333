"""The one owner of the decode step's compile, CUDA-graph capture and replay.

``GraphRunner`` compiles the parts of the step (graphs/decode.py's ``DecodeStep``: the start,
one layer, the choice of the token), captures one CUDA graph per (bucket, mode) after warm-up,
replays it, and counts compiles and replays so that a test (and a benchmark) can prove the
graphs are really replayed and nothing recompiles. Nobody else calls the step.

Each part's compiled code is kept on disk beside inductor's cache (``CompiledPart``): a
restarted process loads it instead of tracing the step again.

Warm-up runs the real step on the real buffers, so it must not disturb slots that are
mid-generation when a new bucket is captured: it runs with every slot marked inactive (the step
then leaves the cache as it is, by the contract of ``cache_begin_step``), and every slot-state
buffer is restored from a snapshot afterwards.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import importlib
import inspect
import logging
import os
import platform
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import triton

Key = Tuple[int, str]  # (bucket, mode)

_log = logging.getLogger(__name__)


class GraphRunner:
    """Runs a key ``(batch, mode)`` as ``step(slots, mode)`` with ``slots = active[:batch]``:
    the parts the step asks for compiled (``torch.compile(fullgraph=True)``) if ``compile``, the
    whole step replayed from one CUDA graph per key if ``cuda_graphs``.

    build_step(compile_part) -> step: builds the step, handing each part it wants compiled to
        ``compile_part(method, batched=names)`` (a ``CompiledPart``; None without ``compile``:
        the parts run as they are). The step decides which buckets share a compiled part (the
        arguments it names batched): ``DecodeStep``.
    state_buffers: every tensor the step writes besides the cache (restored after warm-up).
    active: the ``(Bmax,)`` bool tensor that admits slots to the step (one of
        ``state_buffers``); zeroed during warm-up so that the step writes no cache buffer.
    identity: what the compiled code depends on besides the project's source and the versions
        (model config, dtype, engine config, ...): it names the folder of saved parts
        (``step_folder``). None: nothing is saved or loaded.
    """

    def __init__(self, build_step: Callable[[Callable], Callable[[torch.Tensor, str], None]], *,
                 device: torch.device, compile: bool, cuda_graphs: bool,
                 state_buffers: List[torch.Tensor], active: torch.Tensor,
                 identity: Optional[str] = None):
        self.device, self.use_graphs, self._compiled = device, cuda_graphs, compile
        self._state, self._active = state_buffers, active
        self.compiles = 0                      # compiled graphs this process has run (every part)
        self.loads = 0                         # ... of them saved by an earlier process
        self.replays = 0                       # CUDA-graph replays
        self.compile_seconds: Dict[Key, float] = {}
        self.capture_seconds: Dict[Key, float] = {}
        self._graphs: Dict[Key, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        folder = step_folder(identity, device) if compile and identity is not None else None
        compile_part = (functools.partial(CompiledPart, folder=folder, runner=self)
                        if compile else None)
        self._step = build_step(compile_part)

    @property
    def graphs(self) -> List[Key]:
        return sorted(self._graphs)

    def ready(self, key: Key) -> bool:
        """Whether ``run(key)`` needs no compile or capture first."""
        if self.use_graphs:
            return key in self._graphs
        return not self._compiled or key in self.compile_seconds

    def prepare(self, key: Key) -> Optional[float]:
        """Compile and capture ``key`` now if it is not ready; returns the seconds spent."""
        if self.ready(key):
            return None
        start = time.perf_counter()
        snapshot = [t.clone() for t in self._state]  # (the cache is left alone by the mask)
        self._active.zero_()
        try:
            if self.use_graphs:
                self._capture(key)
            else:
                self._call(key)
        finally:
            for t, saved in zip(self._state, snapshot):
                t.copy_(saved)
        spent = time.perf_counter() - start
        if self.use_graphs:
            self.capture_seconds[key] = spent  # compile, warm-up and capture together
        return spent

    def run(self, key: Key) -> None:
        """One step of ``key`` (``prepare`` first if it is not ready)."""
        self.prepare(key)
        if self.use_graphs:
            self._graphs[key].replay()
            self.replays += 1
        else:
            self._call(key)

    # -- internals -----------------------------------------------------------------------------

    def _capture(self, key: Key) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile + autotune + allocator warm-up, outside the capture
                self._call(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # A host sync (or a host-to-device copy from pageable memory) inside the step would be
        # baked out of the graph; the guard makes it an error at capture instead.
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._invoke(key)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
        self._graphs[key] = graph

    def _invoke(self, key: Key) -> None:
        batch, mode = key
        self._step(self._active[:batch], mode)

    def _call(self, key: Key) -> None:
        if not self._compiled or key in self.compile_seconds:
            self._invoke(key)
            return
        start = time.perf_counter()
        self._invoke(key)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_seconds[key] = time.perf_counter() - start


class CompiledPart:
    """A part of the step (a bound method), compiled ahead of its calls and kept on disk.

    Each new kind of call is compiled once (``torch.compile(fullgraph=True)``'s ``aot_compile``
    on that call's arguments; dims marked dynamic stay symbolic, so one compiled variant serves
    every bucket of a plan) and saved under ``folder``; a later process loads the saved
    variants at construction and never traces them again (H100, Llama-3.1-8B shape, a server's
    restart: the step's compiles 13.0 s, its loads 1.0-1.4 s; ``perf/NOTES.md``, "Saved compiled
    steps"). A call runs the first variant of its kind whose own guards accept the arguments.

    The kind (``_kind``: the arguments' structure, None-ness, strings, tensor dtypes and ranks)
    stands beside the variant's guards because saved guards leave out object identities, ``x
    is None`` among them: a variant traced with no ``normed`` would accept one.

    batched: the names of the arguments whose dim 0 is the batch: marked dynamic when a call
        of ``B >= 2`` compiles (``maybe_``: a plan's branch may narrow the range, e.g. to
        9..64), never on the calls themselves (a loaded variant's guards refuse marked tensors).
    folder: where this process saves and finds variants (``step_folder``), None: in memory only.
    runner: the ``GraphRunner`` whose ``compiles`` counts the variants run (compiled here, or
        loaded: counted at their first call) and ``loads`` the loaded ones among them.
    """

    def __init__(self, method: Callable, *, batched: Tuple[str, ...], folder: Optional[Path],
                 runner: GraphRunner):
        self._owner, self._name = method.__self__, method.__name__
        self._signature, self._batched = inspect.signature(method), batched
        self._runner, self._folder = runner, folder
        # torch 2.11 gives a compiled function its aot_compile only when this is on as it is
        # made (a later call does not check it)
        with torch._dynamo.config.patch(enable_aot_compile=True):
            self._compiler = torch.compile(method, fullgraph=True, dynamic=None)
        self._variants: Dict[str, list] = collections.defaultdict(list)
        self._unused: set = set()  # ids of loaded variants not called yet
        if folder is not None and folder.is_dir():
            for path in sorted(folder.glob(f"{self._name}-*.bin")):
                self._load(path)

    def __reduce__(self):
        # A saved variant pickles the step it belongs to, and with it the step's parts: they
        # need not travel (nothing a variant runs calls them), and a loaded variant's guards
        # cannot be pickled.
        return type(None), ()

    def __call__(self, *args):
        kind = _kind(args)
        for variant in self._variants[kind]:
            if variant.guard_check(self._owner, *args):
                if self._unused and id(variant) in self._unused:
                    self._unused.discard(id(variant))
                    self._runner.compiles += 1
                    self._runner.loads += 1
                return variant.fn(self._owner, *args)
        return self._compile(kind, args).fn(self._owner, *args)

    def _compile(self, kind: str, args: tuple):
        bound = self._signature.bind(*args).arguments
        for name in self._batched:
            value = bound[name]
            for t in value if isinstance(value, tuple) else (value,):  # (normed: a tuple or None)
                if isinstance(t, torch.Tensor) and t.shape[0] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        # A few variants per part are expected (batch 1, and one per set of buckets with the
        # same plan or mode, or per kind of layer): not runaway recompilation.
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
            variant = self._compiler.aot_compile((args, {}))
        self._runner.compiles += 1
        self._variants[kind].append(variant)
        if self._folder is not None:
            self._save(kind, variant)
        return variant

    def _save(self, kind: str, variant) -> None:
        """Write ``variant`` as ``{part}-{kind}-{digest}.bin`` (atomically: processes may share
        the folder). A variant that does not serialize, or a folder that cannot be written,
        leaves it in memory, with a warning."""
        try:
            data = type(variant).serialize(variant).serialized_data
            self._folder.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256(data).hexdigest()[:16]
            path = self._folder / f"{self._name}-{kind}-{digest}.bin"
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(data)
            os.replace(partial, path)
        except Exception as e:  # noqa: BLE001 -- a cache: the compiled variant still runs
            _log.warning("compiled %s not saved (%s): a restart compiles it again", self._name, e)

    def _load(self, path: Path) -> None:
        """Add the variant saved at ``path``; one that does not load is skipped, with a warning
        (its kind of call compiles again)."""
        kind = path.stem.split("-")[1]
        try:
            with open(path, "rb") as f:
                variant = torch.compiler.load_compiled_function(f)
        except Exception as e:  # noqa: BLE001 -- a cache: compiling again is always possible
            _log.warning("saved step part %s not loaded (%s)", path, e)
            return
        self._variants[kind].append(variant)
        self._unused.add(id(variant))


def _kind(args: tuple) -> str:
    """What a part's variant must match besides its guards: the arguments' structure (tuples,
    NamedTuples and lists by type and length, None), strings and bools by value, tensors by
    dtype, device type and rank, other objects by type. Digest, 16 hex digits. (A walk of its
    own: ``torch.utils._pytree`` took 0.28 ms a call, 0.5 s of a restart's captures.)"""
    parts: List[str] = []

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            parts.append(f"{x.dtype}:{x.device.type}:{x.dim()}")
        elif isinstance(x, (tuple, list)):
            parts.append(f"{type(x).__qualname__}[{len(x)}]")
            for y in x:
                walk(y)
        elif x is None or isinstance(x, (str, bool)):
            parts.append(repr(x))
        else:
            parts.append(type(x).__qualname__)

    walk(args)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def step_folder(identity: str, device: torch.device) -> Path:
    """The folder of a step's saved parts: inside inductor's cache folder (so that
    ``TORCHINDUCTOR_CACHE_DIR``, and the server's ``--compile-cache``, move both), named by a
    digest of ``identity``, the project's source, the Python / torch / Triton / CUDA versions
    and the GPU (a variant keeps the code it was compiled from, whatever changed since)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # (inductor: on first use)

    digest = hashlib.sha256(identity.encode())
    for package in ("minikv_compile", "minikv_compile.graphs", "minikv_compile.models",
                    "minikv_compile.ops"):
        folder = Path(importlib.import_module(package).__path__[0])
        for source in sorted(folder.glob("*.py")):
            digest.update(source.read_bytes())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    digest.update(repr((platform.python_version(), torch.__version__, torch.version.cuda,
                        triton.__version__, gpu)).encode())
    return Path(cache_dir()) / "minikv_steps" / digest.hexdigest()[:24]

