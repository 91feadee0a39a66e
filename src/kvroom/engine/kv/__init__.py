"""The KV pool, the heart of kvroom: every block's life from allocation to release.

- ``pages``: reserved address space per layer tensor; commit / release pages of blocks;
- ``pool``: ``KVCachePool``, the only KV allocation, exactly the plan's bytes;
- ``block_manager``: refcounted blocks, sharing, copy-on-write, sliding slots;
- ``prefix_cache``: hash chain of full blocks and the LRU of cached-free blocks;
- ``migration``: which blocks move where when the pool shrinks; ``ResizeResult``;
- ``live_pool``: what a live resize request means (N or auto) and the pool's state;
- ``elastic``: the pool following the memory the machine has free;
- ``heap_guard``: the heap kept within the plan's total between steps.
"""
