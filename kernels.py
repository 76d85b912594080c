"""
The heavy math of the attention variants, on (B, H, T, d) tensors.

    mlr_attention             MLR attention (paper §3.4, Eq. 9): a pair whose deepest shared level block is at
                              level l is scored with the first r_0 + ... + r_l features only.
    sliding_window_attention  look-back window w (paper §2.3): query i sees keys i-w..i (|i-j| <= w when
                              bidirectional), the official sliding_block_size; O(T·w) time and memory.
    linear_attention          linear attention with phi(u) = ReLU(u)^2 (seed 003 §2.2.2).

The file opens with their plain references (a dense T×T mask each); the fast paths follow, each held equal to
its reference by the tests, forward and gradients:
- `*_torch`: the structure in plain torch with autograd: MLR as tiles per level whose partial softmaxes are
  merged exactly (FlashAttention's merge), SWA as query chunks against their neighbouring key chunks, linear
  attention as chunks with a running d×d state.
- `*_flash` (MLR, SWA): the same tiles as one autograd.Function with an online softmax over cache-sized pieces
  and a backward that recomputes the scores: O(T·d) memory. What the public functions run on a CPU.
- `*_triton` (MLR, SWA): one FlashAttention-2 kernel family whose tiles know their MLR level and window, taken
  for CUDA tensors; checked on CPU under Triton's interpreter, compiled for sm_80/sm_90, and timed on an H200
  (docs/speed.md: MLR 2.7× SDPA's time, SWA 0.26×).

    python kernels.py                          # correctness checks (a GPU: the Triton kernels too), benchmark
    python kernels.py --bench                  # every path vs SDPA: time, peak memory, GFLOP/s
    python kernels.py --selftest-interpret     # the Triton kernels vs the references, interpreter on CPU
    python kernels.py --compile-check          # compile the kernels for sm_80 / sm_90, no GPU needed
"""
import functools
import itertools
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # no triton: the kernels below are defined as plain functions and never called
    from types import SimpleNamespace
    triton, tl = SimpleNamespace(jit=lambda fn: fn), SimpleNamespace(constexpr=None)
    HAS_TRITON = False


# -----------------------------------------------------------------------------
# the plain references: dense T×T masks, short enough to read; every fast path below is held equal to them

def mlr_attention_reference(q, k, v, ranks, causal=True, level_sizes=None, scales=None,
                            divide_by_levels=False, key_mask=None):
    """score(i, j) = sum_l 1[block_l(i) = block_l(j)] c_l q_l(i).k_l(j), masked, softmax. Level l has blocks
    of level_sizes[l] tokens (default T / 2^l) and the r_l = ranks[l] features q_l; c_l defaults to 1 / r_l."""
    ranks, sizes, scales = _mlr_check(q, k, v, ranks, level_sizes, scales)
    T = q.shape[2]
    pos = torch.arange(T, device=q.device)
    s = torch.zeros(q.shape[:3] + (T,), dtype=q.dtype, device=q.device)
    covering = torch.zeros(T, T, device=q.device)
    for q_l, k_l, b, c in zip(q.split(ranks, -1), k.split(ranks, -1), sizes, scales):
        same_block = (pos[:, None] // b) == (pos[None, :] // b)  # (T, T)
        s = s + c * (q_l @ k_l.transpose(-2, -1)) * same_block
        covering = covering + same_block
    if divide_by_levels:
        s = s / covering
    if causal:
        s = s.masked_fill(pos[None, :] > pos[:, None], float('-inf'))
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float('-inf'))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def sliding_window_attention_reference(q, k, v, window, causal=True, scale=None, key_mask=None):
    _check_qkv(q, k, v)
    _check_window(window)
    T = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    pos = torch.arange(T, device=q.device)
    i, j = pos[:, None], pos[None, :]
    keep = ((j <= i) & (j >= i - window)) if causal else (i - j).abs() <= window   # (T, T)
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~keep, float('-inf'))
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float('-inf'))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def linear_feature_map(u):
    """phi(u / sqrt(d)) with phi = ReLU(.)^2, applied to queries and keys."""
    return F.relu(u / math.sqrt(u.shape[-1])) ** 2


def linear_attention_reference(q, k, v, causal=True, eps=1e-6, key_mask=None, rotate=None):
    """rotate: RoPE's linear form (RoFormer, Su et al. 2021, Eq. 19): the numerator's features rotated by
    rotate(f), the denominator's not, so that it stays positive."""
    _check_qkv(q, k, v)
    qf, kf = linear_feature_map(q), linear_feature_map(k)
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
    a = qf @ kf.transpose(-2, -1)                                            # (B, H, T, T)
    n = a if rotate is None else rotate(qf) @ rotate(kf).transpose(-2, -1)
    if causal:
        a, n = a.tril(), n.tril()
    return (n @ v) / (a.sum(-1, keepdim=True) + eps)


# -----------------------------------------------------------------------------
# input checks, shared by every path

def _check_qkv(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, T, d) tensors, got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, H, T, dv) with the B, H, T of q {tuple(q.shape[:3])}, "
                         f"got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_key_mask(key_mask, q):
    B, T = q.shape[0], q.shape[2]
    if key_mask is None:
        return
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, T):
        got = (f"{key_mask.dtype} of shape {tuple(key_mask.shape)}" if isinstance(key_mask, torch.Tensor)
               else type(key_mask).__name__)
        raise ValueError(f"key_mask must be a (B, T) = {(B, T)} bool tensor (True = keep), got {got}")
    if key_mask.device != q.device:
        raise ValueError(f"key_mask is on {key_mask.device} but q is on {q.device}")


def mlr_valid_lengths(sizes):
    """The sequence lengths that tile into the level blocks `sizes`, as text: up to the finest block, then those
    that every smaller block divides."""
    more = [t for t in range(sizes[-1] + 1, sizes[0] + 1) if all(b >= t or t % b == 0 for b in sizes)]
    return f"1 to {sizes[-1]}, " + ', '.join(map(str, more[:8])) + (', ...' if len(more) > 8 else '')


