"""Block hashes are deterministic: every process (any PYTHONHASHSEED) computes the same chain,
and the KV manager's prefix-cache keys are exactly `block_hashes` of the request's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from photon.engine.block_hash import HASH_BITS, ROOT_HASH, block_hashes, hash_block
from photon.engine.kv_cache import KVCacheManager

TOKENS = [(i * 7919) % 5003 for i in range(53)]
BLOCK_SIZE = 8

# The manager's cached hashes for TOKENS (a child process prints them as JSON).
_CHILD = """
import json
from photon.engine.block_hash import block_hashes
from photon.engine.kv_cache import KVCacheManager
tokens = json.loads(input())
kv = KVCacheManager(16, 8)
kv.allocate("r", len(tokens))
kv.cache_blocks("r", tokens, len(tokens))
print(json.dumps([block_hashes(tokens, 8), sorted(kv._hash_to_block)]))
"""


def _cache_keys(tokens: list[int]) -> list[int]:
    kv = KVCacheManager(16, BLOCK_SIZE)
    kv.allocate("r", len(tokens))
    kv.cache_blocks("r", tokens, len(tokens))
    return sorted(kv._hash_to_block)


def test_pinned_values() -> None:
    # The wire values: a change here breaks every router that hashes prompts itself.
    assert ROOT_HASH == 7915306544045119489
    assert block_hashes(list(range(40)), 16) == [8903872112442680433, 963814580040012826]


def test_chain_and_range() -> None:
    hashes = block_hashes(TOKENS, BLOCK_SIZE)
    assert len(hashes) == len(TOKENS) // BLOCK_SIZE
    parent = ROOT_HASH
    for i, h in enumerate(hashes):
        assert h == hash_block(parent, TOKENS[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        assert 0 <= h < 2 ** HASH_BITS
        parent = h
    assert sorted(hashes) == _cache_keys(TOKENS)


def test_extra_keys_change_the_hashes() -> None:
    plain = block_hashes(TOKENS, BLOCK_SIZE)
    lora = block_hashes(TOKENS, BLOCK_SIZE, extra=(3,))
    assert set(plain).isdisjoint(lora)
    assert block_hashes(TOKENS, BLOCK_SIZE, extra=()) != plain
    assert block_hashes(TOKENS, BLOCK_SIZE, extra=(3,)) == lora
    with pytest.raises(TypeError, match="extra keys"):
        block_hashes(TOKENS, BLOCK_SIZE, extra=(1.5,))
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0)


@pytest.mark.parametrize("seed", ["1", "2"])
def test_same_values_in_another_process(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(TOKENS), env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    theirs, their_keys = json.loads(out.stdout)
    assert theirs == block_hashes(TOKENS, BLOCK_SIZE)
    assert their_keys == _cache_keys(TOKENS) == sorted(theirs)
