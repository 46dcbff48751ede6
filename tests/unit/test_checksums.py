"""``checksums`` and ``sampled_checksum``: what ``safe_set_full_model_grads(check=True)`` compares across
ranks (the sample), and what names the tensors that differ (the whole checksums)."""

import math

import torch

from collgrad.state.write import checksums


def test_equal_tensors_agree_and_any_changed_bit_is_seen():
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) for n in (0, 1, 5, 16, 1001)] + [torch.randn(7, 3, generator=g)]
    base += [torch.randn(9, generator=g).to(torch.bfloat16), torch.randn(6, generator=g).double()]
    sums = checksums(base)
    assert checksums([t.clone() for t in base]) == sums  # equal values, other memory
    assert all(0 <= s < 1 << 62 for s in sums)
    for i, t in enumerate(base):
        for at in {0, t.numel() // 2, t.numel() - 1} if t.numel() else ():
            changed = [x.clone() for x in base]
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[changed[i].element_size()]
            changed[i].view(-1).view(bits)[at] ^= 1  # the last bit of one element
            got = checksums(changed)
            assert got[i] != sums[i] and got[:i] + got[i + 1 :] == sums[:i] + sums[i + 1 :], (i, at)


def test_neighbours_swapped_within_a_word_and_unaligned_views():
    t = torch.arange(1.0, 11.0)
    swapped = t.clone()
    swapped[[2, 3]] = swapped[[3, 2]]  # elements 2 and 3 share the second 8-byte word
    assert checksums([t])[0] != checksums([swapped])[0]
    storage = torch.arange(0.0, 12.0)
    unaligned = storage[1:11]  # starts 4 bytes into a word: read element by element
    assert checksums([unaligned]) == checksums([unaligned.clone()])  # the clone is aligned


def test_sampled_checksum_sees_every_sampled_element_and_where_it_lies():
    from collgrad.state.write import SAMPLE_BYTES, sampled_checksum

    g = torch.Generator().manual_seed(1)
    values = {
        "a": torch.randn(64, 256, generator=g),
        "b": torch.randn(3000, generator=g),
        "c": torch.randn(3, generator=g),
    }
    parts = [("a", 0, 64 * 256), ("b", 100, 2900), ("c", 0, 3)]
    base = sampled_checksum(values, parts)
    assert 0 <= base < 1 << 62
    assert sampled_checksum({k: v.clone() for k, v in values.items()}, parts) == base  # other memory
    # the same values, not contiguous (the general path), give the same number
    assert sampled_checksum({**values, "a": values["a"].t().contiguous().t()}, parts) == base
    step = SAMPLE_BYTES // 4
    for name, at in [("a", 0), ("a", step * 5), ("b", 100), ("b", 100 + step * 2), ("c", 0)]:
        changed = {k: v.clone() for k, v in values.items()}
        changed[name].view(-1).view(torch.int32)[at] ^= 1  # the last bit of one sampled element
        assert sampled_checksum(changed, parts) != base, (name, at)
    outside = {k: v.clone() for k, v in values.items()}
    outside["b"][50] += 1  # before the part: not read, not compared
    assert sampled_checksum(outside, parts) == base
    swapped = {k: v.clone() for k, v in values.items()}
    flat = swapped["a"].view(-1)
    flat[[0, step]] = flat[[step, 0]]  # two sampled elements trade places
    assert sampled_checksum(swapped, parts) != base
    assert sampled_checksum({**values, "b": values["b"].to(torch.bfloat16)}, parts) != base
    assert sampled_checksum(values, []) == 0


def test_sampled_checksum_is_the_same_however_the_values_lie():
    """Views of one flat buffer (what collgrad's reads return: sampled as one run), separate tensors and
    non-contiguous ones (sampled part by part) give the same number for the same values."""
    from collgrad.state.write import SAMPLE_BYTES, sampled_checksum

    g = torch.Generator().manual_seed(2)
    sizes = {"w": (7, 33), "b": (33,), "u": (301,), "v": (2, 150)}
    flat = torch.randn(sum(math.prod(s) for s in sizes.values()), generator=g)
    views, at = {}, 0
    for name, shape in sizes.items():
        views[name] = flat[at : at + math.prod(shape)].view(shape)
        at += math.prod(shape)
    parts = [("w", 5, 7 * 33 - 5), ("b", 0, 33), ("u", 0, 301), ("v", 0, 150)]
    base = sampled_checksum(views, parts)
    separate = {n: v.clone() for n, v in views.items()}
    assert sampled_checksum(separate, parts) == base
    strided = {**separate, "w": separate["w"].t().contiguous().t()}
    assert not strided["w"].is_contiguous()
    assert sampled_checksum(strided, parts) == base
    step = SAMPLE_BYTES // 4
    for name, lo, numel in parts:  # of each part: its first element and every step-th after it
        for at, seen in [
            (lo, True),
            (lo + step, numel > step),
            (lo + 1, False),
            (lo + numel - 1, (numel - 1) % step == 0),
        ]:
            if at >= lo + numel:
                continue
            changed = {n: v.clone() for n, v in views.items()}
            changed[name].view(-1).view(torch.int32)[at] ^= 1
            assert (sampled_checksum(changed, parts) != base) == seen, (name, at)
    for name in views:  # every part's first element is sampled, however small the part
        lo = {n: first for n, first, _ in parts}[name]
        changed = {n: v.clone() for n, v in views.items()}
        changed[name].view(-1).view(torch.int32)[lo] ^= 1
        assert sampled_checksum(changed, parts) != base, name
        assert sampled_checksum({**views, name: changed[name]}, parts) != base, name  # the run, one changed


def test_sampled_checksums_of_several_regions_are_each_region_s_sampled_checksum():
    """A rank's check reads two regions (its own parts and the next rank's) in one pass: each number is the
    region's own, whatever the values' dtypes and however they lie (views of buffers, separate tensors,
    not contiguous), and a region may share parameters with the other or hold none."""
    from collgrad.state.write import sampled_checksum, sampled_checksums

    g = torch.Generator().manual_seed(3)
    first, second = torch.randn(9000, generator=g), torch.randn(5000, generator=g)
    values = {
        "a": first[:4000].view(40, 100),
        "b": first[4000:],
        "c": second[:3000],
        "d": torch.randn(700, generator=g).to(torch.bfloat16),
        "e": torch.randn(30, 20, generator=g).t(),
        "f": second[3000:],
    }
    mine = (("a", 0, 4000), ("b", 0, 2500), ("d", 0, 700), ("c", 0, 3000))
    after = (("b", 2500, 2500), ("e", 0, 600), ("f", 0, 2000), ("c", 100, 1000))
    for regions in [(mine, after), (after, mine), (mine, ()), ((), after), (mine, mine, after)]:
        assert sampled_checksums(values, regions) == [sampled_checksum(values, r) for r in regions], regions
    assert sampled_checksums(values, (mine, after))[0] != sampled_checksums(values, (mine, after))[1]


def test_sampled_checksum_of_views_of_one_buffer_of_any_dtype():
    """Views of one buffer are sampled with one indexed read of its storage, whatever the dtype (torch has
    no ``index_select`` for uint16/32/64: the storage is read as signed integers of the same size), and
    give the number separate tensors give."""
    from collgrad.state.write import sampled_checksum

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.bool, torch.float16):
        flat = torch.randint(0, 200, (6000,), generator=g).to(dtype)
        views = {"a": flat[:2500], "b": flat[2500:4000].view(30, 50), "c": flat[4000:]}
        parts = [("a", 3, 2497), ("b", 0, 1500), ("c", 10, 1990)]
        base = sampled_checksum(views, parts)
        assert sampled_checksum({n: v.clone() for n, v in views.items()}, parts) == base, dtype
        changed = {n: v.clone() for n, v in views.items()}
        changed["c"].view(-1)[10] = 201 if dtype is not torch.bool else not bool(changed["c"].view(-1)[10])
        assert sampled_checksum(changed, parts) != base, dtype


def test_sampled_checksums_of_regions_passed_again_follow_their_parts():
    """The parts' columns are kept for regions passed as the same tuples again (a write's regions are the
    tuples the source keeps); regions whose parts can change in place are worked out each call."""
    from collgrad.state.write import sampled_checksums

    g = torch.Generator().manual_seed(5)
    values = {"a": torch.randn(9000, generator=g), "b": torch.randn(5000, generator=g)}
    kept = (("a", 0, 9000), ("b", 0, 5000))
    memo: dict = {}
    first = sampled_checksums(values, (kept,), memo)
    assert sampled_checksums(values, (kept,), memo) == first and memo  # from the kept columns
    assert sampled_checksums(values, ((("a", 0, 9000), ("b", 0, 5000)),), memo) == first  # equal, other tuples
    part = ["b", 0, 5000]
    mutable = (("a", 0, 9000), part)
    assert sampled_checksums(values, (mutable,), memo) == first  # a part given as a list
    part[1:] = [1, 4999]  # the same region tuple, one part changed in place
    expected = sampled_checksums(values, ((("a", 0, 9000), ("b", 1, 4999)),), memo)
    assert sampled_checksums(values, (mutable,), memo) == expected
    assert sampled_checksums(values, (mutable,), memo) != first
