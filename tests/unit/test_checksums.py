"""``checksums``: what ``safe_set_full_model_grads(check=True)`` compares across ranks."""

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
