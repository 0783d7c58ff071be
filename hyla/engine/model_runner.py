"""Build a ``ForwardBatch`` from scheduled requests and the pools, run the model, return logits.

The runner is the only engine piece that touches device tensors: it moves the host-side index
lists the scheduler produced onto the model's device. It never sees the tree.
"""

from __future__ import annotations

import torch

from hyla.engine.request import Req
from hyla.model.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool, state_pool, req_to_token, device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.req_to_token = req_to_token
        self.device = device

    @torch.inference_mode()
    def forward_extend(self, reqs: list[Req], extend_lens: list[int], out_cache_loc: torch.Tensor,
                       ckpts: list[tuple[int, int, int]], all_logits: bool = False) -> torch.Tensor:
        """Feed ``extend_lens[i]`` tokens of request i after its ``kv_len`` (its draft tokens
        included); logits of each last token ``[B, V]``, or of every token ``[sum(extend_lens), V]``
        with ``all_logits`` (speculative verification)."""
        ids: list[int] = []
        pos: list[int] = []
        kv_rows = []
        for r, n in zip(reqs, extend_lens):
            start = r.kv_len
            ids.extend(r.tokens(start, start + n))
            pos.extend(range(start, start + n))
            kv_rows.append(self.req_to_token.read(r.req_pool_idx, 0, start + n))
        prefix_lens = [r.kv_len for r in reqs]
        batch = self._batch(
            is_decode=False, reqs=reqs, ids=ids, pos=pos, extend_lens=list(extend_lens),
            prefix_lens=prefix_lens, kv_rows=kv_rows, out_cache_loc=out_cache_loc, ckpts=ckpts)
        if all_logits:
            batch.logits_indices = torch.arange(len(ids), dtype=torch.long, device=self.device)
        return self.model.forward(batch)

    @torch.inference_mode()
    def forward_decode(self, reqs: list[Req], out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Feed each request's last sampled token (position ``kv_len``)."""
        ids = [r.fill_ids[r.kv_len] for r in reqs]
        pos = [r.kv_len for r in reqs]
        kv_rows = [self.req_to_token.read(r.req_pool_idx, 0, r.kv_len + 1) for r in reqs]
        batch = self._batch(
            is_decode=True, reqs=reqs, ids=ids, pos=pos, extend_lens=[1] * len(reqs),
            prefix_lens=pos, kv_rows=kv_rows, out_cache_loc=out_cache_loc, ckpts=[])
        return self.model.forward(batch)  # [B, V]

    def _batch(self, *, is_decode: bool, reqs: list[Req], ids: list[int], pos: list[int],
               extend_lens: list[int], prefix_lens: list[int], kv_rows: list[torch.Tensor],
               out_cache_loc: torch.Tensor, ckpts: list[tuple[int, int, int]]) -> ForwardBatch:
        dev = self.device
        long = dict(dtype=torch.long, device=dev)
        cu = [0]
        for n in extend_lens:
            cu.append(cu[-1] + n)
        kv_indptr = [0]
        for row in kv_rows:
            kv_indptr.append(kv_indptr[-1] + row.numel())
        return ForwardBatch(
            is_decode=is_decode,
            input_ids=torch.tensor(ids, **long),
            positions=torch.tensor(pos, **long),
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            cu_seqlens=torch.tensor(cu, **long),
            out_cache_loc=out_cache_loc.to(**long),
            kv_indices=torch.cat(kv_rows).to(**long),
            kv_indptr=torch.tensor(kv_indptr, **long),
            k_buffers=self.kv_pool.k_buffers,
            v_buffers=self.kv_pool.v_buffers,
            state_slots=torch.tensor([r.state_slot for r in reqs], **long),
            conv_states=self.state_pool.conv_states,
            ssm_states=self.state_pool.ssm_states,
            ckpt_seq=torch.tensor([c[0] for c in ckpts], **long),
            ckpt_len=torch.tensor([c[1] for c in ckpts], **long),
            ckpt_slot=torch.tensor([c[2] for c in ckpts], **long),
        )
