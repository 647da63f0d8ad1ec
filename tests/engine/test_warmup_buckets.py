"""Which batch sizes the worker's --warmup-state-tokens captures graphs for (the GPU side is test_gpu.py's)."""
from engine.graphs import B_BUCKETS, batch_buckets


def test_batch_buckets_cover_every_batch_up_to_max_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert batch_buckets(44) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]     # 41-48 states run in the 48 graph
    assert batch_buckets(1000) == list(B_BUCKETS)            # chunks of 128 and any remainder
