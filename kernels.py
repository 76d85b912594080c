"""
The heavy math of the attention variants, on (B, H, T, d) tensors.

    mlr_attention             MLR attention (SPEC §4): a pair of tokens whose deepest shared block is at
                              level l is scored with the first r_0 + ... + r_l features only.
    sliding_window_attention  query i attends keys i-w < j <= i (SPEC §5), O(T·w) time and memory.
    linear_attention          causal linear attention with phi(u) = ReLU(u)^2 (SPEC §6).

Each public function has a `*_reference` twin that builds the dense T×T mask and is short enough to read;
the tests hold the two equal (forward and gradients). The fast paths here are plain torch:

- MLR is computed as a hierarchy of tiles. For a block at level l with children at level l+1, the pairs
  (query in child a, key in child a' != a) share level l but not l+1, so they are scored with the first
  R_l = r_0 + ... + r_l features; the diagonal blocks of the finest level use all d features. Every tile
  yields a partial softmax (output, log-sum-exp), merged exactly like FlashAttention merges its tiles.
  With causal masking the tiles above the diagonal are never computed. Nothing T×T is ever formed.
- SWA cuts the queries into blocks of c >= w and gives each block only the 2c (3c bidirectional) keys
  around it.
- Linear attention is chunked: quadratic inside a chunk, a running d×d state between chunks.

Run `python kernels.py` for a correctness check and a small benchmark of the torch paths.
"""

import math

import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# helpers

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


def mlr_block_sizes(T, n_levels, block_sizes=None):
    """Block size of each level, as used on a sequence of length T. Default T / 2^l. An explicit list must
    strictly decrease, each size dividing the one before; sizes >= T make their level global (the model
    fixes its blocks from block_size, so a shorter sequence simply has more global levels), and T must be
    a multiple of every size below it. Returns the sizes clipped to T."""
    if n_levels < 1:
        raise ValueError(f"MLR needs at least one level, got {n_levels}")
    if block_sizes is None:
        finest = 2 ** (n_levels - 1)
        if T % finest != 0:
            raise ValueError(f"MLR with {n_levels} levels halves the sequence {n_levels - 1} times, so T must "
                             f"be divisible by {finest}; got T = {T} (valid: multiples of {finest})")
        return [T // 2 ** l for l in range(n_levels)]
    sizes = [int(b) for b in block_sizes]
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
                         f"valid T are multiples of {max(bad)} up to {sizes[0]}")
    return [min(b, T) for b in sizes]


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


# -----------------------------------------------------------------------------
# MLR attention (SPEC §4)

def _mlr_check(q, ranks, block_sizes):
    _check_qkv(q, q, q[..., :1])
    ranks = [int(r) for r in ranks]
    if any(r <= 0 for r in ranks):
        raise ValueError(f"every MLR rank must be positive, got {ranks}")
    if sum(ranks) != q.shape[-1]:
        raise ValueError(f"MLR ranks {'|'.join(map(str, ranks))} sum to {sum(ranks)} but the head width is "
                         f"{q.shape[-1]}; the rank allocation must sum to the head width")
    return ranks, mlr_block_sizes(q.shape[2], len(ranks), block_sizes)


def mlr_level_scales(ranks):
    """Default per-level logit scale c_l = 1 / r_l (the paper's reference code)."""
    return [1.0 / r for r in ranks]


def _scale_levels(q, ranks, scales):
    """q with the features of level l multiplied by c_l, so that a prefix dot product is the MLR score."""
    c = torch.cat([torch.full((r,), float(s), dtype=q.dtype, device=q.device) for r, s in zip(ranks, scales)])
    return q * c


def mlr_attention_reference(q, k, v, ranks, causal=True, block_sizes=None, scales=None,
                            divide_by_levels=False, key_mask=None):
    """Dense reference: score(i, j) = sum_l 1[block_l(i) = block_l(j)] c_l q_l(i).k_l(j), masked, softmax."""
    ranks, sizes = _mlr_check(q, ranks, block_sizes)
    scales = mlr_level_scales(ranks) if scales is None else scales
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


