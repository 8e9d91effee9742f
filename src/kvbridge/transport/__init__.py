"""Moving bytes: NIXL (`nixl`, the one module that talks to NIXL), CUDA IPC handles (`cuda_ipc`), the Triton
gather kernel (`gather_kernel`, `gpu_gather`) and its per-peer reader (`ipc_reader`), and torch tensors as
`core.memory` descriptions (`torch_memory`).

Built on `kvbridge.core` only.
"""
