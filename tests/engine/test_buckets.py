"""The batch buckets a step is padded to, and the longest prefix of a batch that needs no padded row
(``engine.buckets.unpadded_prefix``: what ``--unpadded-batches`` launches)."""
from engine.buckets import B_BUCKETS, bucket, unpadded_prefix


def test_a_batch_on_a_bucket_is_launched_whole():
    for n in (1, 5, 8, 10, 16, 40, 128, 256):
        assert unpadded_prefix([1] * n) == n


def test_a_batch_between_buckets_keeps_the_largest_bucket_below_it():
    assert [unpadded_prefix([1] * n) for n in (9, 17, 19, 21, 72, 127, 130, 200)] == [8, 16, 16, 20, 64, 112, 130, 192]
    for n in range(1, 300):
        kept = unpadded_prefix([1] * n)
        rest = kept % 128
        assert kept <= n and (rest == 0 or bucket(rest, B_BUCKETS) == rest)
        assert n - kept <= n // 5           # the buckets are at most 20% apart above 8


def test_rows_of_independent_schemas_count_as_rows():
    # an independent schema of 10 questions takes 10 rows a state: 10 states are 100 rows (bucket 112), 8 are 80
    assert unpadded_prefix([10] * 10) == 8
    assert unpadded_prefix([10] * 13) == 13          # 128 + 2 rows: a full step and one of 2
    assert unpadded_prefix([1, 10, 1, 1]) == 3       # 12 rows; 13 would pad to 14
    assert unpadded_prefix([9, 9]) == 2              # no prefix lands on a bucket (9, 18): nothing to gain


def test_an_engine_without_graphs_launches_every_state(se):
    from tests.engine.conftest import make_questions

    h = se.prepare(make_questions([2, 3]))
    assert not se.graphs.enabled and se.unpadded_count([h] * 19) == 19
    se.release(h)
