import pytest
import torch

from pagedserve.services.gpu_worker.attention.block_copy import copy_blocks


def make_layers(num_layers=3, num_blocks=6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=gen).to(dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_k_and_v_of_every_layer_and_nothing_else(dtype):
    layers = make_layers(dtype=dtype)
    before = [t.clone() for t in layers]
    copy_blocks(layers, [(1, 4), (3, 0)])
    for now, old in zip(layers, before, strict=True):
        expected = old.clone()
        expected[:, 4] = old[:, 1]
        expected[:, 0] = old[:, 3]
        assert torch.equal(now, expected)


def test_all_copies_read_the_blocks_as_they_were():
    # block 2 is a destination of one pair and the source of the other
    layers = make_layers(num_layers=1)
    old = layers[0].clone()
    copy_blocks(layers, [(2, 5), (1, 2)])
    assert torch.equal(layers[0][:, 5], old[:, 2])
    assert torch.equal(layers[0][:, 2], old[:, 1])


def test_one_source_to_several_destinations():
    layers = make_layers(num_layers=2)
    old = [t.clone() for t in layers]
    copy_blocks(layers, [(0, 3), (0, 4)])
    for now, was in zip(layers, old, strict=True):
        assert torch.equal(now[:, 3], was[:, 0]) and torch.equal(now[:, 4], was[:, 0])


def test_no_pairs_is_a_no_op():
    layers = make_layers()
    before = [t.clone() for t in layers]
    copy_blocks(layers, [])
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))


def test_rejects_a_repeated_destination_and_ids_outside_the_pool():
    layers = make_layers()
    with pytest.raises(ValueError, match="twice"):
        copy_blocks(layers, [(0, 3), (1, 3)])
    with pytest.raises(ValueError, match="outside"):
        copy_blocks(layers, [(0, 6)])
