"""The one-batch-ahead host→device iterator (featcal_llm.engine.transfer), on CPU: order, values, lazy reads.

The CUDA branch (side stream, wait_stream, record_stream) has not been run here: no GPU in this environment.
"""

from __future__ import annotations

import torch

from featcal_llm.engine.transfer import on_device


def test_yields_every_batch_of_every_stream_in_order():
    first = [torch.full((2, 3), float(i)) for i in range(4)]
    second = [torch.full((1,), 10.0 + i) for i in range(4)]
    seen = list(on_device(torch.device("cpu"), first, second))
    assert len(seen) == 4
    for index, (a, b) in enumerate(seen):
        assert torch.equal(a, first[index]) and torch.equal(b, second[index])
    assert list(on_device(torch.device("cpu"))) == [] and list(on_device(torch.device("cpu"), [])) == []


def test_reads_lazily_so_batches_can_be_replaced_in_place():
    stream = [torch.tensor([float(i)]) for i in range(4)]
    seen = []
    for index, (hidden,) in enumerate(on_device(torch.device("cpu"), stream)):
        seen.append(float(hidden))
        stream[index] = hidden + 100  # the engine replaces batch k by its next-layer value
        if index == 0:
            stream[2] = torch.tensor([-2.0])  # not read yet: the new value is the one yielded
    assert seen == [0.0, 1.0, -2.0, 3.0]
    assert [float(t) for t in stream] == [100.0, 101.0, 98.0, 103.0]


def test_tensors_read_from_a_checkpoint_are_owned_and_aligned(tmp_path):
    """safetensors 0.8 hands out views of the file's mapping at the file's offsets: two copies of one tensor, misaligned
    differently, then computed a head's log-probabilities 1 ulp apart (a copy of the merge read as trailing it, and a
    float64 twin run off by 1.7e-8). Every tensor the reader gives is in fresh, 64-byte aligned memory of its own."""
    import torch
    from safetensors.torch import save_file

    from featcal_llm.io.checkpoint import CheckpointReader

    tensors = {"a": torch.arange(3, dtype=torch.float64), "b": torch.randn(5, 7, dtype=torch.float64),
               "c": torch.randn(9, 4, dtype=torch.float64)}
    save_file(tensors, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path, "model")
    read = {name: reader.get(name) for name in tensors}
    assert all(torch.equal(read[name], tensors[name]) for name in tensors)
    assert [tensor.data_ptr() % 64 for tensor in read.values()] == [0, 0, 0]
    read["b"].add_(1.0)  # its own memory: the file's bytes and a second read are untouched
    assert torch.equal(reader.get("b"), tensors["b"])
