"""Configs the tests share."""
from functools import partial

from minikv_compile import MiniKVConfig

# The library's default before issue 47 (SnapKV 25% + 25% kept, 2 bit, groups of 16, no rotation,
# no recall): the cache the engine, runtime and serving tests were written against, fields on
# top. ``MiniKVConfig()`` keeps every token since; the tests of the default name it.
snapkv = partial(MiniKVConfig.preset, "snapkv")
