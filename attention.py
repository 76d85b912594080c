"""
Every attention variant of the project, and the one transformer backbone all train scripts share.

    standard      softmax attention, any number of heads, GQA and RoPE options (SPEC §1)
    bilinear_mlr  score = sum_l c_l LN(q_l).LN(k_l) with block-diagonal level maps (SPEC §3)
    bilinear_btt  score = c x^T LN(W_h x') with W_h a full-rank BTT per head (SPEC §3)
    mlr           MLR attention: fewer features for distant pairs (SPEC §4)
    swa           sliding-window attention (SPEC §5); `global_swa` mixes it with standard layers
    linear        causal linear attention, phi = ReLU^2 (SPEC §6)
    brl           BRL attention: local attention + evolving compressed tokens (SPEC §7)

Each variant maps (B, T, D) -> (B, T, D), causal or bidirectional, reports its forward FLOPs for a
length-T sequence, and (causal ones) decodes token by token with a cache. The heavy math lives in
kernels.py. The backbone is pre-LN: x + attn(LN(x)), x + MLP(LN(x)), no biases, muP init (SPEC §9).

    python attention.py            # attention cores: fwd+bwd time and peak memory vs SDPA, T = 512 ... 4096
    python attention.py --layers   # one full layer of every variant, projections included
    python attention.py --brl      # BRL vs full and local attention, n = 1k ... 16k (seed 004 Figs. 5-6)
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import structured


# -----------------------------------------------------------------------------
# config

@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_hidden: int = 0            # MLP hidden width (0 = 4 * n_embd)
    block_size: int = 256          # longest sequence; MLR fixes its level blocks from it
    causal: bool = True
    attn: str = 'standard'         # a name in ATTENTION, or 'global_swa'
    layer_pattern: str = ''        # optional comma list of per-layer variants, overrides attn
    global_layers: str = '0,3'     # global_swa: 0-based layers with standard attention (the paper's 1 and 4)
    # scores
    qk_ln: bool = False
    logit_scale: str = 'sqrt'      # 'sqrt': 1/sqrt(d); 'mup': mup_alpha/d
    mup_alpha: float = 8.0
    n_kv_head: int = 0             # standard: grouped-query attention (0 = n_head)
    rope: bool = False             # standard / swa: rotary position embedding
    # MLR and bilinear MLR
    ranks: str = ''                # rank allocation "32|8|6|4|4|4|4|2", sums to the head width
    mlr_block_sizes: str = ''      # optional "1024|256|64": level block sizes (default block_size/2^l)
    mlr_divide_levels: bool = False
    # bilinear BTT
    btt_rank: int = 1
    # SWA and BRL
    window: int = 64
    n_compressed: int = 16         # BRL: m compressed tokens
    brl_block: int = 0             # BRL causal block size (0 = window)
    brl_beta: float = 0.5
    brl_lambda_init: float = 0.5
    brl_gamma: bool = True         # False fixes gamma = 0 (no differential compression)
    # muP
    mup_base_width: int = 128      # lr multiplier of a weight = mup_base_width / fan_in

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def layer_kinds(self):
        if self.layer_pattern:
            kinds = [s.strip() for s in self.layer_pattern.split(',')]
        elif self.attn == 'global_swa':
            glob = parse_ints(self.global_layers, 'global_layers', sep=',')
            bad = [g for g in glob if not 0 <= g < self.n_layer]
            if bad:
                raise ValueError(f"global_layers {bad} out of range for n_layer = {self.n_layer} (0-based)")
            kinds = ['standard' if i in glob else 'swa' for i in range(self.n_layer)]
        else:
            kinds = [self.attn] * self.n_layer
        if len(kinds) != self.n_layer:
            raise ValueError(f"layer_pattern names {len(kinds)} layers but n_layer = {self.n_layer}")
        for k in kinds:
            if k not in ATTENTION:
                raise ValueError(f"unknown attention {k!r}; valid: {', '.join(ATTENTION)} or global_swa")
        if 'brl' in kinds and set(kinds) != {'brl'}:
            raise ValueError(f"brl carries compressed tokens through every layer; it cannot be mixed: {kinds}")
        return kinds


def parse_ints(text, name, sep='|'):
    try:
        return [int(s) for s in str(text).split(sep) if s.strip()]
    except ValueError:
        raise ValueError(f"{name} must be integers separated by '{sep}', got {text!r}") from None


def check_config(cfg):
    if cfg.n_embd <= 0 or cfg.n_head <= 0 or cfg.n_embd % cfg.n_head != 0:
        raise ValueError(f"n_head = {cfg.n_head} must divide n_embd = {cfg.n_embd}")
    if cfg.logit_scale not in ('sqrt', 'mup'):
        raise ValueError(f"logit_scale must be 'sqrt' or 'mup', got {cfg.logit_scale!r}")
    if cfg.window <= 0:
        raise ValueError(f"window must be a positive number of keys, got {cfg.window}")
    if cfg.mlp_hidden < 0:
        raise ValueError(f"mlp_hidden must be >= 0 (0 = 4 * n_embd), got {cfg.mlp_hidden}")
    return cfg.layer_kinds()


# -----------------------------------------------------------------------------
# muP building blocks

class MupLinear(nn.Linear):
    """Linear map without bias, init N(0, 1/fan_in) (or zeros for output maps), lr multiplier
    base_width / fan_in (SPEC §9)."""

    def __init__(self, fan_in, fan_out, base_width=128, zero_init=False):
        super().__init__(fan_in, fan_out, bias=False)
        if zero_init:
            nn.init.zeros_(self.weight)
        else:
            nn.init.normal_(self.weight, std=fan_in ** -0.5)
        self.weight.lr_mult = base_width / fan_in


def optimizer_groups(model, lr, weight_decay):
    """AdamW parameter groups: lr * p.lr_mult (muP), weight decay only on matrices."""
    groups = {}
    for p in model.parameters():
        if p.requires_grad:
            key = (getattr(p, 'lr_mult', 1.0), p.dim() >= 2)
            groups.setdefault(key, []).append(p)
    return [{'params': ps, 'lr': lr * mult, 'lr_mult': mult, 'weight_decay': weight_decay if decay else 0.0}
            for (mult, decay), ps in groups.items()]


def rope(x, pos):
    """Rotary embedding on (B, H, T, d) at integer positions pos (T,), half-split convention."""
    d = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) / (d // 2))
    ang = pos.float()[:, None] * freq[None, :]                       # (T, d/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Cache:
    """Per-layer decoding state; each variant keeps what it needs in its attributes."""

    def __init__(self):
        self.t = 0          # number of tokens seen so far


def _append(old, new, keep=None):
    out = new if old is None else torch.cat([old, new], dim=2)
    return out if keep is None else out[:, :, -keep:]


# -----------------------------------------------------------------------------
# attention variants on per-head q, k, v

class SelfAttention(nn.Module):
    """Shared q, k, v projections (B, T, D) -> (B, H, T, d) and the zero-init output map. A variant
    defines attend() (whole sequence) and decode() (one token with a cache)."""
    uses_rope = False

    def __init__(self, cfg):
        super().__init__()
        D, H, d = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.cfg, self.H, self.d = cfg, H, d
        self.n_kv = cfg.n_kv_head or H
        if H % self.n_kv:
            raise ValueError(f"n_kv_head = {self.n_kv} must divide n_head = {H}")
        if self.n_kv != H and type(self) is not StandardAttention:
            raise ValueError("grouped-query attention (n_kv_head) is only implemented for standard attention")
        if cfg.rope and not self.uses_rope:
            raise ValueError(f"rope is only implemented for standard and swa attention, not {type(self).__name__}")
        w = cfg.mup_base_width
        self.q_proj = MupLinear(D, H * d, w)
        self.k_proj = MupLinear(D, self.n_kv * d, w)
        self.v_proj = MupLinear(D, self.n_kv * d, w)
        self.o_proj = MupLinear(H * d, D, w, zero_init=True)
        self.q_ln = nn.LayerNorm(d, bias=False) if cfg.qk_ln else nn.Identity()
        self.k_ln = nn.LayerNorm(d, bias=False) if cfg.qk_ln else nn.Identity()

    def forward(self, x, key_mask=None, cache=None):
        B, T, _ = x.shape
        q = self.q_ln(self.q_proj(x).view(B, T, self.H, self.d)).transpose(1, 2)      # (B, H, T, d)
        k = self.k_ln(self.k_proj(x).view(B, T, self.n_kv, self.d)).transpose(1, 2)   # (B, Hkv, T, d)
        v = self.v_proj(x).view(B, T, self.n_kv, self.d).transpose(1, 2)
        t0 = 0 if cache is None else cache.t
        if self.cfg.rope:
            pos = torch.arange(t0, t0 + T, device=x.device)
            q, k = rope(q, pos), rope(k, pos)
        if cache is None:
            y = self.attend(q, k, v, key_mask)
        else:
            if T != 1:
                raise ValueError(f"decoding with a cache takes one token at a time, got T = {T}")
            y = self.decode(q, k, v, cache)
            cache.t += 1
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.d))

    def scale(self):
        return self.cfg.mup_alpha / self.d if self.cfg.logit_scale == 'mup' else 1 / math.sqrt(self.d)

    def new_cache(self):
        return Cache()

    def cache_numel(self, cache):
        """Numbers in the key cache of one batch element (standard and swa keep whole keys)."""
        return cache.k[0].numel()

    def flops(self, T):
        D = self.cfg.n_embd
        return 2 * T * D * self.d * (2 * self.H + 2 * self.n_kv) + self.core_flops(T)


class StandardAttention(SelfAttention):
    """Softmax attention (SDPA); the scoring matrix W_Q W_K^T of each head has rank d (SPEC §1)."""
    uses_rope = True

    def attend(self, q, k, v, key_mask):
        mask = None if key_mask is None else key_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.cfg.causal and mask is None,
                                              scale=self.scale(), enable_gqa=self.n_kv != self.H)

    def decode(self, q, k, v, cache):
        cache.k, cache.v = _append(getattr(cache, 'k', None), k), _append(getattr(cache, 'v', None), v)
        return F.scaled_dot_product_attention(q, cache.k, cache.v, scale=self.scale(),
                                              enable_gqa=self.n_kv != self.H)

    def core_flops(self, T):
        return 2 * self.H * T * T * 2 * self.d * (0.5 if self.cfg.causal else 1)


class SWAAttention(SelfAttention):
    """Sliding-window attention: query i sees the w keys i-w < j <= i, at O(T w) cost (SPEC §5)."""
    uses_rope = True

    def attend(self, q, k, v, key_mask):
        return kernels.sliding_window_attention(q, k, v, self.cfg.window, self.cfg.causal, self.scale(), key_mask)

    def decode(self, q, k, v, cache):
        w = self.cfg.window
        cache.k, cache.v = _append(getattr(cache, 'k', None), k, w), _append(getattr(cache, 'v', None), v, w)
        return F.scaled_dot_product_attention(q, cache.k, cache.v, scale=self.scale())

    def core_flops(self, T):
        return self.H * kernels.sliding_window_attention_flops(T, self.cfg.window, self.d, self.cfg.causal)


class MLRAttention(SelfAttention):
    """MLR attention (SPEC §4). Level l cuts positions into blocks of size block_size/2^l (fixed by the
    model, so a shorter causal sequence just has more global levels); a pair sharing a level-l block adds
    c_l q_l.k_l with c_l = 1/r_l."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.ranks = parse_ints(cfg.ranks or str(self.d), 'ranks')
        if any(r <= 0 for r in self.ranks) or sum(self.ranks) != self.d:
            raise ValueError(f"MLR ranks {cfg.ranks!r} must be positive and sum to the head width "
                             f"{self.d} (n_embd {cfg.n_embd} / n_head {cfg.n_head}), e.g. "
                             f"'{self.d // 2}|{self.d - self.d // 2}'")
        L = len(self.ranks)
        if cfg.mlr_block_sizes:
            self.block_sizes = parse_ints(cfg.mlr_block_sizes, 'mlr_block_sizes')
        else:
            if cfg.block_size % 2 ** (L - 1):
                raise ValueError(f"MLR with {L} levels needs block_size divisible by {2 ** (L - 1)}, "
                                 f"got {cfg.block_size}")
            self.block_sizes = [cfg.block_size // 2 ** l for l in range(L)]
        kernels.mlr_block_sizes(self.block_sizes[0], L, self.block_sizes)   # validates the list
        self.scales = kernels.mlr_level_scales(self.ranks)

    def attend(self, q, k, v, key_mask):
        T = q.shape[2]
        Tp = self.valid_length(T)
        if Tp != T:  # causal: padding on the right changes nothing before it
            q, k, v = (F.pad(t, (0, 0, 0, Tp - T)) for t in (q, k, v))
        y = kernels.mlr_attention(q, k, v, self.ranks, self.cfg.causal, self.block_sizes, self.scales,
                                  self.cfg.mlr_divide_levels, key_mask)
        return y[:, :, :T]

    def valid_length(self, T):
        """Shortest length >= T that tiles into the level blocks (T itself when bidirectional)."""
        for Tp in range(T, self.block_sizes[0] + 1):
            if all(b >= Tp or Tp % b == 0 for b in self.block_sizes):
                if Tp != T and not self.cfg.causal:
                    break
                return Tp
        raise ValueError(f"sequence length {T} does not tile into the MLR blocks {self.block_sizes}; valid: "
                         f"multiples of {min(self.block_sizes)} up to {self.block_sizes[0]}")

    def decode(self, q, k, v, cache):
        """Level l keeps only the r_l key features of the current level-l block (SPEC §4)."""
        t = cache.t
        if t >= self.block_sizes[0]:
            raise ValueError(f"MLR decoding is defined up to block_size = {self.block_sizes[0]} tokens")
        if t == 0:
            cache.keys, cache.v = [None] * len(self.ranks), None
        cache.v = _append(cache.v, v)                                          # (B, H, t+1, d)
        s = torch.zeros(q.shape[:3] + (t + 1,), dtype=q.dtype, device=q.device)
        covering = torch.zeros(t + 1, dtype=q.dtype, device=q.device)
        for l, (q_l, k_l, b, c) in enumerate(zip(q.split(self.ranks, -1), k.split(self.ranks, -1),
                                                  self.block_sizes, self.scales)):
            if t % b == 0:
                cache.keys[l] = None                                           # a new level-l block begins
            cache.keys[l] = _append(cache.keys[l], k_l)                        # (B, H, t % b + 1, r_l)
            start = t - t % b
            s[..., start:] += c * (q_l @ cache.keys[l].transpose(-2, -1))
            covering[start:] += 1
        if self.cfg.mlr_divide_levels:
            s = s / covering
        return torch.softmax(s, dim=-1) @ cache.v

    def cache_numel(self, cache):
        return sum(k_l[0].numel() for k_l in cache.keys)

    def core_flops(self, T):
        sizes = [min(b, T) for b in self.block_sizes]
        return self.H * kernels.mlr_attention_flops(T, self.ranks, self.cfg.causal, sizes, self.d)


class LinearAttention(SelfAttention):
    """Linear attention with phi = ReLU^2 (SPEC §6); decoding keeps the d x d state S and the vector z."""

    def attend(self, q, k, v, key_mask):
        return kernels.linear_attention(q, k, v, self.cfg.causal, key_mask=key_mask)

    def decode(self, q, k, v, cache):
        qf, kf = kernels.linear_feature_map(q), kernels.linear_feature_map(k)   # (B, H, 1, d)
        if cache.t == 0:
            cache.S, cache.z = 0, 0
        cache.S = cache.S + kf.transpose(-2, -1) @ v                            # (B, H, d, d)
        cache.z = cache.z + kf                                                  # (B, H, 1, d)
        return (qf @ cache.S) / ((qf * cache.z).sum(-1, keepdim=True) + 1e-6)

    def cache_numel(self, cache):
        return cache.S[0].numel() + cache.z[0].numel()

    def core_flops(self, T):
        return self.H * kernels.linear_attention_flops(T, self.d, self.cfg.causal)


class BilinearAttention(SelfAttention):
    """Common part of the bilinear variants: per-head (query features, key features) of width e replace
    q and k, values and outputs stay standard; one batched product, W_h never formed (SPEC §3)."""

    def forward(self, x, key_mask=None, cache=None):
        if cache is not None:
            raise ValueError(f"{type(self).__name__} has no decoding cache; run the full forward")
        B, T, _ = x.shape
        qf, kf = self.features(x)                                            # (B, H, T, e)
        v = self.v_proj(x).view(B, T, self.H, self.d).transpose(1, 2)        # (B, H, T, d)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(qf, kf, v, attn_mask=mask, scale=1.0,
                                           is_causal=self.cfg.causal and mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.d))

    def flops(self, T):
        D, e = self.cfg.n_embd, self.feature_width
        scores = 2 * self.H * T * T * (e + self.d) * (0.5 if self.cfg.causal else 1)
        return 2 * T * D * self.d * 2 * self.H + self.feature_flops(T) + scores


