"""The worker service: runs the model and streams sampled tokens back (README, "Architecture").

Importing the package asks torch's CPU allocator for transparent huge pages (2 MB) under large
tensors (the KV cache, weights, their packed copies, big activations) unless THP_MEM_ALLOC_ENABLE
is set already (0 turns it off); torch reads the setting at its first large allocation, which in
every worker comes after this import. Why: the paged attention kernel reads each block of a row's
KV at a random place in a pool of hundreds of MB, a new 4 KB page (a TLB miss, dearer under
virtualisation) at every block. Medium shapes, 64 rows x 1,024 tokens of context, 2 threads, the
median of five runs in each of two interleaved orders: 12.05-12.2 ms per layer with 4 KB pages,
11.4 and 11.0 with this setting; 2 MB pages under the KV cache alone (madvise on the cache only)
gave 11.96-11.98, so the setting stays process-wide, although only the cache's share of the gain
is explained. Whole forward passes in process (1 and 64 rows) did not change beyond the host's
noise; served, in two interleaved rounds (`benchmarks.peer_bench --peers ""`, a fresh server
each), the medium model at 64 streams went 229.4 / 234.1 -> 251.0 / 242.6 output tok/s and the
small one at one stream 346.9 / 388.3 -> 339.1 / 418.0 (unchanged within the noise). Where the
host's THP mode is "never", nothing changes. Large temporaries made every step would then fault
in fresh huge pages each time; glibc is told to keep them in its heap (allocator.py).
"""

import os

from services.worker.allocator import keep_large_temporaries_in_the_heap

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
keep_large_temporaries_in_the_heap()
