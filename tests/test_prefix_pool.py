"""The prefix pool alone (no engine, no server): matching, scopes, bytes, LRU, the host tier and
the disk's names. Snapshots here are synthetic: one layer whose ring holds ``rows`` rows of 8
fp32 values (32 bytes a row), so an entry's bytes are known exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minikv_compile.graphs.cache import SlotSnapshot
from minikv_compile.prefix_pool import (DiskContexts, PrefixPool, prefix_hashes,
                                        snapshot_bytes)

ROW = 2 * 8 * 4  # k_ring and v_ring rows of one head x 8 fp32 values


def snap(tokens, rows=None, logits=True) -> SlotSnapshot:
    rows = len(tokens) if rows is None else rows
    layer = {"k_cache": torch.zeros(1, 0, 8), "v_cache": torch.zeros(1, 0, 8),
             "k_ring": torch.full((1, rows, 8), float(len(tokens))),
             "v_ring": torch.zeros(1, rows, 8)}
    return SlotSnapshot(tokens=tuple(tokens), lens=((0, rows),), layers=[layer], host=None,
                        logits=torch.zeros(4) if logits else None)


def size(tokens, logits=True) -> int:
    return len(tokens) * ROW + (16 if logits else 0)


def test_prefix_hashes_are_the_hash_of_each_prefix():
    ids = [5, 0, 7, 7, 3]
    h = prefix_hashes(ids)
    for i in range(len(ids)):
        assert prefix_hashes(ids[: i + 1])[-1] == h[i]
    # a leading 0 is not the empty prefix; order matters
    assert prefix_hashes([0])[0] != 0
    assert prefix_hashes([1, 2])[-1] != prefix_hashes([2, 1])[-1]
    assert prefix_hashes([]).shape == (0,)


def test_snapshot_bytes_counts_tensors_and_logits():
    assert snapshot_bytes(snap([1, 2, 3])) == size([1, 2, 3])
    assert snapshot_bytes(snap([1, 2, 3], logits=False)) == size([1, 2, 3], logits=False)


def test_lookup_returns_the_longest_context_that_starts_the_prompt():
    pool = PrefixPool(10**6)
    a, ab, other = [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9]
    for t in (a, ab, other):
        assert pool.add("s", snap(t))
    assert pool.lookup("s", [1, 2, 3, 4, 5, 6]).tokens == tuple(ab)
    assert pool.lookup("s", [1, 2, 3, 4, 6]).tokens == tuple(a)
    assert pool.lookup("s", [1, 2, 9, 9]).tokens == tuple(other)
    assert pool.lookup("s", [1, 2]) is None          # shorter than every context
    assert pool.lookup("s", [7, 1, 2, 3, 4]) is None  # contexts must start the prompt
    # a prompt equal to a context: a hit only with the context's last logits
    assert pool.lookup("s", a).tokens == tuple(a)
    pool.add("s", snap([8, 8], logits=False))
    assert pool.lookup("s", [8, 8]) is None
    assert pool.lookup("s", [8, 8, 1]).tokens == (8, 8)


def test_scopes_never_share():
    pool = PrefixPool(10**6)
    pool.add(("salt-a", (0.5, 0.25)), snap([1, 2, 3]))
    assert pool.lookup(("salt-a", (0.5, 0.25)), [1, 2, 3, 4]) is not None
    assert pool.lookup(("salt-b", (0.5, 0.25)), [1, 2, 3, 4]) is None
    assert pool.lookup(("salt-a", (0.5, 0.125)), [1, 2, 3, 4]) is None
    assert pool.lookup((None, (0.5, 0.25)), [1, 2, 3, 4]) is None


def test_bytes_bound_evicts_least_recently_used():
    t1, t2, t3 = [1] * 4, [2] * 4, [3] * 4
    pool = PrefixPool(2 * size(t1))  # room for two
    assert pool.add("s", snap(t1)) and pool.add("s", snap(t2))
    assert pool.nbytes == 2 * size(t1) and len(pool) == 2
    assert pool.lookup("s", t1 + [0]) is not None  # t1 now the most recently used
    assert pool.add("s", snap(t3))
    assert [c[1] for c in pool.contexts()] == [tuple(t1), tuple(t3)]  # t2 went
    assert pool.evictions == 1 and pool.nbytes == 2 * size(t1)
    assert pool.lookup("s", t2 + [0]) is None


def test_a_context_over_the_bound_is_refused_and_evicts_nothing():
    small = [1] * 2
    pool = PrefixPool(size(small) + 10)
    assert pool.add("s", snap(small))
    assert not pool.add("s", snap([2] * 3))
    assert [c[1] for c in pool.contexts()] == [tuple(small)] and pool.evictions == 0


def test_off_pool_keeps_nothing():
    pool = PrefixPool(0)
    assert not pool.enabled and not pool.add("s", snap([1]))
    assert pool.lookup("s", [1, 2]) is None and len(pool) == 0


def test_same_tokens_replace_the_entry():
    pool = PrefixPool(10**6)
    pool.add("s", snap([1, 2]))
    newer = snap([1, 2], rows=3)
    pool.add("s", newer)
    assert len(pool) == 1 and pool.nbytes == snapshot_bytes(newer)
    assert pool.lookup("s", [1, 2, 3]) is newer


def test_host_tier_takes_evicted_contexts_and_gives_them_back():
    t1, t2, t3 = [1] * 4, [2] * 4, [3] * 4
    pool = PrefixPool(size(t1), host_bytes=size(t1))
    pool.add("s", snap(t1))
    pool.add("s", snap(t2))  # t1 to the host tier
    assert (pool.nbytes, pool.host_nbytes) == (size(t1), size(t1))
    assert [c[2] for c in pool.contexts()] == [False, True]
    got = pool.lookup("s", t1 + [9])  # back on the device, t2 to the host
    assert got.tokens == tuple(t1) and torch.equal(got.layers[0]["k_ring"],
                                                   torch.full((1, 4, 8), 4.0))
    assert {c[1]: c[2] for c in pool.contexts()} == {tuple(t1): True, tuple(t2): False}
    pool.add("s", snap(t3))  # t1 to the host, t2 (the oldest there) dropped
    assert {c[1]: c[2] for c in pool.contexts()} == {tuple(t1): False, tuple(t3): True}
    assert pool.evictions == 1


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="gpu_bytes: expected an int >= 0, got -1"):
        PrefixPool(-1)
    with pytest.raises(ValueError, match="host_bytes: expected 0 while gpu_bytes is 0"):
        PrefixPool(0, host_bytes=10)


def test_loader_is_asked_on_a_miss_and_its_context_kept():
    asked = []

    def loader(scope, prompt, hashes):
        asked.append(tuple(prompt))
        assert np.array_equal(hashes, prefix_hashes(prompt))
        return snap([4, 5]) if list(prompt[:2]) == [4, 5] else None

    pool = PrefixPool(10**6, loader=loader)
    assert pool.lookup("s", [4, 5, 6]).tokens == (4, 5)
    assert pool.lookup("s", [4, 5, 7]).tokens == (4, 5)  # now resident: not asked again
    assert pool.lookup("s", [1]) is None
    assert asked == [(4, 5, 6), (1,)]


def test_disk_contexts_by_name(tmp_path):
    written = {}

    def write(s, path):
        written[path] = s
        open(path, "wb").close()

    disk = DiskContexts(tmp_path, write, lambda path: written[path])
    disk.save("s", snap([1, 2, 3]))
    disk.save("s", snap([1, 2]))
    disk.save("s", snap([1, 2]))  # written once
    disk.flush()
    assert len(written) == 2
    prompt = [1, 2, 3, 4]
    assert disk.load("s", prompt, prefix_hashes(prompt)).tokens == (1, 2, 3)
    assert disk.load("t", prompt, prefix_hashes(prompt)) is None  # another scope
    # a new instance finds the files by their names
    again = DiskContexts(tmp_path, write, lambda path: written[path])
    assert again.load("s", [1, 2, 5], prefix_hashes([1, 2, 5])).tokens == (1, 2)

    def refuse(path):
        raise ValueError("path.config.bits: expected this engine's 2, got 4")

    broken = DiskContexts(tmp_path, write, refuse)
    assert broken.load("s", prompt, prefix_hashes(prompt)) is None
    assert len(broken.skipped) == 2 and "bits" in broken.skipped[0]

    def no_room(path):  # any failure to read one is a miss: its prompt is prefilled
        raise RuntimeError("CUDA out of memory (simulated)")

    full = DiskContexts(tmp_path, write, no_room)
    assert full.load("s", prompt, prefix_hashes(prompt)) is None
    assert full.load("s", prompt, prefix_hashes(prompt)) is None  # not asked again
    assert len(full.skipped) == 2 and all(
        x.endswith(": RuntimeError: CUDA out of memory (simulated)") for x in full.skipped)
    for d in (disk, again, broken, full):
        d.close()


def test_a_failed_write_is_recorded_and_the_context_not_listed(tmp_path):
    def full(s, path):
        raise OSError(28, "No space left on device")

    disk = DiskContexts(tmp_path, full, lambda path: None)
    disk.save("s", snap([1, 2]))
    disk.close()
    assert len(disk.failed) == 1 and "No space left" in disk.failed[0]
    assert disk.load("s", [1, 2, 3], prefix_hashes([1, 2, 3])) is None
