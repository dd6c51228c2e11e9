"""Expert parallelism over torch.distributed: the routed experts sharded over the ranks of a process group.

Rank r of a group of W ranks holds experts [r * E/W, (r + 1) * E/W) (transformers' `Shard(0)` of the expert
dimension); the router and an optional shared expert are replicated. Every rank of the group calls the
layer together, each with its own tokens (any number, zero included):

1. route: its tokens through the full router (`ops.route`), global expert ids [T, k];
2. plan: token t goes to rank r when one of its k experts lives there; it is sent once per such rank
   (not once per (token, expert) pair), with its k ids mapped to r's local ids (E/W, the sentinel that
   selects nothing, for slots whose expert is elsewhere) and its k routing weights;
3. dispatch: one `all_to_all_single` of rows [x_t | local ids | weights]: the int32 ids and the fp32
   weights ride bit for bit as extra columns of the activation dtype, so one collective moves it all;
4. compute: the local fused kernel (`ops.fused_experts`, sentinels allowed) on the received rows: per row,
   the weighted sum over its slots on this rank, rounded once to the activation dtype;
5. combine: one `all_to_all_single` sends each row's result back to its token's rank, which adds the
   partial sums of a token in rank order in fp32 (deterministic, no atomics), adds the shared expert and
   rounds once.

Two modes (`ExpertParallel(capacity=...)`):

- variable (capacity None, for prefill): the per-rank row counts are exchanged on the device
  (`all_to_all_single` of W integers) and then read on the host, since an uneven `all_to_all_single`
  takes its split sizes as Python ints (NCCL and gloo alike): one host sync per call. Nothing is dropped.
- fixed capacity (capacity C, for decode): every rank sends exactly C rows to every rank (rows past a
  destination's tokens are padding with sentinel ids), so split sizes are static, nothing is read on the
  host and the layer can be captured in a CUDA graph. A token past the C-th one bound for a rank is not
  sent there; its (token, expert) assignments on that rank are added to `ExpertParallel.dropped` (a
  device counter: read it outside the graph). A token goes at most once to a rank, so C >= the largest
  local token count of any rank never drops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops, reference

COMBINE_CHUNK_ELEMENTS = 2**26  # the combine gathers [T, ranks, H] partials in pieces of at most this size


class ExpertParallel:
    """An expert-parallel process group and its dispatch mode, passed as `expert_parallel=` to `moe_forward`
    and `fused_experts`.

    group: a `torch.distributed` process group (default: the world group); NCCL for CUDA tensors, gloo for
    CPU tensors. capacity: None (variable mode) or rows per destination rank >= 1 (fixed mode, no host sync).
    `dropped` is None until a fixed-capacity call ran, then an int64 tensor on the activations' device that
    counts the (token, expert) assignments not computed because a destination was full; `dropped_count()`
    reads it (a host sync), `reset_dropped()` zeroes it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, capacity: int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group (nccl for GPUs, gloo for CPU) first")
        if group is None:
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        if capacity is not None:
            ops.check_int("capacity", capacity, 1)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the group")
        self.group, self.capacity = group, capacity
        self.rank, self.world_size = rank, dist.get_world_size(group)
        self.dropped: torch.Tensor | None = None

    def __repr__(self) -> str:
        mode = "variable" if self.capacity is None else f"capacity={self.capacity}"
        return f"ExpertParallel(rank={self.rank}, world_size={self.world_size}, {mode})"

    def experts_per_rank(self, num_experts: int, name: str = "num_experts") -> int:
        if num_experts % self.world_size:
            raise ValueError(f"{name}: {num_experts} experts cannot be split evenly over the "
                             f"{self.world_size} ranks of the expert-parallel group")
        return num_experts // self.world_size

    def local_experts(self, num_experts: int) -> slice:
        """The global expert ids this rank holds: slice(rank * E/W, (rank + 1) * E/W)."""
        n = self.experts_per_rank(num_experts)
        return slice(self.rank * n, (self.rank + 1) * n)

    def shard(self, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full [E, ...] expert tensor (a view)."""
        ops.require_tensors(weights=weights)
        n = self.experts_per_rank(weights.shape[0], "weights")
        return weights[self.rank * n:(self.rank + 1) * n]

    def dropped_count(self) -> int:
        """Assignments dropped so far by fixed-capacity calls (reads the device counter: a host sync)."""
        return 0 if self.dropped is None else int(self.dropped)

    def reset_dropped(self) -> None:
        if self.dropped is not None:
            self.dropped.zero_()


def check_expert_parallel(expert_parallel) -> None:
    if not isinstance(expert_parallel, ExpertParallel):
        raise TypeError(f"expert_parallel must be an ExpertParallel or None, got {type(expert_parallel).__name__}")


def _all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None,
                input_splits: list[int] | None, group: dist.ProcessGroup) -> None:
    """Every collective of this module goes through here. NCCL and gloo (torch 2.13: all_to_all_single is
    supported with even and uneven splits, bf16 included) both need contiguous tensors and, for uneven
    splits, split sizes as Python ints; None means W equal parts (no host data)."""
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


def destinations(topk_ids: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """hits [T, k, W]: slot j of token t names an expert of rank r. Ids outside [0, E) hit no rank."""
    owner = torch.div(topk_ids.long(), experts_per_rank, rounding_mode="floor")
    return owner[:, :, None] == torch.arange(world_size, device=topk_ids.device)


def _pack(x_rows: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """[rows, H] activations and [rows, 2k] int32 metadata -> one [rows, H + m] tensor of the activation
    dtype (the metadata's bytes reinterpreted, never converted)."""
    return torch.cat([x_rows, meta.view(x_rows.dtype)], dim=1)


def _unpack(rows: torch.Tensor, hidden: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = rows[:, hidden:].contiguous().view(torch.int32)
    return rows[:, :hidden], meta[:, :top_k].contiguous(), meta[:, top_k:].contiguous().view(torch.float32)


def _combine(back: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """acc[t] = sum over ranks r, in rank order, of back[dest[t, r]] in fp32 (back's last row is zeros: the
    row of pairs not sent)."""
    tokens, world = dest.shape
    hidden = back.shape[1]
    acc = torch.zeros(tokens, hidden, dtype=torch.float32, device=back.device)
    step = max(1, min(world, COMBINE_CHUNK_ELEMENTS // max(1, tokens * hidden)))
    for r0 in range(0, world, step):
        acc += back[dest[:, r0:r0 + step]].sum(dim=1, dtype=torch.float32)
    return acc


def _run(ep: ExpertParallel, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
         topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
         shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None) -> torch.Tensor:
    """Dispatch, local experts, combine for x [T, H] with global ids [T, k]; inputs already checked."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    world, n_local = ep.world_size, w_down.shape[0]
    device = x.device

    hits = destinations(topk_ids, n_local, world)  # [T, k, W]
    slots = hits.sum(dim=1)  # [T, W]: slots of token t on rank r
    need = slots > 0
    pos = need.cumsum(dim=0) - 1  # position of token t among the tokens bound for rank r
    if ep.capacity is None:
        counts = need.sum(dim=0)
        recv_counts = torch.empty_like(counts)
        _all_to_all(recv_counts, counts, None, None, ep.group)
        send_sizes, recv_sizes = torch.stack([counts, recv_counts]).tolist()  # the host sync of this mode
        rows_out, rows_in = sum(send_sizes), sum(recv_sizes)
        keep = need
        offsets = counts.cumsum(dim=0) - counts
    else:
        send_sizes = recv_sizes = None
        rows_out = rows_in = world * ep.capacity
        keep = need & (pos < ep.capacity)
        offsets = torch.arange(world, device=device) * ep.capacity
        dropped = (slots * (need & ~keep)).sum()
        if ep.dropped is None or ep.dropped.device != device:
            ep.dropped = torch.zeros((), dtype=torch.int64, device=device)
        ep.dropped += dropped
    # dest[t, r]: the send row of token t for rank r, or rows_out (a zero row) when it is not sent there
    dest = torch.where(keep, offsets + pos, rows_out)
    # source pair (t * W + r) of each send row; padding rows point past the pairs (zero row, sentinel ids)
    pair = torch.full((rows_out + 1,), tokens * world, dtype=torch.int64, device=device)
    pair.scatter_(0, dest.reshape(-1), torch.arange(tokens * world, device=device))
    pair = pair[:rows_out]

    # per (token, rank) pair: the receiver's local ids (sentinel n_local elsewhere) and the slot weights
    first = (torch.arange(world, device=device) * n_local)[None, :, None]
    hit = hits.transpose(1, 2)  # [T, W, k]
    local_ids = torch.where(hit, topk_ids.long()[:, None, :] - first, n_local).to(torch.int32)
    weights = torch.where(hit, topk_weights.float()[:, None, :], 0.0)
    meta = torch.cat([local_ids, weights.view(torch.int32)], dim=2).reshape(tokens * world, 2 * top_k)
    sentinel = torch.zeros(1, 2 * top_k, dtype=torch.int32, device=device)
    sentinel[:, :top_k] = n_local
    meta = torch.cat([meta, sentinel])
    x_pad = torch.cat([x, x.new_zeros(1, hidden)])
    send = _pack(x_pad[torch.div(pair, world, rounding_mode="floor")], meta[pair])
    recv = send.new_empty(rows_in, send.shape[1])
    _all_to_all(recv, send, recv_sizes, send_sizes, ep.group)

    recv_x, recv_ids, recv_weights = _unpack(recv, hidden, top_k)
    partial = ops.fused_experts(recv_x, w_gate_up, w_down, recv_weights, recv_ids, activation, True)

    back = x.new_empty(rows_out + 1, hidden)
    back[rows_out].zero_()
    _all_to_all(back[:rows_out], partial, send_sizes, recv_sizes, ep.group)
    acc = _combine(back, dest)
    if shared_down is not None:  # replicated: each rank applies it to its own tokens, with the same kernel
        ones = torch.ones(tokens, 1, dtype=torch.float32, device=device)
        zeros = torch.zeros(tokens, 1, dtype=torch.int32, device=device)
        acc += ops.fused_experts(x, shared_gate_up[None], shared_down[None], ones, zeros, "silu")
    return acc.to(x.dtype)


def fused_experts(ep: ExpertParallel, hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`fused_experts` with global ids [T, k] in [0, E) and this rank's shard w_gate_up [E/W, 2I, H],
    w_down [E/W, H, I]; every rank of the group must call it."""
    check_expert_parallel(ep)
    ops._check_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation, True)
    num_experts = w_down.shape[0] * ep.world_size
    if topk_ids.shape[1] > num_experts:
        raise ValueError(f"top_k={topk_ids.shape[1]} exceeds the number of experts ({num_experts})")
    ops._check_id_values(topk_ids, num_experts)  # global ids, on CPU tensors; on GPUs others select nothing
    return _run(ep, hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation, None, None)


def moe_forward(ep: ExpertParallel, hidden_states: torch.Tensor, router_weight: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                correction_bias: torch.Tensor | None, num_groups: int | None, topk_groups: int | None,
                scaling_factor: float, shared_gate_up: torch.Tensor | None,
                shared_down: torch.Tensor | None) -> torch.Tensor:
    """`moe_forward` on hidden_states [T, H] with the full router_weight [E, H] and this rank's expert shard;
    the shared expert (if any) is replicated. Every rank of the group must call it."""
    check_expert_parallel(ep)
    ops.check_tensor("hidden_states", hidden_states, 2, ops.FLOAT_DTYPES)
    ops.check_tensor("router_weight", router_weight, 2, (hidden_states.dtype, torch.float32))
    num_experts = router_weight.shape[0]
    n_local = ep.experts_per_rank(num_experts, "router_weight")
    if w_gate_up.dim() == 3 and w_gate_up.shape[0] != n_local:
        raise ValueError(f"w_gate_up holds {w_gate_up.shape[0]} experts; with {num_experts} experts in "
                         f"router_weight over {ep.world_size} ranks each rank holds {n_local} (ep.shard(w))")
    # the single-GPU checks, on a stand-in router of the shard's size (its values are never read)
    ops._check_moe(hidden_states, router_weight[:n_local], w_gate_up, w_down, shared_gate_up, shared_down)
    ops._check_routing(num_experts, top_k, scoring, correction_bias, num_groups, topk_groups, scaling_factor)
    logits = reference.router_logits(hidden_states, router_weight)
    weights, ids = ops.route(logits, top_k, scoring, renormalize, correction_bias, num_groups, topk_groups,
                             scaling_factor)
    return _run(ep, hidden_states, w_gate_up, w_down, weights, ids, "silu", shared_gate_up, shared_down)
