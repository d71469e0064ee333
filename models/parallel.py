"""Tensor parallelism: which share of a model a rank holds, and the collectives between ranks.

One process per device (``torchrun --nproc-per-node N``), ``torch.distributed``'s default process
group (NCCL on CUDA, gloo on the CPU). Rank ``r`` of ``N`` holds KV heads
``[r H_kv / N, (r + 1) H_kv / N)`` with the query heads of their GQA groups, the same share of
the MLP's intermediate features and the ``r``-th slice of the vocabulary (``shard_model`` cuts a
Llama-family model so); the decode step and prefill then need only ``all_reduce`` (after o_proj
and down_proj) and ``gather_vocab`` (the logits). Both are
``torch.distributed._functional_collectives``, which ``torch.compile(fullgraph=True)`` traces
into the compiled step (and NCCL captures into a CUDA graph); with one rank they return their
input and no collective runs, so a single-device engine runs the same code.

Over NCCL on GPUs, an all-reduce of at most ``ONE_SHOT_BYTES`` (a decode step's ``(B, hidden)``
sums) is instead one kernel that reads every rank's copy through NVLink from symmetric memory
(``minikv::one_shot_all_reduce``, torch's ``symm_mem.one_shot_all_reduce_copy``): the step runs
two a layer, and with them the 70B shape's step over 4 H200s at 1 x 32k took 12.56 ms against
NCCL's 14.03 (NVLink SHARP off, ``NCCL_NVLS_ENABLE=0``), the GPU idle 0.16 ms a step against
1.36 (``perf/results/h200x4/tp4_eebd8a6/``).
``MINIKV_ONE_SHOT=0`` in the environment keeps NCCL for every all-reduce (that A/B).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

ONE_SHOT_BYTES = 256 * 1024
"""The largest all-reduce the one-shot kernel takes: 16 rows of the 70B shape's hidden size
(8192) in bf16, every decode bucket up to 16. Each rank reads every other rank's whole copy,
so its reads grow with the rows (N - 1 copies against a ring's 2 (N - 1) / N); torch's own
intra-node all-reduce leaves one-shot at this size too (not measured here)."""

# group name -> (the group, this rank's symmetric buffer of ONE_SHOT_BYTES bytes)
_ONE_SHOT_BUFFERS: dict = {}


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world`` ranks over ``group`` (None with one rank)."""

    rank: int = 0
    world: int = 1
    group: Optional[Any] = None
    one_shot: str = ""  # the group's name where its small all-reduces are one-shot, else ""

    @classmethod
    def from_default_group(cls, size: int) -> "TensorParallel":
        """``size`` ranks over ``torch.distributed``'s default process group, which the caller
        (torchrun's script) initialized with exactly ``size`` ranks; ``size == 1``: one rank."""
        if size == 1:
            return cls()
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"tensor_parallel: expected torch.distributed initialized with "
                             f"{size} ranks (torchrun --nproc-per-node {size}, then "
                             f"torch.distributed.init_process_group()), got no process group")
        world = dist.get_world_size()
        if world != size:
            raise ValueError(f"tensor_parallel: expected the default process group's world "
                             f"size, {world}, got {size}")
        return cls(rank=dist.get_rank(), world=world, group=dist.group.WORLD,
                   one_shot=_reserve_one_shot(dist.group.WORLD))

    def split(self, name: str, n: int) -> slice:
        """This rank's share ``[r n / N, (r + 1) n / N)`` of ``n`` heads or features, or
        ``ValueError`` naming ``name`` when ``n`` does not divide by the ranks."""
        if n % self.world:
            raise ValueError(f"tensor_parallel={self.world}: expected {name} divisible by "
                             f"{self.world} (each rank holds an equal share), got {n}")
        share = n // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (partial products of a row-parallel projection): the
        one-shot kernel where the group has its buffer and ``x`` fits it, else NCCL's."""
        if self.world == 1:
            return x
        nbytes = x.numel() * x.element_size()
        if (self.one_shot and x.dtype in (torch.bfloat16, torch.float32)
                and nbytes <= ONE_SHOT_BYTES and nbytes % 16 == 0):  # (its widest vectors)
            return _one_shot_all_reduce(x, self.one_shot)
        return funcol.all_reduce(x, "sum", self.group)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``(B, V_r)`` logits of this rank's vocabulary slice -> ``(B, vocab_size)``: every
        rank's slice side by side, the last one's padding rows cut off (``shard_rows``)."""
        if self.world == 1:
            return logits
        B, n = logits.shape
        every = funcol.all_gather_tensor(logits, 0, self.group)          # (N * B, V_r)
        return every.view(self.world, B, n).transpose(0, 1).reshape(B, -1)[:, :vocab_size]

    def from_rank0(self, value: int, device: torch.device) -> int:
        """Rank 0's ``value`` on every rank (eager, between steps: a seed drawn from each
        process's own generator must be one seed)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())

    def check_same(self, name: str, value: Any) -> None:
        """``ValueError`` on every rank unless every rank passed an equal ``value`` (by the hash
        of its pickle): ranks that admit different requests would run one step over different
        batches and return nonsense rather than fail."""
        if self.world == 1:
            return
        digest = hashlib.sha256(pickle.dumps(value)).hexdigest()
        every = [None] * self.world
        dist.all_gather_object(every, digest, group=self.group)
        differ = [r for r, d in enumerate(every) if d != every[0]]
        if differ:
            raise ValueError(f"{name}: expected the same arguments on every rank (rank 0's), "
                             f"got different ones on ranks {differ}")


