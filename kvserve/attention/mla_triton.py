"""MLA on the Triton backend: the decode tail through the latent-cache kernel
(`mla_triton_kernels`), absorbed; latent stores, prefill and extend (decompressing) stay the
PyTorch path of `TorchMLABackend`, which runs on any device.

On CPU tensors it runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests)."""

from __future__ import annotations

import torch

from kvserve.kv.tensors import KVTensorPool
from kvserve.attention.mla import (MLAProjections, TorchMLABackend, _PrefillPlan,
                                   _StepState)
from kvserve.attention.mla_triton_kernels import mla_decode_attention
from kvserve.kernels.gpu.interpreter import INTERPRETED


class TritonMLABackend(TorchMLABackend):
    def __init__(self, pool: KVTensorPool, scale: float) -> None:
        super().__init__(pool, scale, decode="absorbed")
        if pool.device.type == "cpu" and not INTERPRETED:
            raise ValueError("the Triton backend runs on CPU tensors only under Triton's "
                             "interpreter (TRITON_INTERPRET=1 set before triton is imported); "
                             "use attention_backend='torch' on the CPU")

    def _decode_state(self, prefills: list[_PrefillPlan], table: torch.Tensor,
                      lens: torch.Tensor) -> _StepState:
        """The kernel reads an int32 table and the lengths: no mask, no gather scratch (built
        once per step, not per layer)."""
        dev = self.pool.device
        return _StepState(prefills, table.to(device=dev, dtype=torch.int32), lens.to(dev), None)

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                proj: MLAProjections, state: _StepState) -> torch.Tensor:
        q_lat = torch.bmm(q_nope.transpose(0, 1), proj.w_uk).transpose(0, 1)  # [n, H, rank]
        q = torch.cat((q_lat, q_rope), dim=-1).contiguous()
        o_lat = mla_decode_attention(q, cache, state.decode_table,
                                     state.decode_lens, self.scale, self.rank)
        return torch.bmm(o_lat.transpose(0, 1), proj.w_uv.transpose(1, 2)).transpose(0, 1)