class BilinearMLRAttention(BilinearAttention):
    """W_h = sum_l blockdiag_{p_l}(L_{l,k} R_{l,k}^T): the level-l query of x is x cut into p_l = 2^l chunks,
    chunk k mapped by L_{l,k} (D/p_l -> r_l); score = sum_l c_l LN(q_l).LN(k_l), c_l = 1/sqrt(p_l r_l)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        del self.q_proj, self.k_proj, self.q_ln, self.k_ln
        D, H = cfg.n_embd, self.H
        self.ranks = parse_ints(cfg.ranks or str(self.d), 'ranks')
        if any(r <= 0 for r in self.ranks):
            raise ValueError(f"bilinear MLR ranks must be positive, got {cfg.ranks!r}")
        self.blocks = [2 ** l for l in range(len(self.ranks))]
        if D % self.blocks[-1]:
            raise ValueError(f"bilinear MLR with {len(self.ranks)} levels cuts n_embd = {D} into "
                             f"{self.blocks[-1]} chunks; use fewer levels or a width divisible by it")
        w = cfg.mup_base_width
        self.q_maps = nn.ModuleList(structured.BlockDiagonal(D, p * H * r, p, base_width=w)
                                    for p, r in zip(self.blocks, self.ranks))
        self.k_maps = nn.ModuleList(structured.BlockDiagonal(D, p * H * r, p, base_width=w)
                                    for p, r in zip(self.blocks, self.ranks))
        self.lns = nn.ModuleList(nn.LayerNorm(p * r, bias=False) for p, r in zip(self.blocks, self.ranks))
        self.feature_width = sum(p * r for p, r in zip(self.blocks, self.ranks))
        a = cfg.mup_alpha
        self.level_scales = [a / (p * r) if cfg.logit_scale == 'mup' else (p * r) ** -0.5
                             for p, r in zip(self.blocks, self.ranks)]

    def features(self, x):
        B, T, _ = x.shape
        qs, ks = [], []
        for qm, km, ln, p, r, c in zip(self.q_maps, self.k_maps, self.lns, self.blocks, self.ranks,
                                       self.level_scales):
            # block-diagonal output is laid out (chunk, head, r); each head wants (chunk, r)
            ql = qm(x).view(B, T, p, self.H, r).transpose(2, 3).reshape(B, T, self.H, p * r)
            kl = km(x).view(B, T, p, self.H, r).transpose(2, 3).reshape(B, T, self.H, p * r)
            qs.append(c * ln(ql))
            ks.append(ln(kl))
        return torch.cat(qs, -1).transpose(1, 2), torch.cat(ks, -1).transpose(1, 2)   # (B, H, T, sum p_l r_l)

    def feature_flops(self, T):
        return 2 * 2 * T * sum(m.flops for m in self.q_maps)


class BilinearBTTAttention(BilinearAttention):
    """W_h a D x D BTT (full rank D) per head: score = c x^T LN(W_h x'), c = 1/sqrt(D) or alpha/D."""

    def __init__(self, cfg):
        super().__init__(cfg)
        del self.q_proj, self.k_proj, self.q_ln, self.k_ln
        D = cfg.n_embd
        self.btts = nn.ModuleList(structured.BTT(D, D, rank=cfg.btt_rank, base_width=cfg.mup_base_width)
                                  for _ in range(self.H))
        self.ln = nn.LayerNorm(D, bias=False)
        self.feature_width = D
        self.c = cfg.mup_alpha / D if cfg.logit_scale == 'mup' else D ** -0.5

    def features(self, x):
        B, T, D = x.shape
        kf = torch.stack([self.ln(btt(x)) for btt in self.btts], dim=1)       # (B, H, T, D)
        return (self.c * x)[:, None].expand(B, self.H, T, D), kf

    def feature_flops(self, T):
        return 2 * T * sum(b.flops for b in self.btts)


# -----------------------------------------------------------------------------
# BRL attention (seed 004, SPEC §7, Algorithm 1)

class BRLAttention(nn.Module):
    """F_BRL: local attention F_gen plus F_prop(x, F_comp(x_ct, x_hist)). Works on blocks of tokens, each
    with its own compressed tokens: one block (the whole sequence) when bidirectional, blocks of
    brl_block tokens when causal, where block b compresses the tokens of block b-1 (none for block 0)."""

    def __init__(self, cfg):
        super().__init__()
        D, H, m, w = cfg.n_embd, cfg.n_head, cfg.n_compressed, cfg.mup_base_width
        if m < 1:
            raise ValueError(f"n_compressed (m) must be >= 1, got {m}")
        if cfg.brl_block < 0:
            raise ValueError(f"brl_block must be >= 0 (0 = window), got {cfg.brl_block}")
        self.cfg, self.H, self.m = cfg, H, m
        self.local = SWAAttention(cfg)                                        # F_gen
        # F_comp: differential cross-attention from x_ct to the history
        self.f_q, self.f_k1, self.f_k2, self.f_v = (MupLinear(D, D, w) for _ in range(4))
        self.comp_norm = nn.GroupNorm(H, D)                                   # per-head normalization
        self.gamma_q, self.gamma_k1, self.gamma_k2 = (nn.Parameter(0.1 * torch.randn(D // H)) for _ in range(3))
        self.f_m = MupLinear(D, D, w)
        self.ct_ln = nn.LayerNorm(D, bias=False)
        # F_prop: cross-attention from the tokens to the updated compressed tokens, scaled by lambda per head
        self.f_phi, self.f_pk, self.f_pv = (MupLinear(D, D, w) for _ in range(3))
        self.lam = nn.Parameter(torch.full((H,), float(cfg.brl_lambda_init)))
        self.prop_ln = nn.LayerNorm(D, bias=False)

    def gamma(self):
        if not self.cfg.brl_gamma:
            return torch.zeros((), device=self.lam.device)
        return torch.exp(self.gamma_q @ self.gamma_k1) - torch.exp(self.gamma_q @ self.gamma_k2)

    def heads(self, t):
        return t.unflatten(-1, (self.H, -1)).transpose(-3, -2)                # (..., n, D) -> (..., H, n, D/H)

    def compress(self, x_ct, hist, hist_mask=None):
        """F_comp then the beta update. x_ct (B, N, m, D), hist (B, N, n, D) or None -> new x_ct (B, N, m, D)."""
        if hist is None:
            comp = x_ct
        else:
            q, k1, k2, v = self.heads(self.f_q(x_ct)), self.heads(self.f_k1(hist)), \
                self.heads(self.f_k2(hist)), self.heads(self.f_v(hist))      # (B, N, H, ., D/H)
            scale = 1.0 / (self.m * math.sqrt(x_ct.shape[-1]))
            mask = None if hist_mask is None else hist_mask[:, :, None, None, :]
            s1 = F.scaled_dot_product_attention(q, k1, v, attn_mask=mask, scale=scale)
            s2 = F.scaled_dot_product_attention(q, k2, v, attn_mask=mask, scale=scale)
            comp = (s1 - self.gamma() * s2).transpose(-3, -2).flatten(-2)    # (B, N, m, D)
            comp = self.comp_norm(comp.flatten(0, 2)).view_as(comp)
        beta = self.cfg.brl_beta
        return (1 - beta) * self.ct_ln(comp) + beta * self.f_m(x_ct)

    def propagate(self, x, x_ct):
        """F_prop: x (B, N, n, D) attends the m compressed tokens of its block, x_ct (B, N, m, D)."""
        q, k, v = self.heads(self.f_phi(x)), self.heads(self.f_pk(x_ct)), self.heads(self.f_pv(x_ct))
        o = F.scaled_dot_product_attention(q, k, v) * self.lam[:, None, None]  # (B, N, H, n, D/H)
        return F.relu(self.prop_ln(o.transpose(-3, -2).flatten(-2)))

    def block_size(self, T):
        if not self.cfg.causal:
            return T
        return self.cfg.brl_block or self.cfg.window

    def forward(self, x, x_ct, key_mask=None):
        """x (B, T, D) (already layer-normed), x_ct (B, N, m, D) -> (F_gen + F_prop (B, T, D), new x_ct)."""
        B, T, D = x.shape
        y = self.local(x, key_mask)
        nb = self.block_size(T)
        N = -(-T // nb)
        xb = F.pad(x, (0, 0, 0, N * nb - T)).view(B, N, nb, D)              # (B, N, nb, D)
        if self.cfg.causal:    # block b compresses block b-1; block 0 has no history
            new_ct = self.compress(x_ct[:, 1:], xb[:, :-1]) if N > 1 else x_ct[:, :0]
            new_ct = torch.cat([self.compress(x_ct[:, :1], None), new_ct], dim=1)
        else:
            new_ct = self.compress(x_ct, xb, None if key_mask is None else key_mask[:, None])
        y = y + self.propagate(xb, new_ct).view(B, N * nb, D)[:, :T]
        return y, new_ct

    def decode(self, x, x_ct, cache):
        """One token x (B, 1, D); at a block boundary, compress the finished block (consistent with training)."""
        t, nb = cache.t, self.block_size(None)
        if t % nb == 0:
            hist = None if t == 0 else cache.block
            cache.ct = self.compress(x_ct, hist)
            cache.block = None
        cache.block = x[:, None] if cache.block is None else torch.cat([cache.block, x[:, None]], dim=2)
        y = self.local(x, cache=cache.local) + self.propagate(x[:, None], cache.ct)[:, 0]
        cache.t += 1
        return y, cache.ct

    def new_cache(self):
        cache = Cache()
        cache.local = self.local.new_cache()
        return cache

    def cache_numel(self, cache):
        return self.local.cache_numel(cache.local) + cache.ct[0].numel()

    def flops(self, T):
        D, m = self.cfg.n_embd, self.m
        comp = 2 * T * D * D * 3 + 2 * 2 * 2 * m * T * D   # K1, K2, V of the history; two score maps + AV
        upd = 2 * (-(-T // self.block_size(T))) * m * D * D * 4   # f_q, f_m, f_pk, f_pv per block
        prop = 2 * T * D * D + 2 * 2 * T * m * D
        return self.local.flops(T) + comp + upd + prop


ATTENTION = {
    'standard': StandardAttention,
    'mlr': MLRAttention,
    'swa': SWAAttention,
    'linear': LinearAttention,
    'bilinear_mlr': BilinearMLRAttention,
    'bilinear_btt': BilinearBTTAttention,
    'brl': BRLAttention,
}


# -----------------------------------------------------------------------------
# the backbone

class MLP(nn.Module):
    def __init__(self, D, hidden, base_width):
        super().__init__()
        self.up = MupLinear(D, hidden, base_width)
        self.down = MupLinear(hidden, D, base_width, zero_init=True)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LN block; the compressed-token stream x_ct passes through untouched."""

    def __init__(self, cfg, kind):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd, bias=False), nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = ATTENTION[kind](cfg)
        self.mlp = MLP(cfg.n_embd, cfg.mlp_hidden or 4 * cfg.n_embd, cfg.mup_base_width)

    def forward(self, x, x_ct, key_mask=None, cache=None):
        x = x + self.attn(self.ln1(x), key_mask, cache)
        return x + self.mlp(self.ln2(x)), x_ct

    def flops(self, T):
        return self.attn.flops(T) + 2 * T * self.mlp.up.weight.numel() * 2


class BRLBlock(Block):
    """Algorithm 1 BRL_BLOCK: x <- x + F_gen + F_prop, x_ct <- x_ct + update, each stream its own FFN."""

    def __init__(self, cfg, kind):
        super().__init__(cfg, kind)
        self.ln_ct1, self.ln_ct2 = nn.LayerNorm(cfg.n_embd, bias=False), nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp_ct = MLP(cfg.n_embd, cfg.mlp_hidden or 4 * cfg.n_embd, cfg.mup_base_width)

    def forward(self, x, x_ct, key_mask=None, cache=None):
        if cache is None:
            y, upd = self.attn(self.ln1(x), self.ln_ct1(x_ct), key_mask)
        else:
            y, upd = self.attn.decode(self.ln1(x), self.ln_ct1(x_ct), cache)
        x, x_ct = x + y, x_ct + upd
        return x + self.mlp(self.ln2(x)), x_ct + self.mlp_ct(self.ln_ct2(x_ct))

    def flops(self, T):
        N = -(-T // self.attn.block_size(T))
        return super().flops(T) + 2 * N * self.attn.m * self.mlp_ct.up.weight.numel() * 2


class Transformer(nn.Module):
    """The stack of blocks and a final LayerNorm: (B, T, D) -> (B, T, D). Embeddings and heads belong to
    the train scripts. With BRL it also carries the learned compressed tokens (m x D, init N(0, 1))."""

    def __init__(self, cfg):
        super().__init__()
        kinds = check_config(cfg)
        self.cfg = cfg
        self.blocks = nn.ModuleList((BRLBlock if k == 'brl' else Block)(cfg, k) for k in kinds)
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.compressed_tokens = nn.Parameter(torch.randn(cfg.n_compressed, cfg.n_embd)) if 'brl' in kinds else None

    def forward(self, x, key_mask=None, cache=None):
        B, T, D = x.shape
        if D != self.cfg.n_embd:
            raise ValueError(f"input width {D} != n_embd {self.cfg.n_embd}")
        if cache is None and T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        if key_mask is not None and (self.cfg.causal or key_mask.shape != (B, T)):
            raise ValueError(f"key_mask must be a (B, T) = {(B, T)} bool mask and is for bidirectional models; "
                             f"got {tuple(key_mask.shape)} with causal = {self.cfg.causal}")
        x_ct = None
        if self.compressed_tokens is not None:
            N = 1 if (cache is not None or not self.cfg.causal) else -(-T // self.blocks[0].attn.block_size(T))
            x_ct = self.compressed_tokens.expand(B, N, -1, -1)                # (B, N, m, D)
        for i, block in enumerate(self.blocks):
            x, x_ct = block(x, x_ct, key_mask, None if cache is None else cache[i])
        return self.ln_f(x)

    def new_cache(self):
        if not self.cfg.causal:
            raise ValueError("incremental decoding needs a causal model")
        for b in self.blocks:
            if isinstance(b.attn, BilinearAttention):
                raise ValueError(f"{type(b.attn).__name__} has no decoding cache")
        return [b.attn.new_cache() for b in self.blocks]

    def key_cache_numel(self, cache):
        """Numbers held in the key caches (keys, or linear attention's state), per batch element."""
        return sum(b.attn.cache_numel(c) for b, c in zip(self.blocks, cache))

    def forward_flops(self, T):
        return int(sum(b.flops(T) for b in self.blocks))


# -----------------------------------------------------------------------------
# benchmark: python attention.py

def _proc_kb(key):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def measure(step, reps=2):
    """Wall time (ms, best of reps) and peak memory (MB) of step(). On a GPU the peak is CUDA's allocator
    peak; on Linux CPUs it is the growth of peak RSS, after resetting the peak via /proc/self/clear_refs."""
    import time
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
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
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() if cuda else _proc_kb('VmHWM') * 1024) - base
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times), peak / 2 ** 20


def dense_mask_attention(q, k, v, causal=True):
    """Standard attention written in plain torch, the way kernels.py writes its paths: T x T scores."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float('-inf'))
    return torch.softmax(s, dim=-1) @ v


def benchmark_cores(Ts, BH=16, d=64, window=128, ranks=(32, 8, 6, 4, 4, 4, 4, 2)):
    """fwd+bwd of each attention core on (1, BH, T, d) q, k, v (causal), against SDPA in the same run."""
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    cores = {
        'sdpa': lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        'dense_mask': dense_mask_attention,
        'mlr': lambda q, k, v: kernels.mlr_attention(q, k, v, list(ranks), causal=True),
        'swa': lambda q, k, v: kernels.sliding_window_attention(q, k, v, window, causal=True),
        'linear': lambda q, k, v: kernels.linear_attention(q, k, v, causal=True),
    }
    print(f"attention cores, fwd+bwd, causal, (B*H, d) = ({BH}, {d}), window {window}, MLR ranks "
          f"{'|'.join(map(str, ranks))}, on {dev}")
    print(f"{'core':11s} {'T':>5s} {'ms':>9s} {'x sdpa':>7s} {'x dense':>8s} {'peak MB':>8s} {'x sdpa':>7s}")
    rows = []
    for T in Ts:
        q, k, v = (torch.randn(1, BH, T, d, device=dev, requires_grad=True) for _ in range(3))
        res = {name: measure(lambda: fn(q, k, v).sum().backward()) for name, fn in cores.items()}
        for name, (ms, mb) in res.items():
            print(f"{name:11s} {T:5d} {ms:9.1f} {ms / res['sdpa'][0]:7.2f} {ms / res['dense_mask'][0]:8.2f} "
                  f"{mb:8.1f} {mb / max(res['sdpa'][1], 1e-3):7.2f}")
            rows.append(dict(core=name, T=T, ms=ms, peak_mb=mb))
    return rows


def benchmark_layers(kinds, Ts, D=512, H=8, causal=False, window=128, ranks='', n_compressed=64):
    """fwd+bwd of one full attention layer of each kind (projections included), same input."""
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    print(f"one attention layer, fwd+bwd, D = {D}, {H} heads, window {window}, m = {n_compressed}, "
          f"causal = {causal}, on {dev}")
    print(f"{'layer':13s} {'T':>6s} {'ms':>9s} {'x std':>6s} {'peak MB':>8s} {'x std':>6s} {'GFLOP fwd':>10s}")
    rows = []
    for T in Ts:
        res = {}
        for kind in kinds:
            cfg = ModelConfig(n_layer=1, n_head=H, n_embd=D, block_size=T, causal=causal, attn=kind,
                              window=window, ranks=ranks, n_compressed=n_compressed)
            layer = ATTENTION[kind](cfg).to(dev)
            x = torch.randn(1, T, D, device=dev, requires_grad=True)
            if kind == 'brl':
                N = -(-T // layer.block_size(T))
                ct = torch.randn(1, N, n_compressed, D, device=dev, requires_grad=True)
                step = lambda: sum(t.sum() for t in layer(x, ct)).backward()
            else:
                step = lambda: layer(x).sum().backward()
            res[kind] = measure(step, reps=1) + (layer.flops(T),)
            del layer
        for kind, (ms, mb, fl) in res.items():
            b = res[kinds[0]]
            print(f"{kind:13s} {T:6d} {ms:9.1f} {ms / b[0]:6.2f} {mb:8.1f} {mb / max(b[1], 1e-3):6.2f} {fl / 1e9:10.2f}")
            rows.append(dict(layer=kind, T=T, ms=ms, peak_mb=mb, gflop=fl / 1e9))
    return rows


def mlr_flop_check(T=1024, ranks=(32, 8, 6, 4, 4, 4, 4, 2), BH=16):
    """FLOPs of kernels.mlr_attention measured by torch.utils.flop_counter beside the formula."""
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = (torch.randn(1, BH, T, sum(ranks)) for _ in range(3))
    with FlopCounterMode(display=False) as fc:
        kernels.mlr_attention(q, k, v, list(ranks), causal=True)
    formula = BH * kernels.mlr_attention_flops(T, list(ranks), causal=True)
    dense = BH * 2 * 2 * T * T * sum(ranks)
    print(f"MLR T={T} ranks {'|'.join(map(str, ranks))}: measured {fc.get_total_flops() / 1e9:.3f} GFLOP, "
          f"formula {formula / 1e9:.3f} GFLOP, dense-mask attention {dense / 1e9:.3f} GFLOP")
    return fc.get_total_flops(), formula


if __name__ == '__main__':
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--brl', action='store_true', help='BRL vs full and local attention layers, n = 1k ... 16k')
    p.add_argument('--layers', action='store_true', help='one full layer of every variant (D=256, 4 heads)')
    p.add_argument('--Ts', type=str, default='', help="comma list of sequence lengths")
    args = p.parse_args()
    if args.brl:
        benchmark_layers(['standard', 'swa', 'brl'], parse_ints(args.Ts or '1024,2048,4096,8192,16384', 'Ts', ','))
    elif args.layers:
        benchmark_layers(['standard', 'mlr', 'swa', 'linear', 'bilinear_mlr', 'bilinear_btt', 'brl'],
                         parse_ints(args.Ts or '256,512,1024', 'Ts', ','), D=256, H=4, causal=True,
                         ranks='32|16|8|8', n_compressed=16)
    else:
        mlr_flop_check()
        benchmark_cores(parse_ints(args.Ts or '512,1024,2048,4096', 'Ts', ','))