def _uses_nccl(group) -> bool:
    """Whether ``group``'s CUDA tensors go through NCCL (``init_process_group("nccl")``, or no
    backend named, which pairs gloo with NCCL)."""
    if dist.get_backend(group) == "nccl":
        return True
    try:
        return type(group._get_backend(torch.device("cuda"))).__name__ == "ProcessGroupNCCL"
    except (RuntimeError, AttributeError):  # no CUDA backend
        return False


def _agree(ok: bool, group, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a collective)."""
    every = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(every, dist.ReduceOp.MIN, group=group)
    return bool(every.item())


def _reserve_one_shot(group) -> str:
    """Allocate and exchange (a collective: every rank calls it) this rank's symmetric buffer of
    ``ONE_SHOT_BYTES`` for ``group`` on the current GPU, once per group, and return the group's
    name; "" (NCCL for every all-reduce) off NCCL, or where any rank goes without: no symmetric
    memory in this torch, ``MINIKV_ONE_SHOT=0``, an allocation or an exchange that failed (GPUs
    without peer access), or a group of the same name made anew (its old buffer is stale). The
    ranks agree before the exchange and after it, for one rank on NCCL and another on one-shot
    would hang. NVLink multicast stays off: the one-shot kernel reads peers' buffers through
    their mapped addresses and needs no multicast object."""
    if not _uses_nccl(group):
        return ""
    name = group.group_name
    known = _ONE_SHOT_BUFFERS.get(name)
    device = torch.device("cuda", torch.cuda.current_device())
    buffer, error = None, None
    # (an entry outlives its group: torch keeps the old group's store under the same name, so a
    # group made anew takes NCCL; and MINIKV_ONE_SHOT is read only before the first buffer)
    if known is not None:
        error = None if known[0] is group else "a group of this name was made anew"
    elif os.environ.get("MINIKV_ONE_SHOT") == "0":
        error = "MINIKV_ONE_SHOT=0"
    elif not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        error = "no symm_mem.one_shot_all_reduce_copy in this torch"
    elif not all(torch.cuda.can_device_access_peer(device.index, j)
                 for j in range(torch.cuda.device_count()) if j != device.index):
        error = "a GPU this rank sees has no peer access to its own"  # (the exchange would stall)
    else:
        import torch.distributed._symmetric_memory as symm_mem

        try:
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            symm_mem.enable_symm_mem_for_group(name)
            buffer = symm_mem.empty(ONE_SHOT_BYTES, dtype=torch.uint8, device=device)
        except Exception as e:  # noqa: BLE001 - whatever the driver raises, NCCL still works
            error = e
    if _agree(error is None, group, device):  # (every rank's history is the same: if one
        if known is not None:                  # holds its buffer, every one does)
            return name
        try:
            symm_mem.rendezvous(buffer, name)
        except Exception as e:  # noqa: BLE001
            error = e
        if _agree(error is None, group, device):
            _ONE_SHOT_BUFFERS[name] = (group, buffer)
            return name
    if str(error) != "MINIKV_ONE_SHOT=0":
        reason = "another rank's failed" if error is None else error
        warnings.warn(f"tensor_parallel: no one-shot all-reduce ({reason}); every all-reduce "
                      f"goes through NCCL")
    return ""


@torch.library.custom_op("minikv::one_shot_all_reduce", mutates_args=())
def _one_shot_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the ranks of ``group_name`` of each one's ``x`` (any shape, at most
    ``ONE_SHOT_BYTES``, bf16 or fp32): one kernel copies ``x`` into this rank's symmetric
    buffer, waits for every rank's copy, and adds them in rank order (the same bits on every
    rank), then waits for every rank's reads before the buffer can be written again. Opaque to
    the compiler: it sees neither the buffer nor its exchange."""
    flat = x.reshape(-1)
    if flat.storage_offset():  # the kernel takes its alignment from the buffer's offset, 0
        flat = flat.clone()
    buffer = _ONE_SHOT_BUFFERS[group_name][1]
    if buffer.device != x.device:
        raise ValueError(f"one_shot_all_reduce: expected x on {buffer.device}, where the "
                         f"group's buffer is, got {x.device}")
    buffer = buffer.view(x.dtype)[: flat.numel()]
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, flat, "sum",
                                                       group_name).view(x.shape)