def mlr_level_sizes(T, n_levels, level_sizes=None):
    """Block size of each level, as used on a sequence of length T. Default T / 2^l. An explicit list must
    strictly decrease, each size dividing the one before; sizes >= T make their level global (the model
    fixes its blocks from block_size, so a shorter sequence simply has more global levels), and T must be
    a multiple of every size below it. Returns the sizes clipped to T."""
    if n_levels < 1:
        raise ValueError(f"MLR needs at least one level, got {n_levels}")
    if level_sizes is None:
        finest = 2 ** (n_levels - 1)
        if T % finest != 0:
            raise ValueError(f"MLR with {n_levels} levels halves the sequence {n_levels - 1} times, so T must "
                             f"be divisible by {finest}; got T = {T} (valid: multiples of {finest})")
        return [T // 2 ** l for l in range(n_levels)]
    sizes = [int(b) for b in level_sizes]
    if len(sizes) != n_levels:
        raise ValueError(f"got {len(sizes)} block sizes {sizes} for {n_levels} rank levels; give one per level")
    for a, b in zip(sizes, sizes[1:]):
        if b <= 0 or b >= a or a % b != 0:
            raise ValueError(f"block sizes must strictly decrease, each dividing the one before; got {sizes} "
                             f"({b} does not properly divide {a})")
    if sizes[0] < T:
        raise ValueError(f"level 0 is global, so its block size must be at least T = {T}; got block sizes {sizes}")
    bad = [b for b in sizes if b < T and T % b != 0]
    if bad:
        raise ValueError(f"T = {T} is not a multiple of the MLR block size(s) {bad} (block sizes {sizes}); "
                         f"valid T: {mlr_valid_lengths(sizes)}")
    return [min(b, T) for b in sizes]


def mlr_level_scales(ranks):
    """Default per-level logit scale c_l = 1 / r_l (the paper's reference code)."""
    return [1.0 / r for r in ranks]


def _mlr_check(q, k, v, ranks, level_sizes, scales):
    """The ranks as ints, the block sizes of mlr_level_sizes and the scales (default mlr_level_scales)."""
    _check_qkv(q, k, v)
    ranks = [int(r) for r in ranks]
    if any(r <= 0 for r in ranks):
        raise ValueError(f"every MLR rank must be positive, got {ranks}")
    if sum(ranks) != q.shape[-1]:
        raise ValueError(f"MLR ranks {'|'.join(map(str, ranks))} sum to {sum(ranks)} but the head width is "
                         f"{q.shape[-1]}; the rank allocation must sum to the head width")
    scales = mlr_level_scales(ranks) if scales is None else scales
    return ranks, mlr_level_sizes(q.shape[2], len(ranks), level_sizes), scales


def _feature_scales(ranks, scales, like):
    """The scale of each feature (d,): c_l repeated r_l times, so that q * c makes a prefix dot product the MLR
    score."""
    return torch.cat([torch.full((r,), float(s), dtype=like.dtype, device=like.device) for r, s in zip(ranks, scales)])


def _check_window(window):
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an integer look-back w >= 0 (query i sees keys i-w..i), got {window!r}")


def _window_allowed(i, j, window, causal):
    """Which (query i, key j) pairs a look-back-w window keeps: i-w <= j <= i, or |i-j| <= w bidirectional."""
    return (j <= i) & (j >= i - window) if causal else (j - i).abs() <= window


# -----------------------------------------------------------------------------
# MLR attention, blocked torch path: tiles per level, partial softmaxes merged exactly

def _partial_attention(s, v):
    """Softmax over the last axis of scores s (..., n, m) applied to v (..., m, dv), returning the normalized
    output and the log-sum-exp of each row. A row with no valid key (all -inf) gives output 0 and a
    log-sum-exp of about -1e30, so merging ignores it and no NaN reaches the gradients."""
    m = s.amax(dim=-1, keepdim=True).detach().clamp_min(-1e30)  # (..., n, 1) finite
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / l.clamp_min(1e-30)
    lse = m + torch.log(l.clamp_min(1e-30))
    return out, lse


def _merge_partials(outs, lses):
    """Exact combination of partial softmaxes over disjoint key sets (the FlashAttention merge)."""
    lse = torch.stack(lses, dim=0)                   # (P, B, H, T, 1)
    w = torch.softmax(lse, dim=0)                    # weight of each key set
    return sum(w[i] * outs[i] for i in range(len(outs)))


def _mlr_sibling_tiles(q, k, v, l, sizes, R, causal, divide_by_levels, key_mask):
    """Level l's pairs: in the same level-l block but in different level-(l+1) blocks (children), scored with
    the first R = R_l features of the scaled q. Returns the partial softmax (B, H, T, dv), (B, H, T, 1)."""
    B, H, T, _ = q.shape
    dv = v.shape[-1]
    neg = torch.finfo(q.dtype).min
    c, b = sizes[l] // sizes[l + 1], sizes[l + 1]        # children per block, child size
    n = T // sizes[l]                                    # blocks at level l
    Q = q[..., :R].reshape(B, H, n, c, b, R)             # (B, H, n, c, b, R)
    K = k[..., :R].reshape(B, H, n, c, b, R)
    V = v.reshape(B, H, n, c, b, dv)
    km = None if key_mask is None else key_mask.reshape(B, 1, n, c, 1, b)
    if causal and c == 2:
        # only the second child sees the first; the first child has no past sibling at this level
        s = Q[:, :, :, 1] @ K[:, :, :, 0].transpose(-2, -1)      # (B, H, n, b, b)
        if divide_by_levels:
            s = s / (l + 1)
        if km is not None:
            s = s.masked_fill(~km[:, :, :, 0], neg)
        o1, lse1 = _partial_attention(s, V[:, :, :, 0])         # (B, H, n, b, dv), (B, H, n, b, 1)
        o = torch.stack([torch.zeros_like(o1), o1], dim=3)       # (B, H, n, 2, b, dv)
        lse = torch.stack([torch.full_like(lse1, -1e30), lse1], dim=3)
    else:
        # child a sees every other child a' (a' < a only, when causal: those tiles are masked whole)
        other = torch.tensor([[j for j in range(c) if j != a] for a in range(c)], device=q.device)  # (c, c-1)
        Ko = K[:, :, :, other].reshape(B, H, n, c, (c - 1) * b, R)       # (B, H, n, c, (c-1)b, R)
        Vo = V[:, :, :, other].reshape(B, H, n, c, (c - 1) * b, dv)
        s = Q @ Ko.transpose(-2, -1)                                     # (B, H, n, c, b, (c-1)b)
        if divide_by_levels:
            s = s / (l + 1)
        if causal:
            future = (other > torch.arange(c, device=q.device)[:, None])              # (c, c-1)
            s = s.masked_fill(future.repeat_interleave(b, dim=1)[:, None, :], neg)
        if km is not None:
            kmo = km[:, :, :, other].reshape(B, 1, n, c, 1, (c - 1) * b)
            s = s.masked_fill(~kmo, neg)
        o, lse = _partial_attention(s, Vo)
    return o.reshape(B, H, T, dv), lse.reshape(B, H, T, 1)


def _mlr_diagonal_blocks(q, k, v, b, L, causal, divide_by_levels, key_mask):
    """The diagonal blocks of the finest level (size b, all L levels shared): all d features, the causal mask
    inside the block. Returns the partial softmax (B, H, T, dv), (B, H, T, 1)."""
    B, H, T, d = q.shape
    dv = v.shape[-1]
    neg = torch.finfo(q.dtype).min
    n = T // b
    Q, K, V = q.reshape(B, H, n, b, d), k.reshape(B, H, n, b, d), v.reshape(B, H, n, b, dv)
    s = Q @ K.transpose(-2, -1)                                          # (B, H, n, b, b)
    if divide_by_levels:
        s = s / L
    if causal:
        s = s.masked_fill(torch.ones(b, b, dtype=torch.bool, device=q.device).triu(1), neg)
    if key_mask is not None:
        s = s.masked_fill(~key_mask.reshape(B, 1, n, 1, b), neg)
    o, lse = _partial_attention(s, V)
    return o.reshape(B, H, T, dv), lse.reshape(B, H, T, 1)


def mlr_attention_torch(q, k, v, ranks, causal=True, level_sizes=None, scales=None,
                        divide_by_levels=False, key_mask=None):
    """Structured MLR attention: tiles per level with prefix features, partial softmaxes merged exactly."""
    ranks, sizes, scales = _mlr_check(q, k, v, ranks, level_sizes, scales)
    q = q * _feature_scales(ranks, scales, q)
    outs, lses = [], []
    for l in range(len(ranks) - 1):                      # the sibling tiles of each level l < L-1
        if sizes[l] // sizes[l + 1] == 1:
            continue                                     # a global level above another global level
        o, lse = _mlr_sibling_tiles(q, k, v, l, sizes, sum(ranks[:l + 1]), causal, divide_by_levels, key_mask)
        outs.append(o)
        lses.append(lse)
    o, lse = _mlr_diagonal_blocks(q, k, v, sizes[-1], len(ranks), causal, divide_by_levels, key_mask)
    outs.append(o)
    lses.append(lse)
    return _merge_partials(outs, lses)


def _attention_flops(pairs_and_widths, dv):
    """Multiply-adds x 2 of scoring (query, key) pairs with `width` features each and adding their dv-wide values
    into the outputs: sum of 2 * pairs * (width + dv)."""
    return 2 * sum(pairs * (width + dv) for pairs, width in pairs_and_widths)


def mlr_attention_flops(T, ranks, causal=True, level_sizes=None, dv=None):
    """Multiply-adds x 2 of mlr_attention_torch on one (batch, head): scores plus A·V."""
    sizes = mlr_level_sizes(T, len(ranks), level_sizes)
    terms = [(T * sizes[-1], sum(ranks))]                       # the diagonal blocks, all d features
    for l in range(len(ranks) - 1):                             # the sibling tiles, the prefix R_l
        c, b = sizes[l] // sizes[l + 1], sizes[l + 1]
        terms.append((T * (c - 1) * b // (2 if causal and c == 2 else 1), sum(ranks[:l + 1])))
    return _attention_flops(terms, sum(ranks) if dv is None else dv)


# -----------------------------------------------------------------------------
# the core of the flash paths: an online softmax over the pieces of a tile, forward and backward
#
# The *_flash paths (MLR, SWA) are FlashAttention-2 on the CPU in torch ops. A tile is a batch of (query block,
# key block) pairs, held as (N, rows, f) views of the (B, H, T, f) tensors (_child), cut into pieces of at most
# PIECE score entries per thread (so each thread's share stays in its core's L2 cache).
# - Forward: a piece's partial softmax (output, log-sum-exp) is merged into the running (o, lse) of its rows.
# - Backward: the split-KV identity. With the final lse and delta = rowsum(do * o), any key subset's
#   probabilities are p = exp(s - lse) and its share of the gradients is
#       dv += pᵀ do,   ds = p * (do vᵀ - delta),   dq += ds k,   dk += dsᵀ q
#   so each piece's scores are recomputed; only q, k, v, o and lse are saved, nothing T×T.

PIECE = 1 << 18   # score entries per piece and per CPU thread (each thread's share stays in its core's L2)


def _child(x, size, a, b):
    """Rows of child a (b rows) of every block of `size` rows: (B, H, T, f) -> (B*H*T/size, b, f), a view."""
    B, H, T, f = x.shape
    return x.view(B * H * (T // size), size // b, b, f)[:, a]


def _key_keep(key_mask, H, size, a, b):
    """key_mask (B, T) cut like _child: (B*H*T/size, 1, b) bool, or None."""
    if key_mask is None:
        return None
    B, T = key_mask.shape
    keep = key_mask.view(B, 1, T // size, size // b, b)[:, :, :, a].expand(B, H, T // size, b)
    return keep.reshape(-1, 1, b)


def _pieces(N, rows, keys):
    """Slices (blocks, rows) of an (N, rows, keys) score tile into pieces of about PIECE entries per thread."""
    entries = PIECE * torch.get_num_threads()
    step = min(rows, max(16, entries // keys))
    group = max(1, entries // (step * keys))
    for n0 in range(0, N, group):
        for r0 in range(0, rows, step):
            yield slice(n0, min(n0 + group, N)), slice(r0, min(r0 + step, rows))


def _tile_pieces(Q, K, scale, keep, groups, factor):
    """The pieces of one tile, queries Q (N, m, f) against keys K (N, b, f), and their scores: q times scale (f,)
    dotted with k over the prefix up to the first group's feature, plus each feature group (f0, f1, same (m, b))
    where `same` holds (MLR's bottom tiles); times the per-pair factor (m, b); -inf where keep = (rows (m, b),
    keys (N, 1, b)) is False. Yields the piece (n, r), its scaled queries (a copy; Q's view when scale is None),
    its rows of the groups and its scores."""
    R = groups[0][0] if groups else Q.shape[-1]
    for n, r in _pieces(Q.shape[0], Q.shape[1], K.shape[1]):
        Qp = Q[n, r] if scale is None else Q[n, r] * scale
        rows = [(f0, f1, same[r]) for f0, f1, same in groups]
        s = torch.bmm(Qp[..., :R], K[n, :, :R].transpose(-2, -1))                # (n, m, b)
        for f0, f1, same in rows:
            s.addcmul_(torch.bmm(Qp[..., f0:f1], K[n, :, f0:f1].transpose(-2, -1)), same)
        if factor is not None:
            s.mul_(factor[r])
        for mask in (None if keep[0] is None else keep[0][r], None if keep[1] is None else keep[1][n]):
            if mask is not None:
                s.masked_fill_(~mask, float('-inf'))
        yield n, r, Qp, rows, s


def _tile_forward(Q, K, V, O, Lse, merge, scale=None, keep=(None, None), groups=(), factor=None):
    """Softmax of one tile's scores times V, piece by piece: written into (merge=False) or merged into the
    running O, Lse of its rows."""
    for n, r, _, _, s in _tile_pieces(Q, K, scale, keep, groups, factor):
        m = s.amax(-1, keepdim=True).clamp_min_(-1e30)                         # rows without keys stay finite
        p = s.sub_(m).exp_()
        l = p.sum(-1, keepdim=True).clamp_min_(1e-30)
        o = torch.bmm(p, V[n]).div_(l)
        lse = m.add_(l.log_())
        O_rows, Lse_rows = O[n, r], Lse[n, r]
        if not merge:
            O_rows.copy_(o)
            Lse_rows.copy_(lse)
            continue
        new = torch.logaddexp(Lse_rows, lse)
        O_rows.mul_(torch.exp(Lse_rows - new)).add_(o.mul_(torch.exp(lse - new)))
        Lse_rows.copy_(new)


def _tile_backward(Q, K, V, dO, Lse, Delta, dQ, dK, dV, write, scale=None, keep=(None, None), groups=(),
                   factor=None):
    """One tile's gradients by the split-KV identity, from recomputed scores: written into (write=True: the tile
    touches every row, key and feature) or added to dQ, dK, dV. dq = ds k scale and dk = dsᵀ (q scale) over the
    prefix all pairs share, and over each feature group with ds masked to its pairs."""
    width = groups[0][0] if groups else Q.shape[-1]
    for n, r, Qp, rows, s in _tile_pieces(Q, K, scale, keep, groups, factor):
        p = s.sub_(Lse[n, r]).exp_()                                           # the final probabilities
        dv_piece = torch.bmm(p.transpose(-2, -1), dO[n, r])
        ds = torch.bmm(dO[n, r], V[n].transpose(-2, -1)).sub_(Delta[n, r]).mul_(p)
        if factor is not None:
            ds.mul_(factor[r])
        first = write and r.start == 0                                         # later row pieces add to dk, dv
        for f0, f1, ds_l in [(0, width, ds)] + [(f0, f1, ds * same) for f0, f1, same in rows]:
            dq_piece = torch.bmm(ds_l, K[n, :, f0:f1])
            if scale is not None:
                dq_piece.mul_(scale[f0:f1])
            dQ[n, r, f0:f1].copy_(dq_piece) if write else dQ[n, r, f0:f1].add_(dq_piece)
            dk_piece = torch.bmm(ds_l.transpose(-2, -1), Qp[..., f0:f1])
            dK[n, :, f0:f1].copy_(dk_piece) if first else dK[n, :, f0:f1].add_(dk_piece)
        dV[n].copy_(dv_piece) if first else dV[n].add_(dv_piece)


# -----------------------------------------------------------------------------
# MLR attention, flash-style torch path: the same tiles, O(T·d) memory, a backward written by hand
#
# mlr_attention_torch above is the readable form, but autograd keeps every tile's probabilities (O(T²) memory).
# This path runs the same tiles through the pieces of the flash core: O(T·d) memory.
# - The bottom: levels with blocks smaller than BOTTOM (the paper's T = 1024, 8 levels has 8-token blocks) would
#   be thousands of tiny products. Instead every block of the deepest level j with blocks >= BOTTOM is one dense
#   S×S tile: the prefix R_j shared by all its pairs in one product, plus one product per deeper level with its
#   r_l features times its same-block mask. That spends more multiply-adds than the exact count (about 3% at
#   T = 1024, see mlr_attention_flash_flops) but runs at matrix-product speed.
# - Not PyTorch's fused CPU flash kernel per tile: it needs q, k, v of one width, and R_l is below d.

BOTTOM = 32       # smallest block size scored by sibling tiles; smaller levels go into the dense bottom tiles


def _mlr_plan(sizes, ranks, causal, divide_by_levels):
    """The work of the flash path: the bottom level j (its blocks are scored densely) and the sibling tiles
    (block size, query child a, key child a2, child size b, prefix width R_l, score factor) of levels < j."""
    L = len(ranks)
    j = max(0, next((l for l in range(L) if sizes[l] < BOTTOM), L) - 1)
    tiles = []
    for l in range(j):
        c, b = sizes[l] // sizes[l + 1], sizes[l + 1]
        factor = 1.0 / (l + 1) if divide_by_levels else 1.0
        tiles += [(sizes[l], a, a2, b, sum(ranks[:l + 1]), factor)
                  for a in range(c) for a2 in range(c) if a2 < a or (a2 > a and not causal)]
    return j, tiles


def _mlr_tiles(c, key_mask, H, sizes, ranks, causal, divide_by_levels):
    """The tiles of the flash path, each as (rows, keys, width R, scale, keep, groups, factor): rows and keys map
    a (B, H, T, f) tensor to the (N, m, f) views of the tile's query and key blocks. First the bottom tiles, each
    level-j block (S×S) against itself: the feature groups of the deeper levels with their same-block masks, the
    causal mask and the per-pair factor 1 / (number of levels covering the pair); then the sibling tiles."""
    j, tiles = _mlr_plan(sizes, ranks, causal, divide_by_levels)
    S, R = sizes[j], sum(ranks[:j + 1])
    pos = torch.arange(S, device=c.device)
    groups = []                                              # (first feature, last feature, mask (S, S))
    for l in range(j + 1, len(ranks)):
        same = (pos[:, None] // sizes[l]) == (pos[None, :] // sizes[l])
        groups.append((R, R + ranks[l], same.to(c.dtype)))
        R += ranks[l]
    factor = None
    if divide_by_levels:
        covering = torch.full((S, S), j + 1.0, dtype=c.dtype, device=c.device)     # levels 0..j
        factor = 1.0 / (covering + sum(m for _, _, m in groups))
    bottom = functools.partial(_child, size=S, a=0, b=S)
    causal_keep = (pos[None, :] <= pos[:, None]) if causal else None
    yield bottom, bottom, len(c), c, (causal_keep, _key_keep(key_mask, H, S, 0, S)), groups, factor
    for size, a, a2, b, R, alpha in tiles:                                     # query child a, key child a2
        yield (functools.partial(_child, size=size, a=a, b=b), functools.partial(_child, size=size, a=a2, b=b), R,
               alpha * c[:R], (None, _key_keep(key_mask, H, size, a2, b)), (), None)


class _MLRFlash(torch.autograd.Function):
    """MLR attention over the tiles of _mlr_tiles with an online softmax. c: the scale of each feature (d,),
    c_l repeated r_l times; it is applied to each piece's copy of q, never to all of q."""

    @staticmethod
    def forward(ctx, q, k, v, c, key_mask, sizes, ranks, causal, divide_by_levels):
        B, H, T, _ = q.shape
        o = torch.empty(B, H, T, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, T, 1, dtype=q.dtype, device=q.device)
        # the bottom tiles hold every row's own block, so they write o and lse first; the sibling tiles merge
        tiles = _mlr_tiles(c, key_mask, H, sizes, ranks, causal, divide_by_levels)
        for i, (rows, keys, R, scale, keep, groups, factor) in enumerate(tiles):
            _tile_forward(rows(q)[..., :R], keys(k)[..., :R], keys(v), rows(o), rows(lse), i > 0, scale, keep,
                          groups, factor)
        ctx.save_for_backward(q, k, v, c, o, lse, key_mask)
        ctx.plan = (sizes, ranks, causal, divide_by_levels)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, c, o, lse, key_mask = ctx.saved_tensors
        do = do.contiguous()
        delta = (do * o).sum(-1, keepdim=True)                          # (B, H, T, 1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # the bottom tiles write every entry of dq, dk, dv; the sibling tiles add to them
        for i, (rows, keys, R, scale, keep, groups, factor) in enumerate(_mlr_tiles(c, key_mask, q.shape[1],
                                                                                    *ctx.plan)):
            _tile_backward(rows(q)[..., :R], keys(k)[..., :R], keys(v), rows(do), rows(lse), rows(delta),
                           rows(dq)[..., :R], keys(dk)[..., :R], keys(dv), i == 0, scale, keep, groups, factor)
        return dq, dk, dv, None, None, None, None, None, None


def mlr_attention_flash(q, k, v, ranks, causal=True, level_sizes=None, scales=None, divide_by_levels=False,
                        key_mask=None):
    """MLR attention through _MLRFlash; same arguments and result as mlr_attention_torch. Half-precision
    inputs are computed in float32 (the exponentials and merges need it) and returned in their dtype."""
    ranks, sizes, scales = _mlr_check(q, k, v, ranks, level_sizes, scales)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    c = _feature_scales(ranks, scales, q)
    o = _MLRFlash.apply(q.contiguous(), k.contiguous(), v.contiguous(), c, key_mask, tuple(sizes), tuple(ranks),
                        causal, divide_by_levels)
    return o.to(dtype)


def mlr_attention_flash_flops(T, ranks, causal=True, level_sizes=None, dv=None):
    """Multiply-adds x 2 that mlr_attention_flash's forward spends on one (batch, head): the exact sibling
    tiles of mlr_attention_flops above level j, and the dense S×S bottom tiles with all d features."""
    sizes = mlr_level_sizes(T, len(ranks), level_sizes)
    j, tiles = _mlr_plan(sizes, ranks, causal, False)
    terms = [(T * sizes[j], sum(ranks))] + [((T // size) * b * b, R) for size, _, _, b, R, _ in tiles]
    return _attention_flops(terms, sum(ranks) if dv is None else dv)


# -----------------------------------------------------------------------------
# sliding-window attention, blocked torch path and flash path
#
# With query chunks of c > w rows, chunk i's keys lie in key blocks i - 1 and i (and i + 1 bidirectional), so SWA
# is two (three) tiles of c×c blocks, each with a fixed band mask, merged exactly. k and v are shifted by one block
# for the neighbour tiles (a copy); the flash path shifts their gradients back and saves no scores.

def _swa_chunk(window, T):
    """The query chunk length c: more than w rows (so chunks i-1 and i hold query i's window) unless the window
    covers T; at least 32."""
    return min(max(window + 1, 32), T)


def _swa_blocks(q, k, v, window, scale, key_mask):
    """q times its scale (default 1/sqrt(d)), k and v, padded to Tp = n c rows (B, H, Tp, f) and contiguous; the
    key validity valid (B, Tp) (keys that exist and are not masked) and the chunk length c."""
    B, H, T, d = q.shape
    c = _swa_chunk(window, T)
    Tp = -(-T // c) * c
    valid = torch.zeros(B, Tp, dtype=torch.bool, device=q.device)
    valid[:, :T] = True if key_mask is None else key_mask
    q = q * (1.0 / math.sqrt(d) if scale is None else scale)
    if Tp != T:
        q, k, v = (F.pad(x, (0, 0, 0, Tp - T)) for x in (q, k, v))      # (B, H, Tp, f)
    return q.contiguous(), k.contiguous(), v.contiguous(), valid, c


def _shift_blocks(x, offset, c):
    """x (B, H, Tp, f) with rows moved so that block i holds what was block i + offset (zeros past the ends)."""
    if offset == 0:
        return x
    out = torch.zeros_like(x)
    if offset < 0:
        out[:, :, c:] = x[:, :, :-c]
    else:
        out[:, :, :-c] = x[:, :, c:]
    return out


def _swa_tile(k, v, valid, window, causal, c, offset):
    """Keys and values of the key block `offset` blocks from each query block, (B*H*n, c, f), and the keep
    masks: the band (c, c) of the window and the keys' validity (B*H*n, 1, c)."""
    B, H, Tp, _ = k.shape
    K, V = (_shift_blocks(x, offset, c).view(-1, c, x.shape[-1]) for x in (k, v))
    i = torch.arange(c, device=k.device)
    band = _window_allowed(i[:, None], i[None, :] + offset * c, window, causal)            # (c, c)
    ok = _shift_blocks(valid[:, None, :, None].expand(B, H, Tp, 1).to(k.dtype), offset, c)  # (B, H, Tp, 1)
    return K, V, (band, ok.view(-1, 1, c) > 0)


def sliding_window_attention_torch(q, k, v, window, causal=True, scale=None, key_mask=None):
    """Blocked SWA: queries in chunks of c > w rows; chunk i sees key chunks i-1, i (and i+1 bidirectional), a
    tile each, whose partial softmaxes are merged exactly."""
    _check_qkv(q, k, v)
    _check_window(window)
    T = q.shape[2]
    q, k, v, valid, c = _swa_blocks(q, k, v, window, scale, key_mask)
    Q = q.view(-1, c, q.shape[-1])                                           # (B*H*n, c, d)
    outs, lses = [], []
    for offset in (0, -1) if causal else (0, -1, 1):
        K, V, (band, ok) = _swa_tile(k, v, valid, window, causal, c, offset)
        s = (Q @ K.transpose(-2, -1)).masked_fill(~(band & ok), torch.finfo(q.dtype).min)   # (B*H*n, c, c)
        o, lse = _partial_attention(s, V)
        outs.append(o)
        lses.append(lse)
    return _merge_partials(outs, lses).view(*q.shape[:3], -1)[:, :, :T]


class _SWAFlash(torch.autograd.Function):
    """Sliding-window attention over the c×c tiles of _swa_tile with an online softmax; q, k, v, valid, c as
    _swa_blocks gives them."""

    @staticmethod
    def forward(ctx, q, k, v, valid, window, causal, c):
        B, H, Tp, _ = q.shape
        o = torch.empty(B, H, Tp, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, Tp, 1, dtype=q.dtype, device=q.device)
        Q, O, Lse = (x.view(-1, c, x.shape[-1]) for x in (q, o, lse))        # (B*H*n, c, f) views
        for offset in (0, -1) if causal else (0, -1, 1):     # the key blocks seen; the own block first: it writes
            K, V, keep = _swa_tile(k, v, valid, window, causal, c, offset)
            _tile_forward(Q, K, V, O, Lse, merge=offset != 0, keep=keep)
        ctx.save_for_backward(q, k, v, valid, o, lse)
        ctx.plan = (window, causal, c)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, valid, o, lse = ctx.saved_tensors
        window, causal, c = ctx.plan
        do = do.contiguous()
        delta = (do * o).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        Q, dO, Lse, D, dQ = (x.view(-1, c, x.shape[-1]) for x in (q, do, lse, delta, dq))
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for offset in (0, -1) if causal else (0, -1, 1):
            K, V, keep = _swa_tile(k, v, valid, window, causal, c, offset)
            if offset == 0:                                                   # k, v unshifted: straight into dk, dv
                dK, dV = dk.view(K.shape), dv.view(V.shape)
            else:                                                             # gradients of the shifted k, v
                dK, dV = torch.zeros_like(K), torch.zeros_like(V)
            _tile_backward(Q, K, V, dO, Lse, D, dQ, dK, dV, write=False, keep=keep)
            for grad, tile_grad in ((dk, dK.view(k.shape)), (dv, dV.view(v.shape))):    # shift back
                if offset < 0:
                    grad[:, :, :-c].add_(tile_grad[:, :, c:])
                elif offset > 0:
                    grad[:, :, c:].add_(tile_grad[:, :, :-c])
        return dq, dk, dv, None, None, None, None


def sliding_window_attention_flash(q, k, v, window, causal=True, scale=None, key_mask=None):
    """SWA through _SWAFlash; same arguments and result as sliding_window_attention_torch, with O(T·d)
    memory for the backward. Half-precision inputs are computed in float32."""
    _check_qkv(q, k, v)
    _check_window(window)
    T, dtype = q.shape[2], q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    q, k, v, valid, c = _swa_blocks(q, k, v, window, scale, key_mask)
    return _SWAFlash.apply(q, k, v, valid, window, causal, c)[:, :, :T].to(dtype)


def sliding_window_attention_flops(T, window, d, causal=True, dv=None):
    """Multiply-adds x 2 of sliding_window_attention_torch on one (batch, head)."""
    c = _swa_chunk(window, T)
    span = c + c + (0 if causal else c)                         # keys per query chunk
    return _attention_flops([(-(-T // c) * c * span, d)], d if dv is None else dv)


# -----------------------------------------------------------------------------
# causal linear attention, chunked torch path

def linear_attention_torch(q, k, v, causal=True, eps=1e-6, key_mask=None, chunk=64, rotate=None):
    """Chunked parallel form: within a chunk the masked quadratic form, across chunks the running state
    S = sum_j k'_j v_j^T (d × dv) and z = sum_j k'_j. rotate: as linear_attention_reference (S then holds the
    rotated keys, z the plain ones)."""
    _check_qkv(q, k, v)
    qf, kf = linear_feature_map(q), linear_feature_map(k)
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
    qn, kn = (qf, kf) if rotate is None else (rotate(qf), rotate(kf))      # the numerator's features
    if not causal:
        S = kn.transpose(-2, -1) @ v                                         # (B, H, d, dv)
        z = kf.sum(dim=2, keepdim=True)                                      # (B, H, 1, d)
        return (qn @ S) / ((qf * z).sum(-1, keepdim=True) + eps)
    B, H, T, d = q.shape
    dv = v.shape[-1]
    chunk = min(chunk, T)                                                    # short sequences: one chunk
    n = -(-T // chunk)
    pad = n * chunk - T
    chunks = lambda t: F.pad(t, (0, 0, 0, pad)).reshape(B, H, n, chunk, t.shape[-1])   # (B, H, n, c, d or dv)
    qc, kc, vc = chunks(qf), chunks(kf), chunks(v)
    qnc, knc = (qc, kc) if rotate is None else (chunks(qn), chunks(kn))
    a = (qc @ kc.transpose(-2, -1)).tril()                                   # (B, H, n, c, c) intra-chunk
    an = a if rotate is None else (qnc @ knc.transpose(-2, -1)).tril()      # ... of the numerator
    kv = knc.transpose(-2, -1) @ vc                                          # (B, H, n, d, dv) per chunk
    S = kv.cumsum(dim=2) - kv                                                # state before each chunk
    z = kc.sum(dim=3).cumsum(dim=2) - kc.sum(dim=3)                          # (B, H, n, d)
    num = an @ vc + qnc @ S                                                  # (B, H, n, c, dv)
    den = a.sum(-1) + (qc * z[:, :, :, None, :]).sum(-1)                     # (B, H, n, c)
    o = num / (den[..., None] + eps)
    return o.reshape(B, H, n * chunk, dv)[:, :, :T]


def linear_attention_flops(T, d, causal=True, dv=None, chunk=64):
    dv = d if dv is None else dv
    if not causal:
        return 2 * T * d * (2 * dv + 1)
    return 2 * T * (min(chunk, T) * (d + dv) + 2 * d * dv)


# -----------------------------------------------------------------------------
# Triton kernels: FlashAttention-2 with tiles that know their MLR level and window
#
# One kernel family serves both MLR and SWA. A program owns one query tile (BLOCK_M rows) of one (batch, head)
# and streams key tiles (BLOCK_N rows) through an online softmax; nothing T×T exists.
# - Window: key tiles wholly outside i-w <= j <= i (|i-j| <= w bidirectional) are never visited. MLR runs with
#   window = T, which leaves only the causal skip (no key tile after the query tile).
# - MLR levels: a (query tile, key tile) pair held whole by the blocks of n_all levels is scored with the first
#   R = FEAT[n_all] = r_0 + ... + r_{n_all-1} features only: one full-width product with k's other features
#   zeroed, q read once per program (on tensor cores, loads cost more than the products). A tile larger than
#   the finest block (the paper's T = 1024, L = 8 has 8-token blocks, below tl.dot's 16) straddles block
#   boundaries: each straddled level l adds its own r_l features under a same-block mask, near the diagonal only.
# - SWA is the one-level case: FEAT = [0, d], every tile uses all features, plus a window.
# - Plain and masked tiles (the Triton tutorial's two stages): most tile pairs lie wholly below the diagonal,
#   inside the window, before T, unmasked and inside or outside each level's block. Those are "plain": one
#   product, a scalar division by their level count, no per-entry mask. Each program visits its plain tiles in
#   one loop and the rest (the diagonal, the window's edge, T's edge, straddled levels, a key mask), which lie on
#   both sides of them, in a second loop that builds the full per-entry mask (one loop, so the masked code with its
#   unrolled levels is compiled once). Blocks unaligned with the tiles only move tiles into the masked loop.
# - Precision: float32 tiles are multiplied in full float32 ('ieee'), as torch's matmul does by default (Triton's
#   default, TF32, keeps 10 mantissa bits); bf16 / fp16 tiles use the tensor cores at their own precision.
# The scales c_l (SWA: 1/sqrt(d)) are applied to q in torch before the kernels, so autograd carries them.

_F32_DOT = tl.constexpr('ieee') if HAS_TRITON else None


@triton.jit
def _load_tile(P, rows, cols, T, W):
    """Rows `rows`, columns `cols` of a (T, W) row-major matrix at P; zeros outside it."""
    return tl.load(P + rows[:, None] * W + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < W), other=0.0)


@triton.jit
def _store_tile(P, rows, cols, T, W, x):
    tl.store(P + rows[:, None] * W + cols[None, :], x.to(P.dtype.element_ty),
             mask=(rows[:, None] < T) & (cols[None, :] < W))


@triton.jit
def _shared_levels(start_m, start_n, T, SIZES, N_LEVELS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """(n_all, n_any): how many levels have a block holding every (query, key) pair of the two tiles, and
    at least one pair. Levels nest, so these are levels 0..n_all-1 and 0..n_any-1; level 0 is global."""
    m_last = tl.minimum(start_m + BLOCK_M, T) - 1
    n_last = tl.minimum(start_n + BLOCK_N, T) - 1
    n_all = 1
    n_any = 1
    for l in tl.static_range(1, N_LEVELS):
        b = tl.load(SIZES + l)                                  # block size of level l
        q0, q1, k0, k1 = start_m // b, m_last // b, start_n // b, n_last // b
        n_all += ((q0 == q1) & (k0 == k1) & (q0 == k0)).to(tl.int32)
        n_any += ((q0 <= k1) & (k0 <= q1)).to(tl.int32)
    return n_all, n_any


@triton.jit
def _tile_scores(q, k, KEEP, SIZES, FEAT, start_m, start_n, offs_d, T, window, N_LEVELS: tl.constexpr,
                 CAUSAL: tl.constexpr, DIVIDE: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Scores of the query tile q (BLOCK_M, BLOCK_D) at row start_m against the key tile k (BLOCK_N, BLOCK_D) at
    row start_n: -inf where the pair is not real (a position >= T, a key outside the window or in the future
    when causal, a masked key); also the levels the tiles share (n_all, n_any) and per entry the number of levels
    covering it (divide_by_levels). Each product runs at full width with k's other features zeroed: on tensor
    cores one dot of d features costs less than loading q again in slices of R."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_all, n_any = _shared_levels(start_m, start_n, T, SIZES, N_LEVELS, BLOCK_M, BLOCK_N)
    k_all = tl.where(offs_d[None, :] < tl.load(FEAT + n_all), k, 0.0).to(k.dtype)
    s = tl.dot(q, tl.trans(k_all), input_precision=_F32_DOT)
    cover = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + n_all
    for l in tl.static_range(1, N_LEVELS):
        if (l >= n_all) & (l < n_any):  # level l straddles the tiles: only same-block entries get r_l
            b = tl.load(SIZES + l)
            same = (offs_m[:, None] // b) == (offs_n[None, :] // b)                  # (BLOCK_M, BLOCK_N)
            in_l = (offs_d >= tl.load(FEAT + l)) & (offs_d < tl.load(FEAT + l + 1))
            s_l = tl.dot(q, tl.trans(tl.where(in_l[None, :], k, 0.0).to(k.dtype)), input_precision=_F32_DOT)
            s += tl.where(same, s_l, 0.0)
            cover += same.to(tl.float32)
    if DIVIDE:
        s = s / cover
    i, j = offs_m[:, None], offs_n[None, :]
    keep = (i < T) & (j < T) & (j >= i - window)
    if CAUSAL:
        keep = keep & (j <= i)
    else:
        keep = keep & (j <= i + window)
    if HAS_KEEP:
        keep = keep & (tl.load(KEEP + offs_n, mask=offs_n < T, other=0) != 0)[None, :]
    return tl.where(keep, s, float('-inf')), cover, n_all, n_any


@triton.jit
def _feature_grad(ds, x, pos_a, pos_b, n_all, n_any, SIZES, FEAT, offs_d, N_LEVELS: tl.constexpr):
    """sum_b ds[a, b] x[b, :], where entry (a, b) reaches only the features of the levels a and b share:
    dq from (ds, k), dk from (ds^T, q). Full-width products with the other features zeroed."""
    x_all = tl.where(offs_d[None, :] < tl.load(FEAT + n_all), x, 0.0).to(x.dtype)
    g = tl.dot(ds.to(x.dtype), x_all, input_precision=_F32_DOT)
    for l in tl.static_range(1, N_LEVELS):
        if (l >= n_all) & (l < n_any):
            b = tl.load(SIZES + l)
            same = (pos_a[:, None] // b) == (pos_b[None, :] // b)
            in_l = (offs_d >= tl.load(FEAT + l)) & (offs_d < tl.load(FEAT + l + 1))
            g += tl.dot(tl.where(same, ds, 0.0).to(x.dtype), tl.where(in_l[None, :], x, 0.0).to(x.dtype),
                        input_precision=_F32_DOT)
    return g


@triton.jit
def _level_vectors(SIZES, FEAT, N_LEVELS: tl.constexpr, LEVELS_P2: tl.constexpr):
    """The block sizes (padded with 1) and feature prefixes FEAT[0..N_LEVELS] as vectors, read once a program."""
    offs_l = tl.arange(0, LEVELS_P2)
    sizes = tl.load(SIZES + offs_l, mask=offs_l < N_LEVELS, other=1)
    feats = tl.load(FEAT + offs_l, mask=offs_l <= N_LEVELS, other=0)
    return offs_l, sizes, feats


@triton.jit
def _plain_keys(start_m, lo, hi, sizes, offs_l, window, N_LEVELS: tl.constexpr, HAS_KEEP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[p_lo, p_hi): the plain key tiles of the query tile at start_m, within the visited [lo, hi). Plain: every
    pair in the window (n0 >= m1 - w), before the diagonal (n1 < m0), and no level l >= 1 straddled. A key
    tile before the query tile's level-l block shares no pair with it; one inside it shares all, if the query
    tile lies in one block; so only a query tile crossing a block boundary, or a boundary inside a key tile,
    makes tiles from that block's start on masked."""
    p_lo = tl.minimum(tl.maximum(start_m + BLOCK_M - 1 - window, 0) + BLOCK_N - 1, hi) // BLOCK_N * BLOCK_N
    p_lo = tl.maximum(p_lo, lo)
    b0 = start_m // sizes * sizes                                    # start of the query's block, per level
    crossed = ((start_m + BLOCK_M - 1) // sizes != start_m // sizes) | (b0 % BLOCK_N != 0)
    straddled = tl.min(tl.where(crossed & (offs_l >= 1) & (offs_l < N_LEVELS), b0, start_m), 0)
    p_hi = tl.minimum(start_m, straddled) // BLOCK_N * BLOCK_N
    if HAS_KEEP:
        p_hi = p_lo
    return p_lo, tl.maximum(p_hi, p_lo)


@triton.jit
def _plain_queries(start_n, lo, hi, sizes, offs_l, window, N_LEVELS: tl.constexpr, HAS_KEEP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[q_lo, q_hi): the plain query tiles of the key tile at start_n (the mirror of _plain_keys): after it,
    every pair in the window, and from the first block boundary after the key tile on where the key tile
    crosses a level's boundary or that boundary falls inside a query tile."""
    e1 = ((start_n + BLOCK_N - 1) // sizes + 1) * sizes              # end of the key tile's block, per level
    crossed = ((start_n + BLOCK_N - 1) // sizes != start_n // sizes) | (e1 % BLOCK_M != 0)
    straddled = tl.max(tl.where(crossed & (offs_l >= 1) & (offs_l < N_LEVELS), e1, 0), 0)
    q_lo = tl.maximum(start_n + BLOCK_N, straddled)
    q_lo = tl.minimum(tl.maximum((q_lo + BLOCK_M - 1) // BLOCK_M * BLOCK_M, lo), hi)
    q_hi = tl.minimum((start_n + window + 1) // BLOCK_M * BLOCK_M, hi)   # m1 - n0 <= w
    if HAS_KEEP:
        q_hi = q_lo
    return q_lo, tl.maximum(q_hi, q_lo)


@triton.jit
def _plain_scores(q, k, start_m, start_n, sizes, feats, offs_l, offs_d, DIVIDE: tl.constexpr):
    """Scores of a plain tile pair: the n_all levels it shares are all or nothing, so one product with k's
    features beyond FEAT[n_all] zeroed, divided by n_all (divide_by_levels)."""
    n_all = tl.sum((start_n // sizes == start_m // sizes).to(tl.int32), 0)        # padding (size 1) never equal
    r = tl.sum(tl.where(offs_l == n_all, feats, 0), 0)
    s = tl.dot(q, tl.trans(tl.where(offs_d[None, :] < r, k, 0.0).to(k.dtype)), input_precision=_F32_DOT)
    if DIVIDE:
        s = s / n_all.to(tl.float32)
    return s, n_all


@triton.jit
def _plain_grad(ds, x, n_all, feats, offs_l, offs_d, DIVIDE: tl.constexpr):
    """sum_b ds[a, b] x[b, :] of a plain tile pair: the features of its n_all shared levels only."""
    if DIVIDE:
        ds = ds / n_all.to(tl.float32)
    r = tl.sum(tl.where(offs_l == n_all, feats, 0), 0)
    return tl.dot(ds.to(x.dtype), tl.where(offs_d[None, :] < r, x, 0.0).to(x.dtype), input_precision=_F32_DOT)


@triton.jit
def _key_range(start_m, T, window, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the keys a query tile can see. Key tiles outside are skipped, not masked."""
    lo = tl.maximum(start_m - window, 0) // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, T)
    else:
        hi = tl.minimum(start_m + BLOCK_M + window, T)
    return lo, hi


@triton.jit
def _fwd_tiles(q, K, V, KEEP, SIZES, FEAT, sizes, feats, offs_l, m_i, l_i, acc, start_m, lo, hi, skip_lo, skip_hi,
               T, D, DV, window, N_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, DIVIDE: tl.constexpr,
               HAS_KEEP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The online softmax over the key tiles of [lo, hi) outside [skip_lo, skip_hi), plain (MASKED False) or
    masked: the masked tiles lie on both sides of the plain ones, and one loop over both compiles one copy of the
    masked code, not two."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(lo, hi - (skip_hi - skip_lo), BLOCK_N):         # [lo, hi) less [skip_lo, skip_hi)
        start_n = t + tl.where(t >= skip_lo, skip_hi - skip_lo, 0)
        k = _load_tile(K, start_n + tl.arange(0, BLOCK_N), offs_d, T, D)          # (BLOCK_N, BLOCK_D)
        if MASKED:
            s, _, _, _ = _tile_scores(q, k, KEEP, SIZES, FEAT, start_m, start_n, offs_d, T, window,
                                      N_LEVELS, CAUSAL, DIVIDE, HAS_KEEP, BLOCK_M, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = tl.where(m_new == float('-inf'), 0.0, m_new)  # a row that has seen no key keeps m = -inf
        else:
            s, _ = _plain_scores(q, k, start_m, start_n, sizes, feats, offs_l, offs_d, DIVIDE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = m_new
        p = tl.exp(s - m_shift[:, None])                        # (BLOCK_M, BLOCK_N)
        alpha = tl.exp(m_i - m_shift)                           # rescales what was summed so far
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V, start_n + tl.arange(0, BLOCK_N), offs_dv, T, DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=_F32_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attn_fwd(Q, K, V, KEEP, O, LSE, SIZES, FEAT, T, H, D, DV, window,
              N_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, DIVIDE: tl.constexpr, HAS_KEEP: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LEVELS_P2: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)                          # (batch, head); int64: B*H*T*d may pass 2^31
    Q, K, V, O = Q + bh * T * D, K + bh * T * D, V + bh * T * DV, O + bh * T * DV   # this head's rows
    LSE, KEEP = LSE + bh * T, KEEP + (bh // H) * T
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q, offs_m, offs_d, T, D)                     # (BLOCK_M, BLOCK_D), read once
    m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)       # running sum of exp(s - m_i) v
    offs_l, sizes, feats = _level_vectors(SIZES, FEAT, N_LEVELS, LEVELS_P2)
    lo, hi = _key_range(start_m, T, window, CAUSAL, BLOCK_M, BLOCK_N)
    p_lo, p_hi = _plain_keys(start_m, lo, hi, sizes, offs_l, window, N_LEVELS, HAS_KEEP, BLOCK_M, BLOCK_N)
    for stage in tl.static_range(2):                 # the plain tiles, then the masked ones on either side
        a, b, skip_a, skip_b = (p_lo, p_hi, p_hi, p_hi) if stage == 0 else (lo, hi, p_lo, p_hi)
        m_i, l_i, acc = _fwd_tiles(q, K, V, KEEP, SIZES, FEAT, sizes, feats, offs_l, m_i, l_i, acc, start_m, a, b,
                                   skip_a, skip_b, T, D, DV, window, N_LEVELS, CAUSAL, DIVIDE, HAS_KEEP, BLOCK_D,
                                   BLOCK_DV, BLOCK_M, BLOCK_N, stage > 0)
    # rows with no key at all (every key masked) output 0 and get lse = +inf, so the backward's p is 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float('inf'), m_i + tl.log(l_safe))
    _store_tile(O, offs_m, offs_dv, T, DV, acc / l_safe[:, None])
    tl.store(LSE + offs_m, lse, mask=offs_m < T)


@triton.jit
def _dkdv_tiles(Q, DO, LSE, DELTA, KEEP, SIZES, FEAT, sizes, feats, offs_l, k, v, dk, dv, start_n, lo, hi, skip_lo,
                skip_hi, T, D, DV, window, N_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, DIVIDE: tl.constexpr,
                HAS_KEEP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """dk, dv of the key tile from the query tiles of [lo, hi) outside [skip_lo, skip_hi), plain or masked."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(lo, hi - (skip_hi - skip_lo), BLOCK_M):         # [lo, hi) less [skip_lo, skip_hi)
        start_m = t + tl.where(t >= skip_lo, skip_hi - skip_lo, 0)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, offs_m, offs_d, T, D)  # (BLOCK_M, BLOCK_D)
        do = _load_tile(DO, offs_m, offs_dv, T, DV)  # (BLOCK_M, BLOCK_DV)
        lse = tl.load(LSE + offs_m, mask=offs_m < T, other=float('inf'))
        delta = tl.load(DELTA + offs_m, mask=offs_m < T, other=0.0)
        if MASKED:
            s, cover, n_all, n_any = _tile_scores(q, k, KEEP, SIZES, FEAT, start_m, start_n, offs_d, T, window,
                                                  N_LEVELS, CAUSAL, DIVIDE, HAS_KEEP, BLOCK_M, BLOCK_N)
        else:
            s, n_all = _plain_scores(q, k, start_m, start_n, sizes, feats, offs_l, offs_d, DIVIDE)
        p = tl.exp(s - lse[:, None])                                                    # (BLOCK_M, BLOCK_N)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=_F32_DOT)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=_F32_DOT) - delta[:, None])  # p (dp - rowsum(do o))
        if MASKED:
            if DIVIDE:
                ds = ds / cover
            dk += _feature_grad(tl.trans(ds), q, offs_n, offs_m, n_all, n_any, SIZES, FEAT, offs_d, N_LEVELS)
        else:
            dk += _plain_grad(tl.trans(ds), q, n_all, feats, offs_l, offs_d, DIVIDE)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, KEEP, DO, LSE, DELTA, DK, DVAL, SIZES, FEAT, T, H, D, DV, window,
                   N_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, DIVIDE: tl.constexpr, HAS_KEEP: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LEVELS_P2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv of one key tile: stream the query tiles that can see it, recompute p = exp(s - lse)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    Q, K, DK = Q + bh * T * D, K + bh * T * D, DK + bh * T * D                      # this head's rows
    V, DO, DVAL = V + bh * T * DV, DO + bh * T * DV, DVAL + bh * T * DV
    LSE, DELTA, KEEP = LSE + bh * T, DELTA + bh * T, KEEP + (bh // H) * T
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(K, offs_n, offs_d, T, D)  # (BLOCK_N, BLOCK_D)
    v = _load_tile(V, offs_n, offs_dv, T, DV)  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # queries that see these keys: i >= j (causal) or i >= j - w (bidirectional), and i <= j + w
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
    else:
        lo = tl.maximum(start_n - window, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N + window, T)
    offs_l, sizes, feats = _level_vectors(SIZES, FEAT, N_LEVELS, LEVELS_P2)
    q_lo, q_hi = _plain_queries(start_n, lo, hi, sizes, offs_l, window, N_LEVELS, HAS_KEEP, BLOCK_M, BLOCK_N)
    for stage in tl.static_range(2):                 # the plain tiles, then the masked ones on either side
        a, b, skip_a, skip_b = (q_lo, q_hi, q_hi, q_hi) if stage == 0 else (lo, hi, q_lo, q_hi)
        dk, dv = _dkdv_tiles(Q, DO, LSE, DELTA, KEEP, SIZES, FEAT, sizes, feats, offs_l, k, v, dk, dv, start_n, a, b,
                             skip_a, skip_b, T, D, DV, window, N_LEVELS, CAUSAL, DIVIDE, HAS_KEEP, BLOCK_D,
                             BLOCK_DV, BLOCK_M, BLOCK_N, stage > 0)
    _store_tile(DK, offs_n, offs_d, T, D, dk)
    _store_tile(DVAL, offs_n, offs_dv, T, DV, dv)


@triton.jit
def _dq_tiles(K, V, KEEP, SIZES, FEAT, sizes, feats, offs_l, q, do, lse, delta, dq, start_m, lo, hi, skip_lo, skip_hi,
              T, D, DV, window, N_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, DIVIDE: tl.constexpr,
              HAS_KEEP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """dq of the query tile from the key tiles of [lo, hi) outside [skip_lo, skip_hi), plain or masked."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(lo, hi - (skip_hi - skip_lo), BLOCK_N):         # [lo, hi) less [skip_lo, skip_hi)
        start_n = t + tl.where(t >= skip_lo, skip_hi - skip_lo, 0)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, offs_n, offs_d, T, D)  # (BLOCK_N, BLOCK_D)
        v = _load_tile(V, offs_n, offs_dv, T, DV)  # (BLOCK_N, BLOCK_DV)
        if MASKED:
            s, cover, n_all, n_any = _tile_scores(q, k, KEEP, SIZES, FEAT, start_m, start_n, offs_d, T, window,
                                                  N_LEVELS, CAUSAL, DIVIDE, HAS_KEEP, BLOCK_M, BLOCK_N)
        else:
            s, n_all = _plain_scores(q, k, start_m, start_n, sizes, feats, offs_l, offs_d, DIVIDE)
        ds = tl.exp(s - lse[:, None]) * (tl.dot(do, tl.trans(v), input_precision=_F32_DOT) - delta[:, None])
        if MASKED:
            if DIVIDE:
                ds = ds / cover
            dq += _feature_grad(ds, k, offs_m, offs_n, n_all, n_any, SIZES, FEAT, offs_d, N_LEVELS)
        else:
            dq += _plain_grad(ds, k, n_all, feats, offs_l, offs_d, DIVIDE)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, KEEP, DO, LSE, DELTA, DQ, SIZES, FEAT, T, H, D, DV, window,
                 N_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, DIVIDE: tl.constexpr, HAS_KEEP: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LEVELS_P2: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of one query tile: stream the key tiles it sees, as the forward does."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    Q, K, DQ = Q + bh * T * D, K + bh * T * D, DQ + bh * T * D                      # this head's rows
    V, DO = V + bh * T * DV, DO + bh * T * DV
    LSE, DELTA, KEEP = LSE + bh * T, DELTA + bh * T, KEEP + (bh // H) * T
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q, offs_m, offs_d, T, D)  # (BLOCK_M, BLOCK_D)
    do = _load_tile(DO, offs_m, offs_dv, T, DV)  # (BLOCK_M, BLOCK_DV)
    lse = tl.load(LSE + offs_m, mask=offs_m < T, other=float('inf'))
    delta = tl.load(DELTA + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_l, sizes, feats = _level_vectors(SIZES, FEAT, N_LEVELS, LEVELS_P2)
    lo, hi = _key_range(start_m, T, window, CAUSAL, BLOCK_M, BLOCK_N)
    p_lo, p_hi = _plain_keys(start_m, lo, hi, sizes, offs_l, window, N_LEVELS, HAS_KEEP, BLOCK_M, BLOCK_N)
    for stage in tl.static_range(2):                 # the plain tiles, then the masked ones on either side
        a, b, skip_a, skip_b = (p_lo, p_hi, p_hi, p_hi) if stage == 0 else (lo, hi, p_lo, p_hi)
        dq = _dq_tiles(K, V, KEEP, SIZES, FEAT, sizes, feats, offs_l, q, do, lse, delta, dq, start_m, a, b,
                       skip_a, skip_b, T, D, DV, window, N_LEVELS, CAUSAL, DIVIDE, HAS_KEEP, BLOCK_D, BLOCK_DV,
                       BLOCK_M, BLOCK_N, stage > 0)
    _store_tile(DQ, offs_m, offs_d, T, D, dq)


# -----------------------------------------------------------------------------
# launching the kernels: autograd.Function and the *_triton functions

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SMALL_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)             # tl.dot's smallest tile: the interpreter's (numpy is
_AUTOTUNED = {}                                           # slow enough) and the GPU self-test's (one compile)
AUTOTUNE = True   # False: every launch on a GPU takes _SMALL_CONFIG instead of the autotuner's tiles


def _interpreting():
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors, in numpy)."""
    return HAS_TRITON and type(_attn_fwd).__name__ == 'InterpretedFunction'


def _gpu_configs():
    """A small set (8 levels unroll in each kernel's masked loop: 37-65 s to compile and time them all on an H200
    machine): tile height and pipeline depth."""
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=64), num_warps=bm // 16, num_stages=st)
            for bm in (64, 128) for st in (2, 3)]


def _launch(kernel, block, *args, **consts):
    """One program per `block` (BLOCK_M or BLOCK_N) rows of each (batch, head): fixed small tiles under the
    interpreter or without AUTOTUNE; else the autotuner picks the tiles."""
    B, H, T, _ = args[0].shape                                   # args[0] is q
    grid = lambda META: (triton.cdiv(T, META[block]), B * H)
    if _interpreting() or not AUTOTUNE:
        return kernel[grid](*args, **consts, **_SMALL_CONFIG)
    if kernel not in _AUTOTUNED:
        key = ['T', 'D', 'DV', 'window', 'N_LEVELS', 'CAUSAL']
        _AUTOTUNED[kernel] = triton.autotune(_gpu_configs(), key=key)(kernel)
    return _AUTOTUNED[kernel][grid](*args, **consts)


def _pow2(n):
    return max(16, triton.next_power_of_2(n))


class _TritonAttention(torch.autograd.Function):
    """softmax over the kept tiles of MLR-level scores, times v. Levels: block sizes `sizes` (level 0 = T) and
    feature prefixes `feats` = [0, r_0, r_0 + r_1, ..., d]; SWA passes one level and its window, MLR window = T.
    q arrives with its scales applied; the *_triton functions check the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, sizes, feats, window, causal, divide_by_levels):
        ctx.dtype = q.dtype
        if _interpreting():  # the interpreter's tl.dot is numpy: keep it in float32
            q, k, v = q.float(), k.float(), v.float()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, d = q.shape
        levels = [torch.tensor(x, dtype=torch.int32, device=q.device) for x in (sizes, feats)]
        keep = q if key_mask is None else key_mask.to(torch.int8).contiguous()  # q: a pointer never read
        ctx.args = (*levels, T, H, d, v.shape[-1], window)        # the kernels' arguments after their tensors
        ctx.consts = dict(N_LEVELS=len(sizes), CAUSAL=bool(causal), DIVIDE=bool(divide_by_levels),
                          HAS_KEEP=key_mask is not None, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(v.shape[-1]),
                          LEVELS_P2=triton.next_power_of_2(len(sizes) + 1))
        o = torch.empty_like(v)
        lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)      # log-sum-exp of each row
        _launch(_attn_fwd, 'BLOCK_M', q, k, v, keep, o, lse, *ctx.args, **ctx.consts)
        ctx.save_for_backward(q, k, v, keep, o, lse)
        return o.to(ctx.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, keep, o, lse = ctx.saved_tensors
        do = do.to(q.dtype).contiguous()
        delta = (do.float() * o.float()).sum(-1)                             # (B, H, T) rowsum(do * o)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _launch(_attn_bwd_dkdv, 'BLOCK_N', q, k, v, keep, do, lse, delta, dk, dv, *ctx.args, **ctx.consts)
        _launch(_attn_bwd_dq, 'BLOCK_M', q, k, v, keep, do, lse, delta, dq, *ctx.args, **ctx.consts)
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None, None, None, None, None


def _check_triton(q, k, v, key_mask):
    _check_qkv(q, k, v)
    _check_key_mask(key_mask, q)
    if not HAS_TRITON:
        raise ValueError("the Triton kernels need triton (pip install triton); without it mlr_attention and "
                         "sliding_window_attention take the *_flash paths")
    if q.dtype not in _TRITON_DTYPES:
        raise ValueError(f"the Triton kernels take float16, bfloat16 or float32, got {q.dtype}")
    if not (q.is_cuda or _interpreting()):
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                         f"kernels, for CPU tensors), got a tensor on {q.device}")


def mlr_attention_triton(q, k, v, ranks, causal=True, level_sizes=None, scales=None, divide_by_levels=False,
                         key_mask=None):
    """MLR attention through the Triton kernels; same arguments and result as mlr_attention_torch."""
    _check_triton(q, k, v, key_mask)
    ranks, sizes, scales = _mlr_check(q, k, v, ranks, level_sizes, scales)
    feats = [sum(ranks[:l]) for l in range(len(ranks) + 1)]                 # [0, R_0, R_1, ..., d]
    return _TritonAttention.apply(q * _feature_scales(ranks, scales, q), k, v, key_mask, tuple(sizes), tuple(feats),
                                  q.shape[2], causal, divide_by_levels)


def sliding_window_attention_triton(q, k, v, window, causal=True, scale=None, key_mask=None):
    """SWA through the Triton kernels; same arguments and result as sliding_window_attention_torch."""
    _check_triton(q, k, v, key_mask)
    _check_window(window)
    T, d = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return _TritonAttention.apply(q * scale, k, v, key_mask, (T,), (0, d), min(window, T), causal, False)


# -----------------------------------------------------------------------------
# public functions: MLR and SWA take the path backend() names; linear attention has one path

USE_TRITON = True  # tests (or a user) may set False to force the flash paths on a GPU


def backend(x):
    """Which path the public functions take for tensors like x: 'triton' for CUDA tensors of a dtype the
    kernels take when triton imports, else 'flash' (always on CPU: Triton has no CPU backend)."""
    return 'triton' if USE_TRITON and HAS_TRITON and x.is_cuda and x.dtype in _TRITON_DTYPES else 'flash'


def mlr_attention(q, k, v, ranks, causal=True, level_sizes=None, scales=None, divide_by_levels=False,
                  key_mask=None):
    """MLR attention, q, k: (B, H, T, d), v: (B, H, T, dv) -> (B, H, T, dv). ranks sum to d; level l has
    blocks of T/2^l tokens (or level_sizes[l]); scales c_l default 1/r_l; key_mask (B, T) bool, True = keep.
    Runs mlr_attention_triton or mlr_attention_flash, as backend(q) says."""
    _check_qkv(q, k, v)
    _check_key_mask(key_mask, q)
    fn = mlr_attention_triton if backend(q) == 'triton' else mlr_attention_flash
    return fn(q, k, v, ranks, causal, level_sizes, scales, divide_by_levels, key_mask)


def sliding_window_attention(q, k, v, window, causal=True, scale=None, key_mask=None):
    """SWA, q, k: (B, H, T, d), v: (B, H, T, dv) -> (B, H, T, dv): query i sees keys i-w..i
    (|i-j| <= w when bidirectional); scale defaults to 1/sqrt(d); key_mask (B, T) bool, True = keep.
    Runs sliding_window_attention_triton or sliding_window_attention_flash, as backend(q) says."""
    _check_qkv(q, k, v)
    _check_key_mask(key_mask, q)
    fn = sliding_window_attention_triton if backend(q) == 'triton' else sliding_window_attention_flash
    return fn(q, k, v, window, causal, scale, key_mask)


def linear_attention(q, k, v, causal=True, eps=1e-6, key_mask=None, rotate=None):
    """Linear attention with phi = ReLU^2 (seed 003 §2.2.2): o_t = q'_t S_t / (q'_t.z_t + eps). One path
    on every device: linear_attention_torch."""
    return linear_attention_torch(q, k, v, causal, eps, key_mask, rotate=rotate)


# -----------------------------------------------------------------------------
# self-checks: the default correctness check, the Triton kernels under the interpreter and compiled, and
# the accuracy of the fast paths in low precision

def _correctness_check():
    """`python kernels.py`'s first step: each public function against its dense reference, float64, both
    causal and bidirectional, printing the largest difference."""
    print("correctness (float64, B=2, H=2, T=96, d=16):")
    q, k, v = (torch.randn(2, 2, 96, 16, dtype=torch.float64) for _ in range(3))
    for causal in (True, False):
        for name, fast, ref, kw in [
            ('mlr 8|4|2|2', mlr_attention, mlr_attention_reference, dict(ranks=[8, 4, 2, 2])),
            ('swa w=20', sliding_window_attention, sliding_window_attention_reference, dict(window=20)),
            ('linear', linear_attention, linear_attention_reference, {}),
        ]:
            err = (fast(q, k, v, causal=causal, **kw) - ref(q, k, v, causal=causal, **kw)).abs().max().item()
            print(f"  {name:12s} causal={causal!s:5s} max|fast - reference| = {err:.2e}")
    print()


def _out_and_grads(fn, q, k, v, do, dtype, **kw):
    """fn's output and the gradients of q, k, v for output gradient do, computed in dtype, returned in float64."""
    x = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*x, **kw)
    out.backward(do.to(dtype))
    return [out.double()] + [t.grad.double() for t in x]


def _selftest_cases(device):
    """The Triton kernels vs the dense references (float64), forward and gradients, in float32 at tiny shapes
    (the interpreter is slow): tiles smaller than, equal to and unaligned with the MLR blocks, windows below,
    above and past the tile, T not a multiple of the tile, key masks that leave queries no key, plain tiles
    sharing 1 or 2 levels, query tiles taller than key tiles (as the GPU's 128 × 64). On CPU under the
    interpreter; on a GPU compiled, with these small tiles (no autotuning: the tiles that straddle most block
    boundaries)."""
    torch.manual_seed(0)
    mask = torch.ones(2, 40, dtype=torch.bool, device=device)
    mask[0, 4:12] = mask[1, 20:] = False  # causal: MLR queries 4..11 see keys 0..3 only, SWA w=3 queries 7..11 none
    mlr = (mlr_attention_triton, mlr_attention_reference)
    swa = (sliding_window_attention_triton, sliding_window_attention_reference)
    cases = [  # name, (triton, reference), (B, H, T, d, dv), kwargs, (BLOCK_M, BLOCK_N)
        ('mlr 8|4|2|2, blocks 40,20,10,5, divide_by_levels, key_mask', mlr, (1, 1, 40, 16, 24),
         dict(ranks=[8, 4, 2, 2], level_sizes=[40, 20, 10, 5], divide_by_levels=True, key_mask=mask[:1]), (16, 16)),
        ('mlr 24|8, d=32, blocks 32,16 (= tile)', mlr, (1, 1, 32, 32, 32), dict(ranks=[24, 8]), (16, 16)),
        ('mlr 8|4|2|2, blocks 128,64,8,4, divide_by_levels', mlr, (1, 1, 128, 16, 16),
         dict(ranks=[8, 4, 2, 2], level_sizes=[128, 64, 8, 4], divide_by_levels=True), (32, 16)),
        ('mlr 8|4|2|2, blocks 80,40,20,10 (unaligned)', mlr, (1, 1, 80, 16, 16),
         dict(ranks=[8, 4, 2, 2], level_sizes=[80, 40, 20, 10], divide_by_levels=True), (32, 16)),
        ('swa w=3, key_mask, B=H=2, dv=24', swa, (2, 2, 24, 16, 24), dict(window=3, key_mask=mask[:, :24]),
         (16, 16)),
        ('swa w=17 > tile', swa, (1, 1, 40, 16, 16), dict(window=17), (16, 16)),
        ('swa w=40, plain tiles inside the window', swa, (1, 1, 80, 16, 16), dict(window=40), (32, 16)),
        ('swa w=99 > T', swa, (1, 1, 20, 16, 16), dict(window=99), (16, 16)),
    ]
    failed = 0
    for name, (fast, ref), (B, H, T, d, dv), kw, (block_m, block_n) in cases:
        _SMALL_CONFIG.update(BLOCK_M=block_m, BLOCK_N=block_n)
        for causal in (True, False):
            q, k, v = (torch.randn(B, H, T, n, dtype=torch.float64, device=device) for n in (d, d, dv))
            grad = torch.randn(B, H, T, dv, dtype=torch.float64, device=device)
            t0 = time.process_time()
            results = [_out_and_grads(fn, q, k, v, grad, dtype, causal=causal, **kw)
                       for fn, dtype in ((fast, torch.float32), (ref, torch.float64))]
            errs = [(a - b).abs().max().item() for a, b in zip(*results)]
            ok = all(e < 1e-4 for e in errs)                # NaN fails too
            failed += not ok
            print(f"  {name:48s} causal={causal!s:5s} max err o {errs[0]:.1e} dq {errs[1]:.1e} dk {errs[2]:.1e} "
                  f"dv {errs[3]:.1e} {'ok' if ok else 'FAIL'} ({time.process_time() - t0:.1f} s cpu)", flush=True)
    print(f"Triton self-test on {device}: {2 * len(cases) - failed}/{2 * len(cases)} cases match the references")
    return failed == 0


def _selftest_triton(device='cpu'):
    """_selftest_cases without autotuning (AUTOTUNE and the small tiles restored after)."""
    global AUTOTUNE
    tuned, AUTOTUNE, small = AUTOTUNE, False, dict(_SMALL_CONFIG)
    try:
        return _selftest_cases(device)
    finally:
        AUTOTUNE = tuned
        _SMALL_CONFIG.update(small)


def _compile_check(archs=(80, 90), levels=(8, 1)):
    """Compile every kernel for real GPUs (bf16, 64×64 tiles; 8 levels = the paper's MLR with divide_by_levels,
    1 = SWA) without running it: this catches what the interpreter lets through (tile shapes, dtypes, control
    flow). Needs no GPU, only triton's bundled ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    types = dict(KEEP='*i8', LSE='*fp32', DELTA='*fp32', SIZES='*i32', FEAT='*i32', T='i32', H='i32', D='i32',
                 DV='i32', window='i32')                          # the rest are bf16 tensors
    for arch, n_levels, kernel in itertools.product(archs, levels, (_attn_fwd, _attn_bwd_dkdv, _attn_bwd_dq)):
        consts = dict(N_LEVELS=n_levels, CAUSAL=True, DIVIDE=n_levels > 1, HAS_KEEP=True, BLOCK_D=64, BLOCK_DV=64,
                      LEVELS_P2=triton.next_power_of_2(n_levels + 1), BLOCK_M=64, BLOCK_N=64)
        sig = {a: 'constexpr' if a in consts else types.get(a, '*bf16') for a in kernel.arg_names}
        t0 = time.perf_counter()
        triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget('cuda', arch, 32),
                       options=dict(num_warps=4, num_stages=2))
        print(f"  compiled {kernel.__name__:15s} with {n_levels} level(s) for sm_{arch} "
              f"in {time.perf_counter() - t0:.1f} s")


def accuracy(device, dtypes, T=512, BH=4, ranks=(32, 8, 6, 4, 4, 4, 4, 2), window=127):
    """FlashAttention's test of a low-precision kernel: its error against the float64 reference must be at
    most 2x the error of the reference itself computed in that precision (+ 1e-5, below which float32 errors
    are rounding at these sizes). Forward and all gradients."""
    g = torch.Generator(device='cpu').manual_seed(0)
    q, k, v, do = (torch.randn(1, BH, T, sum(ranks), generator=g, dtype=torch.float64).to(device) for _ in range(4))
    checks = [('mlr_flash', mlr_attention_flash, mlr_attention_reference, list(ranks)),
              ('swa_flash', sliding_window_attention_flash, sliding_window_attention_reference, window)]
    if device == 'cuda' and HAS_TRITON:
        checks += [('mlr_triton', mlr_attention_triton, mlr_attention_reference, list(ranks)),
                   ('swa_triton', sliding_window_attention_triton, sliding_window_attention_reference, window)]
    ok = True
    for name, fn, ref, arg in checks:
        run = lambda f, dtype: _out_and_grads(lambda q, k, v: f(q, k, v, arg), q, k, v, do, dtype)
        exact = run(ref, torch.float64)
        for dtype in dtypes:
            ref_err, err = ([(a - b).abs().max().item() for a, b in zip(run(f, dtype), exact)] for f in (ref, fn))
            good = all(e <= 2 * r + 1e-5 for e, r in zip(err, ref_err))  # 1e-5: float32 rounding, not an error
            ok &= good
            print(f"  {name:11s} {str(dtype):15s} max err out/dq/dk/dv " + ' '.join(f'{e:.1e}' for e in err)
                  + "  (reference in this dtype: " + ' '.join(f'{r:.1e}' for r in ref_err)
                  + f")  {'ok' if good else 'FAIL: more than 2x the reference error'}")
    return ok


# -----------------------------------------------------------------------------
# benchmark: every path against SDPA, forward + backward: time, peak memory, GFLOP/s

def _proc_kb(key):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def measure(step, reps=2):
    """Wall time (ms, best of reps) and peak memory (MB) of step(). On a GPU the peak is CUDA's allocator
    peak; on Linux CPUs it is the growth of peak RSS, after resetting the peak via /proc/self/clear_refs."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # hand freed heap memory back to the OS first, so that RSS is the memory in use
        import ctypes
        import gc
        gc.collect()
        ctypes.CDLL('libc.so.6').malloc_trim(0)
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        base = _proc_kb('VmRSS') * 1024
    step()
    sync()
    peak = (torch.cuda.max_memory_allocated() if cuda else _proc_kb('VmHWM') * 1024) - base
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times), peak / 2 ** 20


def matmul_gflops(device, dtype, n=4096, reps=3):
    """The machine's practical limit: GFLOP/s of one large n×n matrix product, measured now."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms, _ = measure(lambda: a @ b, reps)
    return 2 * n ** 3 / ms / 1e6


def _bench_cores(device, dtype, ranks, window=127):
    """The attention cores the benchmark compares: name -> (fn(q, k, v), forward FLOPs of one head at T)."""
    d, equal = sum(ranks), [sum(ranks) // 8] * 8
    causal_flops = lambda T: 2 * (T * (T + 1) // 2) * 2 * d           # the causal half of QKᵀ and A·V
    mlr = lambda f, r: (lambda q, k, v: f(q, k, v, r), lambda T: mlr_attention_flops(T, r))
    swa = lambda f: (lambda q, k, v: f(q, k, v, window), lambda T: sliding_window_attention_flops(T, window, d))
    cores = dict(sdpa=(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), causal_flops),
                 mlr_flash=mlr(mlr_attention_flash, ranks), mlr_flash_eq=mlr(mlr_attention_flash, equal),
                 mlr_torch=mlr(mlr_attention_torch, ranks),
                 mlr_dense=(lambda q, k, v: mlr_attention_reference(q, k, v, ranks), lambda T: 2 * T * T * 2 * d),
                 swa_flash=swa(sliding_window_attention_flash), swa_torch=swa(sliding_window_attention_torch),
                 linear=(linear_attention, lambda T: linear_attention_flops(T, d)))
    if device == 'cuda' and HAS_TRITON and dtype in _TRITON_DTYPES:
        cores.update(mlr_triton=mlr(mlr_attention_triton, ranks), swa_triton=swa(sliding_window_attention_triton))
    if device == 'cuda':
        try:  # FlexAttention, where this torch has it (it compiles its kernel on first use)
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            return cores
        flex = torch.compile(flex_attention)

        def flex_masked(keep):                        # keep(b, h, i, j): may query i see key j
            masks = {}

            def run(q, k, v):
                T = q.shape[2]
                if T not in masks:
                    masks[T] = create_block_mask(keep, None, None, T, T, device=device)
                return flex(q, k, v, block_mask=masks[T])
            return run
        cores['flex_causal'] = (flex_masked(lambda b, h, i, j: j <= i), causal_flops)
        cores['flex_swa'] = (flex_masked(lambda b, h, i, j: (j <= i) & (i - j <= window)),
                            lambda T: sliding_window_attention_flops(T, window, d))
    return cores


def benchmark(device, dtype, Ts, reps, BH=16, ranks=(32, 8, 6, 4, 4, 4, 4, 2), dense_max_T=2048, only=()):
    """Forward + backward of each core on (1, BH, T, 64) causal inputs: wall time and peak memory, both also as
    ratios to SDPA in this process, and GFLOP/s, also as a share of a large matrix product's (the limit).
    GFLOP is each core's count (3 x the forward: backward = 2 x forward), not what a path recomputes; SWA's is
    its blocked path's, ~2x the w + 1 keys a query needs at T = 1024 (sliding_window_attention_flops).
    only: the cores to run besides SDPA (default: all)."""
    ranks = list(ranks)
    peak = matmul_gflops(device, dtype)
    cores = {n: c for n, c in _bench_cores(device, dtype, ranks).items() if not only or n == 'sdpa' or n in only}
    print(f"attention cores on {device} ({dtype}), forward+backward, causal, B*H = {BH}, d = {sum(ranks)}, "
          f"MLR ranks {'|'.join(map(str, ranks))} (mlr_flash_eq: 8 equal levels), SWA window 127 (128 keys); "
          f"{torch.get_num_threads()} thread(s); {peak:.0f} GFLOP/s for a 4096² matmul here")
    print(f"{'core':13s} {'T':>5s} {'ms':>9s} {'x sdpa':>7s} {'x floor':>7s} {'peak MB':>8s} {'x sdpa':>7s} "
          f"{'GFLOP/s':>8s} {'% mm':>5s}   (floor: the core's FLOPs at SDPA's FLOP/s measured here)")
    rows = []
    for T in Ts:
        q, k, v = (torch.randn(1, BH, T, sum(ranks), device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        base = None
        for name, (fn, flops) in cores.items():
            if name in ('mlr_dense', 'mlr_torch') and T > dense_max_T:
                continue                                  # they keep T×T scores for autograd
            ms, mb = measure(lambda: fn(q, k, v).sum().backward(), reps)
            q.grad = k.grad = v.grad = None
            base = base or (ms, mb)
            floor = base[0] * flops(T) / cores['sdpa'][1](T)          # ms at SDPA's FLOP/s: the distance to the limit
            r = dict(core=name, T=T, ms=ms, ms_vs_sdpa=ms / base[0], ms_vs_floor=ms / floor, peak_mb=mb,
                     mb_vs_sdpa=mb / max(base[1], 1e-9), gflops=3 * BH * flops(T) / ms / 1e6, matmul_gflops=peak)
            print(f"{name:13s} {T:5d} {ms:9.1f} {r['ms_vs_sdpa']:7.2f} {r['ms_vs_floor']:7.2f} {mb:8.1f} "
                  f"{r['mb_vs_sdpa']:7.2f} {r['gflops']:8.1f} {100 * r['gflops'] / peak:5.0f}", flush=True)
            rows.append(r)
    return rows


# -----------------------------------------------------------------------------
# command line: python kernels.py [--bench | --selftest-interpret | --compile-check]

def _parser():
    from runs import ArgParser        # one-line errors, as the train scripts'
    p = ArgParser(prog='kernels.py', description=__doc__)
    g = p.add_argument_group('what to run (default: correctness check, then --bench)')
    g.add_argument('--bench', action='store_true', help='only the benchmark of every core, then the accuracy check')
    g.add_argument('--selftest-interpret', action='store_true',
                   help='the Triton kernels vs the references under TRITON_INTERPRET=1 on CPU (tiny shapes), then exit')
    g.add_argument('--compile-check', action='store_true',
                   help='compile the Triton kernels for sm_80 and sm_90 (no GPU needed, nothing runs), then exit')
    g = p.add_argument_group('benchmark')
    g.add_argument('--Ts', type=str, default='',
                   help='sequence lengths, multiples of 128 (default: 1024,2048,4096 on CPU, up to 8192 on a GPU)')
    g.add_argument('--cores', type=str, default='', help='comma list of the cores to time besides SDPA (default: all)')
    g.add_argument('--reps', type=int, default=2, help='timed repetitions (the best is kept) after one untimed run')
    g.add_argument('--dtype', type=str, default='auto', choices=['auto', 'float32', 'bfloat16'],
                   help='auto: float32 on CPU; bfloat16 and float32 on a GPU')
    g.add_argument('--device', type=str, default='auto', choices=['auto', 'cuda', 'cpu'],
                   help='auto = cuda if available, else cpu')
    g.add_argument('--threads', type=int, default=0, help='CPU threads for torch (0 = torch\'s default)')
    g.add_argument('--seed', type=int, default=0, help='random seed')
    g.add_argument('--out_dir', type=str, default='', help='also write the rows to OUT_DIR/kernels_bench.json')
    return p


def _checked_flags(p, args):
    """Every flag checked before any work: device, sequence lengths, dtypes and cores; p.error otherwise."""
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed {args.seed}: must be in [0, 2^63)")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: must be at least 1")
    if not 0 <= args.threads <= 4 * (os.cpu_count() or 1):      # 100000 OpenMP threads crash the process
        p.error(f"--threads {args.threads}: must be in [0, {4 * (os.cpu_count() or 1)}] (0 = torch's default)")
    if args.out_dir:                                               # checked before the benchmark, not after it
        from runs import check_writable
        try:
            check_writable(os.path.join(args.out_dir, 'kernels_bench.json'), '--out_dir')
        except OSError as e:
            sys.exit(f"kernels.py: error: {e}")                  # an I/O problem: one line, exit 1
    device = ('cuda' if torch.cuda.is_available() else 'cpu') if args.device == 'auto' else args.device
    if device == 'cuda' and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    try:
        Ts = [int(t) for t in (args.Ts or ('1024,2048,4096' if device == 'cpu' else '1024,2048,4096,8192')).split(',')
              if t.strip()]
    except ValueError:
        Ts = []
    if not Ts or any(T <= 0 or T % 128 for T in Ts):
        p.error(f"--Ts {args.Ts!r}: give a comma list of positive multiples of 128 (8 MLR levels halve T 7 times), "
                f"e.g. 1024,2048")
    dtypes = {'float32': [torch.float32], 'bfloat16': [torch.bfloat16]}.get(
        args.dtype, [torch.float32] if device == 'cpu' else [torch.bfloat16, torch.float32])
    only = [c for c in args.cores.split(',') if c.strip()]
    known = _bench_cores(device, dtypes[0], [8] * 8)
    if any(c not in known for c in only):
        p.error(f"--cores {args.cores!r}: the cores on {device} are {','.join(known)}")
    return device, Ts, dtypes, only


def main(argv=None):
    """Checks the flags, then runs one of: the interpreter self-test, the compile check, or (default) the
    correctness check (on a GPU also the compiled Triton self-test), the benchmark and the accuracy check.
    Exits 1 when a self-test or the accuracy check fails (the correctness check prints its differences)."""
    p = _parser()
    args = p.parse_args(argv)
    device, Ts, dtypes, only = _checked_flags(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.selftest_interpret:
        if not HAS_TRITON:
            sys.exit("triton is not installed: there are no Triton kernels to check")
        if not _interpreting():  # the variable must be set before triton defines the kernels: start over
            env = dict(os.environ, TRITON_INTERPRET='1')
            sys.exit(subprocess.run([sys.executable, __file__, '--selftest-interpret'], env=env).returncode)
        torch.set_num_threads(1)
        sys.exit(0 if _selftest_triton() else 1)
    if args.compile_check:
        if not HAS_TRITON or _interpreting():
            sys.exit("--compile-check needs triton and TRITON_INTERPRET unset")
        _compile_check()
        sys.exit(0)

    ok = True
    if not args.bench:
        _correctness_check()
        if device == 'cuda' and HAS_TRITON:
            print("the Triton kernels compiled, against the references (float32 against float64):")
            ok = _selftest_triton('cuda')
    if device == 'cpu':
        print("no GPU here: the flash and torch paths only (`--selftest-interpret` checks the Triton kernels on CPU)")
    rows = [row for dtype in dtypes for row in benchmark(device, dtype, Ts, args.reps, only=only)]
    BH = 16 if device == 'cuda' else 4   # as the benchmark: Triton specializes on H % 16, H = 4 would compile anew
    print(f"\naccuracy against the float64 reference (T = 512, B*H = {BH}, the paper's ranks, SWA window 127):")
    ok &= accuracy(device, dtypes if device == 'cuda' else [torch.float32, torch.bfloat16], BH=BH)
    if args.out_dir:
        from runs import write_json
        path = os.path.join(args.out_dir, 'kernels_bench.json')
        write_json(path, dict(device=torch.cuda.get_device_name() if device == 'cuda' else 'cpu', rows=rows))
        print(f"rows written to {path}")
    sys.exit(0 if ok else 1)


if __name__ == '__main__':
    main()