def mlr_attention_torch(q, k, v, ranks, causal=True, block_sizes=None, scales=None,
                        divide_by_levels=False, key_mask=None):
    """Structured MLR attention: tiles per level with prefix features, partial softmaxes merged exactly."""
    ranks, sizes = _mlr_check(q, ranks, block_sizes)
    scales = mlr_level_scales(ranks) if scales is None else scales
    B, H, T, d = q.shape
    dv = v.shape[-1]
    L = len(ranks)
    q = _scale_levels(q, ranks, scales)
    prefix = [sum(ranks[:l + 1]) for l in range(L)]  # R_l
    outs, lses = [], []
    neg = torch.finfo(q.dtype).min

    # sibling tiles of each level l < L-1: pairs in the same level-l block but different level-(l+1) blocks
    for l in range(L - 1):
        c, b = sizes[l] // sizes[l + 1], sizes[l + 1]    # children per block, child size
        if c == 1:
            continue                                     # a global level above another global level
        n = T // sizes[l]                                # blocks at level l
        R = prefix[l]
        Q = q[..., :R].reshape(B, H, n, c, b, R)         # (B, H, n, c, b, R)
        K = k[..., :R].reshape(B, H, n, c, b, R)
        V = v.reshape(B, H, n, c, b, dv)
        km = None if key_mask is None else key_mask.reshape(B, 1, n, c, 1, b)
        if causal and c == 2:
            # only the second child sees the first; the first child has no past sibling at this level
            s = Q[:, :, :, 1] @ K[:, :, :, 0].transpose(-2, -1)  # (B, H, n, b, b)
            if divide_by_levels:
                s = s / (l + 1)
            if km is not None:
                s = s.masked_fill(~km[:, :, :, 0], neg)
            o1, lse1 = _partial_attention(s, V[:, :, :, 0])     # (B, H, n, b, dv), (B, H, n, b, 1)
            o = torch.stack([torch.zeros_like(o1), o1], dim=3)   # (B, H, n, 2, b, dv)
            lse = torch.stack([torch.full_like(lse1, -1e30), lse1], dim=3)
        else:
            # child a sees every other child a' (a' < a only, when causal: those tiles are masked whole)
            other = torch.tensor([[j for j in range(c) if j != a] for a in range(c)], device=q.device)  # (c, c-1)
            Ko = K[:, :, :, other].reshape(B, H, n, c, (c - 1) * b, R)   # (B, H, n, c, (c-1)b, R)
            Vo = V[:, :, :, other].reshape(B, H, n, c, (c - 1) * b, dv)
            s = Q @ Ko.transpose(-2, -1)                                 # (B, H, n, c, b, (c-1)b)
            if divide_by_levels:
                s = s / (l + 1)
            if causal:
                future = (other > torch.arange(c, device=q.device)[:, None])          # (c, c-1)
                s = s.masked_fill(future.repeat_interleave(b, dim=1)[:, None, :], neg)
            if km is not None:
                kmo = km[:, :, :, other].reshape(B, 1, n, c, 1, (c - 1) * b)
                s = s.masked_fill(~kmo, neg)
            o, lse = _partial_attention(s, Vo)
        outs.append(o.reshape(B, H, T, dv))
        lses.append(lse.reshape(B, H, T, 1))

    # diagonal blocks of the finest level: all d features, causal mask inside the block
    b = sizes[-1]
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
    outs.append(o.reshape(B, H, T, dv))
    lses.append(lse.reshape(B, H, T, 1))
    return _merge_partials(outs, lses)


def mlr_attention_flops(T, ranks, causal=True, block_sizes=None, dv=None):
    """Multiply-adds x 2 of mlr_attention_torch on one (batch, head): scores plus A·V."""
    sizes = mlr_block_sizes(T, len(ranks), block_sizes)
    dv = sum(ranks) if dv is None else dv
    qk = av = 0
    for l in range(len(ranks) - 1):
        c, b = sizes[l] // sizes[l + 1], sizes[l + 1]
        pairs = T * (c - 1) * b
        if causal and c == 2:
            pairs //= 2
        qk += pairs * sum(ranks[:l + 1])
        av += pairs * dv
    qk += T * sizes[-1] * sum(ranks)
    av += T * sizes[-1] * dv
    return 2 * (qk + av)