@_one_shot_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty(x.shape)  # (contiguous, as the kernel's output)


def join_torchrun(name: str, size: Optional[int], cuda: bool, timeout_s: float) -> torch.device:
    """This process, one rank of a ``torchrun`` launch, joins the default process group (NCCL
    with ``cuda``, gloo otherwise; a collective waiting ``timeout_s`` for a rank fails) and
    returns its device (``cuda:LOCAL_RANK``, or the CPU). ``ValueError`` naming ``name`` outside
    torchrun, or when torchrun's world size is not ``size`` (None: any)."""
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    n = "N" if size is None else size
    if None in env.values():
        raise ValueError(f"{name}: expected a launch by torchrun --nproc-per-node {n} (RANK, "
                         f"WORLD_SIZE and LOCAL_RANK set), got a single process")
    if size is not None and int(env["WORLD_SIZE"]) != size:
        raise ValueError(f"{name}: expected torchrun's world size, {env['WORLD_SIZE']}, got "
                         f"{size}")
    device = torch.device("cuda", int(env["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def row_share(n: int, tp: TensorParallel) -> Tuple[slice, int]:
    """(this rank's rows of ``n``, the share ``ceil(n / N)`` every rank holds): rank ``r`` holds
    rows ``[r s, (r + 1) s)`` cut at ``n``, the last rank's share padded with zeros (a vocabulary
    need not divide by the ranks; the gathered padding is cut off)."""
    share = -(-n // tp.world)
    return slice(min(n, tp.rank * share), min(n, (tp.rank + 1) * share)), share


def shard_rows(w: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's share of the rows of ``w (n, ...)`` (``row_share``), zero-padded."""
    rows, share = row_share(w.shape[0], tp)
    out = w.new_zeros(share, *w.shape[1:])
    out[: rows.stop - rows.start] = w[rows]
    return out



def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Keep rank ``tp.rank``'s share of every layer and of the LM head of a Llama-family
    ``*ForCausalLM``, in place (the full tensors are freed), and mark the model
    (``model.minikv_shard = (rank, world)``): an adapter of the same rank takes it as it is.
    The adapter calls it on a whole model; a caller may call it first, on a model on the meta
    device, and materialize the shard alone (a model larger than the host's memory): then the
    non-persistent buffers (RoPE's ``inv_freq``) are computed anew and, on ranks other than 0,
    o_proj's and down_proj's biases stay zero.

    Attention by KV heads: k/v_proj rows of KV heads ``[r H_kv / N, (r + 1) H_kv / N)``,
    q_proj rows of the query heads of their GQA groups (query head ``i`` reads KV head
    ``i // (H_q / H_kv)``, so an equal split of both keeps each group on one rank), o_proj
    columns of those query heads. MLP by intermediate features: gate/up rows, down_proj
    columns. o_proj and down_proj give partial sums that the adapter all-reduces, so their
    biases stay on rank 0 alone (zeros elsewhere: added once, not N times). The LM head by
    vocabulary rows (``shard_rows``: any vocabulary size), as a parameter of its own, so that
    tied input embeddings stay whole. Embeddings and norms stay whole on every rank.

    Raises ``ValueError`` (before anything is touched) when the heads or the intermediate size
    do not divide by the ranks, or the model is a shard already.
    """
    if getattr(model, "minikv_shard", None) is not None:
        raise ValueError(f"model: expected a whole model, got the shard of rank "
                         f"{model.minikv_shard[0]} of {model.minikv_shard[1]}")
    _cut(model, _shard_plan(model, tp), tp)


def _cut(model: nn.Module, plan: dict, tp: TensorParallel) -> None:
    """Cut ``model``'s parameters by ``plan`` (``_shard_plan``) and mark it as the shard."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied LM head too
    with torch.no_grad():
        for name, (how, part) in plan.items():
            p = params[name]
            if how == "rows":
                p.data = p.data[part].clone(memory_format=torch.contiguous_format)
            elif how == "cols":
                p.data = p.data[:, part].clone(memory_format=torch.contiguous_format)
            elif how == "zero":
                p.data.zero_()
            else:  # "vocab": a parameter of its own (tied embeddings stay whole)
                module, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
                setattr(module, attr, nn.Parameter(shard_rows(p.detach(), tp), p.requires_grad))
    model.minikv_shard = (tp.rank, tp.world)


def _shard_plan(model: nn.Module, tp: TensorParallel) -> dict:
    """How rank ``tp.rank`` keeps each parameter of a Llama-family ``*ForCausalLM`` that it does
    not keep whole: ``{name: (how, part)}``, ``how`` one of ``"rows"`` / ``"cols"`` (of a weight;
    a bias follows its weight's rows), ``"zero"`` (a row-parallel projection's bias on a rank
    other than 0) and ``"vocab"`` (``shard_rows``). ``shard_model`` cuts by it, ``load_shard``
    reads by it. ``ValueError`` when the heads or the intermediate size do not divide."""
    layers = list(model.model.layers)
    n_q, n_kv, D = model_heads(model.config)
    heads = tp.split("num_key_value_heads", n_kv)
    q_heads = tp.split("num_attention_heads", n_q)
    ff = tp.split("intermediate_size", layers[0].mlp.gate_proj.weight.shape[0])
    q_rows = slice(q_heads.start * D, q_heads.stop * D)
    kv_rows = slice(heads.start * D, heads.stop * D)
    plan = {}
    for i, block in enumerate(layers):
        attn, mlp = block.self_attn, block.mlp
        for proj, rows in (("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows),
                           ("self_attn.v_proj", kv_rows), ("mlp.gate_proj", ff),
                           ("mlp.up_proj", ff)):
            plan[f"model.layers.{i}.{proj}.weight"] = ("rows", rows)
            if block.get_submodule(proj).bias is not None:
                plan[f"model.layers.{i}.{proj}.bias"] = ("rows", rows)
        for proj, cols in (("self_attn.o_proj", q_rows), ("mlp.down_proj", ff)):
            plan[f"model.layers.{i}.{proj}.weight"] = ("cols", cols)
            if block.get_submodule(proj).bias is not None and tp.rank != 0:
                plan[f"model.layers.{i}.{proj}.bias"] = ("zero", None)
    for name in ("weight", "bias"):
        if getattr(model.lm_head, name) is not None:
            plan[f"lm_head.{name}"] = ("vocab", None)
    return plan


def model_heads(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the whole model, from its HF config."""
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    return n_q, n_kv, getattr(config, "head_dim", None) or config.hidden_size // n_q


__all__ = ["TensorParallel", "join_torchrun", "model_heads", "row_share", "shard_model",
           "shard_rows"]
