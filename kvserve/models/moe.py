"""Mixture-of-experts MLPs: `MoE` (routed experts, gated as the config's `MoEConfig` says,
plus shared ones) and `SwiGLU` (a dense gated MLP: DeepSeek's dense layers and shared
experts). DeepSeek's layers (`deepseek_layers.py`) and the shared decoder's MoE layers
(Qwen3-MoE, Mixtral: `decoder.py`) use the same modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.activation import gated
from kvserve.layers.plan import ExecutionPlan
from kvserve.layers.projection import Linear
from kvserve.models.deepseek_config import MoEConfig
from kvserve.layers.params import param as _param


class MoE(nn.Module):
    """Routed experts (top-k of `n_routed_experts`, gated as the config says) plus shared ones.

    The routed experts run grouped: the (token, expert) pairs are sorted by expert, each expert
    runs one SwiGLU over its contiguous rows, the rows are scaled by their gate weight and added
    back to their tokens. Experts use `F.linear` (MKL has no per-shape kernel cache to grow with
    the ragged row counts); the shared experts are a dense SwiGLU over every token, packed for
    oneDNN like the other projections."""

    def __init__(self, moe: MoEConfig, hidden: int, plan: ExecutionPlan) -> None:
        super().__init__()
        dtype, device = plan.dtype, plan.device
        self.cfg = moe
        e, i = moe.n_routed_experts, moe.moe_intermediate_size
        p = dict(dtype=dtype, device=device)
        # The router in float32, as transformers keeps it (`_keep_in_fp32_modules_strict`).
        self.gate = _param(e, hidden, dtype=torch.float32, device=device)
        self.e_score_correction_bias = _param(e, dtype=torch.float32, device=device) \
            if moe.scoring == "sigmoid" else None
        self.w13 = _param(e, 2 * i, hidden, **p)  # per expert [gate; up]
        self.w2 = _param(e, hidden, i, **p)
        shared = moe.n_shared_experts * i
        # (its down projection not all-reduced: `reduce` sums it with the routed experts')
        self.shared = SwiGLU(hidden, shared, plan, row=False) if shared else None
        # Tensor parallelism: each rank's experts hold some of their columns, so the routed
        # and shared sums are partial; this all-reduces them (None on one rank).
        self.reduce = plan.all_reduce()

    def prepare(self) -> None:
        if self.shared is not None:
            self.shared.prepare()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) for each token."""
        c = self.cfg
        logits = F.linear(x.float(), self.gate)
        e, g = c.n_routed_experts, c.n_group
        if c.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            if c.topk_method == "group_limited_greedy":
                scores = self._mask_groups(scores, scores.view(-1, g, e // g).amax(dim=-1), 0.0)
            weights, ids = torch.topk(scores, c.num_experts_per_tok, dim=-1, sorted=False)
            if c.norm_topk_prob:  # Qwen3-MoE, Mixtral
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # DeepSeek-V3's noaux_tc
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = torch.topk(choice, c.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids

    def _mask_groups(self, scores: torch.Tensor, group_scores: torch.Tensor,
                     fill: float) -> torch.Tensor:
        """scores with every expert outside the `topk_group` best groups set to `fill`."""
        c = self.cfg
        keep = torch.topk(group_scores, c.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(c.n_routed_experts // c.n_group, dim=1)
        return scores.masked_fill(~expert_mask, fill)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token [T, hidden]."""
        weights, ids = self.route(x)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts).tolist()
        xs = x.index_select(0, tokens)
        out = torch.empty_like(xs)
        i = self.cfg.moe_intermediate_size
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            rows = slice(start, start + n)
            gate_up = F.linear(xs[rows], self.w13[expert])
            act = gated(gate_up, i, False)
            out[rows] = F.linear(act, self.w2[expert])
            start += n
        out.mul_(weights.flatten().index_select(0, order).to(out.dtype)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def forward_add(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + shared(x) + routed(x)."""
        if self.reduce is not None:  # one all-reduce of both partial sums
            out = self.routed(x)
            if self.shared is not None:
                out = self.shared.forward_add(x, out)
            return hidden.add_(self.reduce(out))
        if self.shared is not None:
            hidden = self.shared.forward_add(x, hidden)
        return hidden.add_(self.routed(x))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP: down(silu(gate(x)) * up(x)), added into the residual stream."""

    def __init__(self, hidden: int, intermediate: int, plan: ExecutionPlan,
                 row: bool = True) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(2 * intermediate, hidden, plan, "gate_up_proj")
        self.down_proj = Linear(hidden, intermediate, plan, "down_proj")
        # how the projections run, from the plan (`row`: down all-reduced on a rank)
        self.gate_up = plan.projection(self.gate_up_proj)
        self.down = plan.projection(self.down_proj, row=row)

    def prepare(self) -> None:
        self.gate_up.prepare()
        self.down.prepare()

    def forward_add(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        act = gated(self.gate_up.apply(x), self.intermediate, False)
        return self.down.apply_add(act, hidden)