def mlr_attention(q, k, v, ranks, causal=True, block_sizes=None, scales=None, divide_by_levels=False,
                  key_mask=None):
    """MLR attention, q, k: (B, H, T, d), v: (B, H, T, dv) -> (B, H, T, dv). ranks sum to d; level l has
    blocks of size T/2^l (or block_sizes[l]); scales c_l default 1/r_l; key_mask (B, T) bool, True = keep."""
    return mlr_attention_torch(q, k, v, ranks, causal, block_sizes, scales, divide_by_levels, key_mask)


# -----------------------------------------------------------------------------
# sliding-window attention (SPEC §5)

def _check_window(window):
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive integer (number of keys each query sees), got {window!r}")


def _window_allowed(i, j, window, causal):
    """Which (query i, key j) pairs a window-w attention keeps: i-w < j <= i, or |i-j| < w bidirectional."""
    return (j <= i) & (j > i - window) if causal else (j - i).abs() < window


def sliding_window_attention_reference(q, k, v, window, causal=True, scale=None, key_mask=None):
    _check_qkv(q, k, v)
    _check_window(window)
    T = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    pos = torch.arange(T, device=q.device)
    keep = _window_allowed(pos[:, None], pos[None, :], window, causal)      # (T, T)
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~keep, float('-inf'))
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float('-inf'))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def sliding_window_attention_torch(q, k, v, window, causal=True, scale=None, key_mask=None):
    """Blocked SWA: queries in blocks of c >= w; block i sees key blocks i-1, i (and i+1 bidirectional)."""
    _check_qkv(q, k, v)
    _check_window(window)
    B, H, T, d = q.shape
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    c = min(max(window, 32), T)                      # query block size; c >= w unless the window covers T
    n = -(-T // c)                                   # number of query blocks
    Tp = n * c
    left, right = c, (0 if causal else c)            # key padding on each side
    valid = torch.zeros(B, left + Tp + right, dtype=torch.bool, device=q.device)
    valid[:, left:left + T] = True if key_mask is None else key_mask
    qp = F.pad(q, (0, 0, 0, Tp - T)).reshape(B, H, n, c, d)                  # (B, H, n, c, d)
    kp = F.pad(k, (0, 0, left, Tp - T + right))                              # (B, H, left+Tp+right, d)
    vp = F.pad(v, (0, 0, left, Tp - T + right))
    span = left + c + right                                                  # keys per query block
    kw = kp.unfold(2, span, c).transpose(-2, -1)                             # (B, H, n, span, d)
    vw = vp.unfold(2, span, c).transpose(-2, -1)                             # (B, H, n, span, dv)
    validw = valid.unfold(1, span, c)                                        # (B, n, span)
    s = (qp @ kw.transpose(-2, -1)) * scale                                  # (B, H, n, c, span)
    i = torch.arange(c, device=q.device)[:, None] + left                     # query position in the window
    j = torch.arange(span, device=q.device)[None, :]
    keep = _window_allowed(i, j, window, causal)[None, None, None] & validw[:, None, :, None, :]
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    o, _ = _partial_attention(s, vw)                                         # (B, H, n, c, dv)
    return o.reshape(B, H, Tp, dv)[:, :, :T]


def sliding_window_attention_flops(T, window, d, causal=True, dv=None):
    """Multiply-adds x 2 of sliding_window_attention_torch on one (batch, head)."""
    dv = d if dv is None else dv
    c = min(max(window, 32), T)
    n = -(-T // c)
    span = c + c + (0 if causal else c)
    return 2 * n * c * span * (d + dv)


def sliding_window_attention(q, k, v, window, causal=True, scale=None, key_mask=None):
    """SWA, q, k: (B, H, T, d), v: (B, H, T, dv) -> (B, H, T, dv): query i sees keys i-w < j <= i
    (|i-j| < w when bidirectional); scale defaults to 1/sqrt(d); key_mask (B, T) bool, True = keep."""
    return sliding_window_attention_torch(q, k, v, window, causal, scale, key_mask)


# -----------------------------------------------------------------------------
# causal linear attention (SPEC §6)

def linear_feature_map(u):
    """phi(u / sqrt(d)) with phi = ReLU(.)^2, applied to queries and keys."""
    return F.relu(u / math.sqrt(u.shape[-1])) ** 2


def linear_attention_reference(q, k, v, causal=True, eps=1e-6, key_mask=None):
    _check_qkv(q, k, v)
    qf, kf = linear_feature_map(q), linear_feature_map(k)
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
    a = qf @ kf.transpose(-2, -1)                                            # (B, H, T, T)
    if causal:
        a = a.tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def linear_attention_torch(q, k, v, causal=True, eps=1e-6, key_mask=None, chunk=64):
    """Chunked parallel form: within a chunk the masked quadratic form, across chunks the running state
    S = sum_j k'_j v_j^T (d × dv) and z = sum_j k'_j."""
    _check_qkv(q, k, v)
    qf, kf = linear_feature_map(q), linear_feature_map(k)
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
    if not causal:
        S = kf.transpose(-2, -1) @ v                                         # (B, H, d, dv)
        z = kf.sum(dim=2, keepdim=True)                                      # (B, H, 1, d)
        return (qf @ S) / ((qf * z).sum(-1, keepdim=True) + eps)
    B, H, T, d = q.shape
    dv = v.shape[-1]
    n = -(-T // chunk)
    pad = n * chunk - T
    qc = F.pad(qf, (0, 0, 0, pad)).reshape(B, H, n, chunk, d)                # (B, H, n, c, d)
    kc = F.pad(kf, (0, 0, 0, pad)).reshape(B, H, n, chunk, d)
    vc = F.pad(v, (0, 0, 0, pad)).reshape(B, H, n, chunk, dv)
    a = (qc @ kc.transpose(-2, -1)).tril()                                   # (B, H, n, c, c) intra-chunk
    kv = kc.transpose(-2, -1) @ vc                                           # (B, H, n, d, dv) per chunk
    S = kv.cumsum(dim=2) - kv                                                # state before each chunk
    z = kc.sum(dim=3).cumsum(dim=2) - kc.sum(dim=3)                          # (B, H, n, d)
    num = a @ vc + qc @ S                                                    # (B, H, n, c, dv)
    den = a.sum(-1) + (qc * z[:, :, :, None, :]).sum(-1)                     # (B, H, n, c)
    o = num / (den[..., None] + eps)
    return o.reshape(B, H, n * chunk, dv)[:, :, :T]


def linear_attention_flops(T, d, causal=True, dv=None, chunk=64):
    dv = d if dv is None else dv
    if not causal:
        return 2 * T * d * (2 * dv + 1)
    return 2 * T * (chunk * (d + dv) + 2 * d * dv)


def linear_attention(q, k, v, causal=True, eps=1e-6, key_mask=None):
    """Linear attention with phi = ReLU^2 (SPEC §6): o_t = q'_t S_t / (q'_t.z_t + eps)."""
    return linear_attention_torch(q, k, v, causal, eps, key_mask)


# -----------------------------------------------------------------------------
# self-check and benchmark

if __name__ == '__main__':
    import time
    torch.manual_seed(0)
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
    print("\nbenchmark, torch path on", 'cuda' if torch.cuda.is_available() else 'cpu (no GPU here)',
          "- forward+backward, B*H=16, d=64, causal, float32")
    print(f"{'T':>6s} {'dense-mask ms':>14s} {'mlr ms':>8s} {'ratio':>6s} {'mlr GFLOP':>10s}")
    ranks = [32, 8, 6, 4, 4, 4, 4, 2]
    for T in (512, 1024, 2048):
        q, k, v = (torch.randn(1, 16, T, 64, requires_grad=True) for _ in range(3))
        times = []
        for fn in (mlr_attention_reference, mlr_attention):
            fn(q, k, v, ranks).sum().backward()
            t0 = time.perf_counter()
            fn(q, k, v, ranks).sum().backward()
            times.append(1e3 * (time.perf_counter() - t0))
        gflop = 16 * mlr_attention_flops(T, ranks) / 1e9
        print(f"{T:6d} {times[0]:14.1f} {times[1]:8.1f} {times[1] / times[0]:6.2f} {gflop:10.2f}")
