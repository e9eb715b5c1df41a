"""`serving.prefix_cache.PrefixStore`: the longest saved prompt a new one begins with, reused in whole grains, the
least recently used out first within the byte budget (the engine's use of it: tests/test_serve.py)."""

import pytest

from clover_jax.serving.prefix_cache import Hit, PrefixStore


def _store(grain=1, budget=3):
    return PrefixStore(grain, entry_bytes=10, budget_bytes=budget * 10)


def test_the_longest_saved_prompt_a_new_one_begins_with():
    store = _store()
    for p in [(1, 2), (1, 2, 3, 4), (1, 9)]:
        assert store.put(p, lambda p=p: f"cache of {p}") == f"cache of {p}"
    assert store.lookup((1, 2, 3, 4, 5)) == Hit("cache of (1, 2, 3, 4)", 4, 4)
    assert store.lookup((1, 2, 3, 4)) == Hit("cache of (1, 2, 3, 4)", 4, 4)  # the same prompt: all of it
    assert store.lookup((1, 2, 3)) == Hit("cache of (1, 2)", 2, 2)  # not the longer one it is a prefix of
    assert store.lookup((2, 1)) is None and store.lookup((1,)) is None
    assert (len(store), store.nbytes) == (3, 30)


def test_reuse_is_cut_to_whole_grains():
    store = PrefixStore(4, entry_bytes=10, budget_bytes=100)
    assert store.put((1, 2, 3), lambda: "short") is None  # under a grain: nothing to reuse
    store.put(tuple(range(10)), lambda: "ten")
    assert store.lookup(tuple(range(12))) == Hit("ten", 10, 8)
    store.put((0, 1, 2, 99), lambda: "four")
    assert store.lookup((0, 1, 2, 99, 5)) == Hit("four", 4, 4)
    with pytest.raises(ValueError):
        PrefixStore(0, 1, 1)


def test_the_least_recently_used_goes_first():
    store = _store(budget=2)
    store.put((1,), lambda: "a")
    store.put((2,), lambda: "b")
    assert store.lookup((1, 5)).cache == "a"  # (1,) used: (2,) is now the least recent
    calls = []
    assert store.put((1,), lambda: calls.append(1)) == "a" and not calls  # there already: not read again
    store.put((3,), lambda: "c")
    assert (1,) in store and (3,) in store and (2,) not in store and len(store) == 2
    store.budget_bytes = 10  # shrunk while serving: the next save makes room
    store.put((4,), lambda: "d")
    assert list(store._entries) == [(4,)]
    store.budget_bytes = 5  # one entry is more than the budget: nothing is kept, nothing evicted
    assert store.put((5,), lambda: "e") is None and len(store) == 1
