"""From the KV tensors vLLM hands a connector to a WorkerMemory (the torch edge of `memory`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbridge.core.errors import LayoutError
from kvbridge.core.memory import LayerKV, Region, WorkerMemory, layer_from_strides


def dims_of(tensor: torch.Tensor) -> str:
    """Name the logical dims of one layer's KV tensor.

    vLLM 0.32 (CPU and GPU): [num_blocks, num_kv_heads, block_size, 2*head_size], any physical order.
    Older GPU backends: [2, num_blocks, block_size, num_kv_heads, head_size] (K and V planes).
    """
    if tensor.ndim == 4:
        return "BHNC"
    if tensor.ndim == 5 and tensor.shape[0] == 2:
        return "KBNHC"
    raise LayoutError(f"unsupported KV cache tensor shape {tuple(tensor.shape)}")


def memory_from_tensors(kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]) -> WorkerMemory:
    """Regions are the tensors' storages (one allocation for all layers in vLLM 0.32); layers sharing one
    KV tensor appear once, under their lowest layer id."""
    regions: dict[tuple[int, int], int] = {}
    by_ptr: dict[int, tuple[int, torch.Tensor]] = {}
    for name, tensor in kv_caches.items():
        layer = layer_index(name)
        seen = by_ptr.get(tensor.data_ptr())
        if seen is None or layer < seen[0]:
            by_ptr[tensor.data_ptr()] = (layer, tensor)
    layers: list[LayerKV] = []
    region_list: list[Region] = []
    for layer, tensor in sorted(by_ptr.values(), key=lambda item: item[0]):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in regions:
            regions[key] = len(region_list)
            device = tensor.device.index if tensor.device.type == "cuda" else 0
            region_list.append(Region(key[0], key[1], device or 0))
        layers.append(
            layer_from_strides(
                layer,
                regions[key],
                tensor.data_ptr(),
                dims_of(tensor),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.element_size(),
            )
        )
    return WorkerMemory(tuple(region_list), tuple(layers))


def physical_order(memory: WorkerMemory) -> str:
    """A name for the physical order of the first layer's pages, for logs and handshakes."""
    lk = memory.layers[0]
    dims = {"B": lk.block_stride, "H": lk.head_stride, "N": lk.token_stride}
    if lk.num_planes == 2:
        dims["K"] = lk.plane_stride
    return "".join(sorted(dims, key=lambda d: -dims[d])) + "C"


def region_tensors(kv_caches: dict[str, torch.Tensor], memory: WorkerMemory) -> tuple[torch.Tensor, ...]:
    """`memory`'s regions (from `memory_from_tensors`) as flat uint8 tensors over the same storages, in order."""
    from kvbridge.transport.cuda_ipc import storage_view

    by_key = {}
    for tensor in kv_caches.values():
        storage = tensor.untyped_storage()
        by_key.setdefault((storage.data_ptr(), storage.nbytes()), tensor)
    try:
        return tuple(storage_view(by_key[(r.addr, r.nbytes)]) for r in memory.regions)
    except KeyError as exc:
        raise LayoutError(f"no KV tensor lies in region {exc}") from None
