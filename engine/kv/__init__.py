"""The paged KV memory: one pool of fixed-size blocks per layer, the allocator that hands
them out (free list, refcounts, copy-on-write forks), block tables, the prefix index of
full blocks and the allocator's invariants.
"""
