"""``CacheShares``: the idle blocks that caches above a device report per tag, summed over the
sources, each source counted once; and the memory report's cached share of a tag."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

import xlog_actors as xa
from xlog_actors.memory.block import AllocTag
from xlog_actors.memory.cache_share import CacheShares

T, U = AllocTag("t"), AllocTag("u")


def test_usage_sums_the_sources_per_tag_and_leaves_out_empty_tags() -> None:
    shares = CacheShares()
    assert shares.usage() == {}
    figures: dict[AllocTag, tuple[int, int]] = {T: (2, 300), U: (0, 0)}

    def first() -> Mapping[AllocTag, tuple[int, int]]:
        return figures

    def second() -> Mapping[AllocTag, tuple[int, int]]:
        return {T: (1, 50)}

    shares.add(first)
    shares.add(first)  # once however often added
    shares.add(second)
    assert shares.usage() == {T: (3, 350)}
    figures[U] = (1, 10)  # read anew at each call
    assert shares.usage() == {T: (3, 350), U: (1, 10)}
    shares.discard(first)
    shares.discard(first)  # not there any more: nothing happens
    assert shares.usage() == {T: (1, 50)}


def test_a_failing_source_fails_the_read_and_changes_nothing() -> None:
    shares = CacheShares()

    def broken() -> Mapping[AllocTag, tuple[int, int]]:
        raise RuntimeError("broken source")

    shares.add(broken)
    with pytest.raises(RuntimeError, match="broken source"):
        shares.usage()
    shares.discard(broken)
    assert shares.usage() == {}


def test_the_report_shows_the_cached_share_beside_the_tag(driver: xa.Driver) -> None:
    pool = xa.StreamPool(driver, 0)
    resource = xa.AsyncCudaResource(driver, 0, pool)
    try:
        block = resource.allocate(4096, xa.StreamId.DEFAULT, T)
        report = xa.memory_report(resource, cached={T: (1, 4096)})
        assert report.by_tag[T].nbytes == 4096 and report.cached_by_tag[T].nbytes == 4096
        assert report.as_dict()["cached"] == {
            "count": 1, "nbytes": 4096, "by_tag": {"t": {"count": 1, "nbytes": 4096, "oldest_age_s": None}}}
        assert "t: 1 blocks, 4.0 KiB (4.0 KiB in 1 idle in a cache)" in report.format()
        bare = xa.memory_report(resource)
        assert dict(bare.cached_by_tag) == {} and "idle in a cache" not in bare.format()
        assert bare.as_dict()["cached"] == {"count": 0, "nbytes": 0, "by_tag": {}}
        resource.deallocate(block)
    finally:
        pool.close()
