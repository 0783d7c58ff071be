"""hyla's cache room: memory pools and the radix tree that indexes them (see docs/cache.md).

Knows nothing of models: the engine and the simulator drive it through this public API.
"""

from hyla.cache.allocator import PoolExhaustedError
from hyla.cache.host_cache import HostCache
from hyla.cache.kv_pool import KVPool
from hyla.cache.layout import CacheLayout
from hyla.cache.ledger import CacheLedger
from hyla.cache.memory import MemorySplit, split_memory
from hyla.cache.policy import EvictionPolicy, LRUPolicy
from hyla.cache.prefix_transfer import CachedPrefix
from hyla.cache.radix_cache import RadixCache
from hyla.cache.radix_types import Checkpoint, InsertResult, MatchResult, TreeNode
from hyla.cache.req_pool import ReqToTokenPool
from hyla.cache.state_pool import StatePool

__all__ = [
    "CacheLayout",
    "CacheLedger",
    "CachedPrefix",
    "Checkpoint",
    "EvictionPolicy",
    "HostCache",
    "InsertResult",
    "KVPool",
    "LRUPolicy",
    "MatchResult",
    "MemorySplit",
    "PoolExhaustedError",
    "RadixCache",
    "ReqToTokenPool",
    "StatePool",
    "TreeNode",
    "split_memory",
]
