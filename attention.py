"""
Every attention variant of the project, and the one transformer backbone all train scripts share.

    standard      softmax attention, any number of heads, GQA (paper §2.1, Eq. 2)
    bilinear_mlr  score = sum_l c_l LN(q_l).LN(k_l) with block-diagonal level maps (paper §3.2, Eq. 6)
    bilinear_btt  score = c x^T LN(W_h x') with W_h a full-rank BTT per head (paper §3.2, Eq. 7)
    mlr           MLR attention: fewer features for distant pairs (paper §3.4, Eq. 9)
    swa           sliding-window attention (paper §2.3, §5.1); `global_swa` mixes it with standard layers
    global_swa_split  global + sliding-window attention inside each head, two softmaxes summed (official code)
    linear        linear attention, phi = ReLU^2 (seed 003 §2.2.2)
    brl           BRL attention: local attention + evolving compressed tokens (seed 004 §2.3-2.5, Alg. 1)

Each variant maps (B, T, D) -> (B, T, D) (BRL also its compressed tokens), causal or bidirectional, with rotary
positions inside its scores when pos = 'rope' (learned ones are the scripts' embeddings), reports its forward
FLOPs for a length-T sequence, and (the causal ones but the bilinear) decodes token by token with a cache. The
heavy math lives in kernels.py. The backbone is pre-LN: x + attn(LN(x)), x + MLP(LN(x)), linear maps without
biases, muP init (paper §3.5, App. E).

    python attention.py            # one full layer of every variant: fwd+bwd time, memory, FLOPs, x its floor
    python attention.py --brl      # BRL vs full and local attention, n = 1k ... 16k (seed 004 Figs. 5-6)
    python attention.py --brl --causal --Ts 256,2048   # causal layers (BRL's recurrence over chunks)
    (the attention cores alone: python kernels.py --bench)
"""

import argparse
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import structured


# -----------------------------------------------------------------------------
# config

def opt(default, help):
    """A ModelConfig field and its --help text: a flag of every train script (add_model_args) but for the fields
    each task sets itself (runs.TASK_FIELDS)."""
    return field(default=default, metadata={'help': help})


@dataclass
class ModelConfig:
    n_layer: int = opt(4, 'transformer blocks')
    n_head: int = opt(4, 'attention heads per layer')
    n_embd: int = opt(128, 'model width D (head width d = D / n_head)')
    mlp_hidden: int = opt(0, 'MLP hidden width (0 = 4 * n_embd)')
    block_size: int = opt(256, 'longest sequence; MLR fixes its level blocks from it (set by each task)')
    causal: bool = opt(True, 'causal (LM, ICL, forecasting) or bidirectional (LRA) attention (set by each task)')
    attn: str = opt('standard', 'attention: standard | mlr | swa | linear | bilinear_mlr | bilinear_btt | brl | '
                                'global_swa_split, or global_swa (standard at --global_layers, swa elsewhere)')
    layer_pattern: str = opt('', 'comma list of per-layer variants (overrides --attn)')
    global_layers: str = opt('0,3', 'global_swa: 0-based layers with standard attention (the paper\'s 1 and 4)')
    # scores
    qk_ln: bool = opt(False, 'LayerNorm over each head\'s q and k (MLR: the whole head, before the rank split)')
    logit_scale: str = opt('auto', 'auto | sqrt | mup | inv: the scale of a score term of width R (logit_scales)')
    mup_alpha: float = opt(8.0, 'alpha of --logit_scale mup (alpha / R); the official code\'s 8')
    n_kv_head: int = opt(0, 'standard: grouped-query attention, key/value heads (0 = n_head)')
    pos: str = opt('learned', "positions: 'learned' (absolute, added to the input), 'rope' (rotary, inside "
                              "every variant's scores) or 'none'")
    # MLR and bilinear MLR
    ranks: str = opt('', 'MLR / bilinear MLR rank allocation, e.g. 32|8|6|4|4|4|4|2 (MLR: sums to the head width)')
    mlr_block_sizes: str = opt('', 'MLR level block sizes, e.g. 1024|256|64 (default block_size / 2^l)')
    mlr_divide_levels: bool = opt(False, 'MLR: divide each score by the levels covering the pair (official: on)')
    # bilinear MLR and BTT
    btt_rank: int = opt(1, 'bilinear BTT: rank of the BTT cores')
    btt_factors: str = opt('sqrt', "BTT shape: 'sqrt' (D = a * b, b the largest divisor <= sqrt D) or 'official'")
    bilinear_rms_cap: bool = opt(False, 'official rescaling W / max(1, RMS(W) / s0) of the bilinear maps')
    bilinear_mlr_ln: str = opt('level', "bilinear MLR's q / k LayerNorm: 'level' (official: over each level's "
                                        "p_l r_l features) or 'head' (over the head's features, all levels at once)")
    # SWA, global + SWA and BRL
    window: int = opt(64, 'SWA / BRL look-back w: query i sees keys i-w..i (w + 1 keys; bidirectional |i-j| <= w)')
    gswa_ranks: str = opt('', 'global_swa_split: "global|local" features per head (default half|half)')
    n_compressed: int = opt(16, 'BRL: m compressed tokens')
    brl_block: int = opt(0, 'BRL causal chunk length nc: tokens per set of compressed tokens (0 = window)')
    brl_beta: float = opt(0.5, 'BRL: beta in ct = (1 - beta) LN(F_comp) + beta f_m(c), c: the incoming ct')
    brl_lambda_init: float = opt(0.5, 'BRL: initial lambda, the per-head gain of F_prop\'s output')
    brl_gamma: bool = opt(True, 'BRL: learned gamma (--no-brl_gamma fixes gamma = 0: no differential compression)')
    brl_history: str = opt('global', "BRL causal: 'global' (ct_b reads ct_{b-1} and chunk b-1) or 'block' (chunk b-1)")
    brl_rel_buckets: int = opt(32, 'BRL b_rel: distance buckets of the learned relative bias (0 = no b_rel)')
    # muP
    mup_base_width: int = opt(128, 'muP: lr multiplier of a weight = mup_base_width / fan_in')

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
                raise ValueError(f"unknown attention {k!r}; valid: {', '.join(ATTENTION)}" + (
                    " (global_swa is an --attn of its own: in --layer_pattern, name standard and swa layers)"
                    if self.layer_pattern else " or global_swa"))
        if 'brl' in kinds and set(kinds) != {'brl'}:
            raise ValueError(f"brl carries compressed tokens through every layer; it cannot be mixed: {kinds}")
        return kinds


def parse_ints(text, name, sep='|'):
    """'8|4|4' -> [8, 4, 4]; '' -> []; an empty entry ('8|', '|8') or a non-integer is refused."""
    try:
        return [int(s) for s in str(text).split(sep)] if str(text).strip() else []
    except ValueError:
        raise ValueError(f"{name} must be integers separated by '{sep}', got {text!r}") from None


POSITIONS = ('learned', 'rope', 'none')
POSITIVE_FIELDS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'mup_alpha', 'btt_rank', 'n_compressed',
                   'mup_base_width')
NON_NEGATIVE_FIELDS = ('n_kv_head', 'brl_block', 'brl_rel_buckets')   # (window, mlp_hidden: their own lines below)


def check_config(cfg):
    for name in POSITIVE_FIELDS + NON_NEGATIVE_FIELDS:
        v, positive = getattr(cfg, name), name in POSITIVE_FIELDS
        if not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
            raise ValueError(f"{name} = {v}: must be {'> 0' if positive else '>= 0'}")
    if not 0 <= cfg.brl_beta <= 1:
        raise ValueError(f"brl_beta = {cfg.brl_beta}: must be in [0, 1] (the compressed tokens' carry-over weight)")
    if cfg.n_embd % cfg.n_head != 0:
        raise ValueError(f"n_head = {cfg.n_head} must divide n_embd = {cfg.n_embd}")
    for name, valid in dict(logit_scale=LOGIT_SCALES, pos=POSITIONS, bilinear_mlr_ln=('level', 'head'),
                            btt_factors=('sqrt', 'official'), brl_history=('global', 'block')).items():
        if getattr(cfg, name) not in valid:
            raise ValueError(f"{name} must be {' or '.join(map(repr, valid))}, got {getattr(cfg, name)!r}")
    if cfg.window <= 0:
        raise ValueError(f"window must be a positive look-back (query i sees keys i-w..i), got {cfg.window}")
    if cfg.mlp_hidden < 0:
        raise ValueError(f"mlp_hidden must be >= 0 (0 = 4 * n_embd), got {cfg.mlp_hidden}")
    kinds = cfg.layer_kinds()
    rules = {k: logit_scale_rule(cfg, k) for k in kinds}
    if cfg.mup_alpha != ModelConfig.mup_alpha and 'mup' not in rules.values():
        raise ValueError(f"mup_alpha = {cfg.mup_alpha} is only used by logit_scale 'mup', but the scales here are "
                         f"{rules}; set logit_scale='mup' or leave mup_alpha at {ModelConfig.mup_alpha}")
    return kinds


# The fields only some layer kinds read; every other field is read by every layer. brl_block and brl_history are
# read by causal BRL only, global_layers by attn = 'global_swa' only. A flag none of a model's layers reads is
# refused by the scripts (runs.check_flags_read) rather than ignored.
READ_BY = dict(qk_ln=('standard', 'swa', 'mlr', 'linear', 'global_swa_split', 'brl'), n_kv_head=('standard',),
               ranks=('mlr', 'bilinear_mlr'), mlr_block_sizes=('mlr',), mlr_divide_levels=('mlr',),
               btt_rank=('bilinear_btt',), btt_factors=('bilinear_btt',), bilinear_mlr_ln=('bilinear_mlr',),
               bilinear_rms_cap=('bilinear_mlr', 'bilinear_btt'), window=('swa', 'brl', 'global_swa_split'),
               gswa_ranks=('global_swa_split',), global_layers=('global_swa',),
               **dict.fromkeys(('n_compressed', 'brl_beta', 'brl_lambda_init', 'brl_gamma', 'brl_rel_buckets',
                                'brl_block', 'brl_history'), ('brl',)))


def unread(cfg, names):
    """The fields among `names` that no layer of the model of cfg reads."""
    kinds = set(cfg.layer_kinds()) | ({'global_swa'} if cfg.attn == 'global_swa' and not cfg.layer_pattern else set())
    reads = lambda n: (n not in READ_BY or bool(kinds & set(READ_BY[n]))) and (
        cfg.causal or n not in ('brl_block', 'brl_history'))
    return [n for n in names if not reads(n)]


# -----------------------------------------------------------------------------
# attention logit scales: the one place their defaults live
#
# A score term that dots R features is multiplied by c:  'sqrt' 1/sqrt(R),  'mup' alpha/R (App. E),
# 'inv' 1/R (= 'mup' at alpha = 1). R is d for standard / SWA, r_l for an MLR level, p_l r_l for a
# bilinear-MLR level, D for bilinear BTT, r_global and r_local for global_swa_split.
# Per variant, 'auto' is its reference scale (the official code's where it has only one) and 'paper'
# (train_lm.py --logit_scale paper) the official LM run's, 'auto' where that run has no such layer.

LOGIT_SCALES = ('auto', 'sqrt', 'mup', 'inv')
LOGIT_SCALE_DEFAULTS = {          # kind: (auto, paper)
    'standard': ('sqrt', 'mup'),  # SDPA's 1/sqrt(d), as the official ICL runs; official LM: 8/d (mha_SP_... False)
    'swa': ('sqrt', 'mup'),       # as standard
    'brl': ('sqrt', 'auto'),      # BRL's local attention is an SWA layer and takes the 'swa' row (its compression
                                  # and readout scales are fixed); this row: the checks and what 'paper' resolves to
    'mlr': ('inv', 'inv'),        # official AttentionMLR.forward: c_l = 1 / r_l, its only choice
    'bilinear_mlr': ('sqrt', 'mup'),      # official 1/sqrt(p_l r_l); the LM run's bilinear_mlr_muP_attn_logits_scaling
    'bilinear_btt': ('sqrt', 'auto'),     # official BilinearBTTAttention: 1/sqrt(D) (muP flag off by default)
    'global_swa_split': ('mup', 'mup'),   # official CausalSelfGlobalSlidingWindowAttention: 8/r_global, 8/r_local
    'linear': ('sqrt', 'auto'),   # phi(q / sqrt(d)) inside kernels.linear_attention; no other choice
}


def logit_scale_rule(cfg, kind):
    """'sqrt', 'mup' or 'inv' for this variant; refuses a rule the variant cannot honour."""
    rule = LOGIT_SCALE_DEFAULTS[kind][0] if cfg.logit_scale == 'auto' else cfg.logit_scale
    if kind == 'linear' and rule != 'sqrt':
        raise ValueError(f"linear attention scales q, k by 1/sqrt(d) inside its feature map; logit_scale "
                         f"{cfg.logit_scale!r} cannot apply (use 'auto' or 'sqrt')")
    return rule


def paper_logit_scale(attn, layer_pattern, n_layer, global_layers):
    """logit_scale 'paper' resolved for this model: the one 'paper' default all its layers share."""
    cfg = ModelConfig(n_layer=n_layer, attn=attn, layer_pattern=layer_pattern, global_layers=global_layers)
    rules = {k: LOGIT_SCALE_DEFAULTS[k][1] for k in cfg.layer_kinds()}
    if len(set(rules.values())) > 1:
        raise ValueError(f"--logit_scale paper: the official code scales these layers differently ({rules}); "
                         f"give --logit_scale auto, sqrt, mup or inv")
    return next(iter(rules.values()))


def logit_scales(cfg, kind, widths):
    """Logit scale c of each score term of variant `kind`, whose dot products run over `widths` features."""
    rule = logit_scale_rule(cfg, kind)
    return [{'sqrt': R ** -0.5, 'mup': cfg.mup_alpha / R, 'inv': 1.0 / R}[rule] for R in widths]


# -----------------------------------------------------------------------------
# muP building blocks

class MupLinear(nn.Linear):
    """Linear map without bias, init N(0, 1/fan_in) (or zeros for output maps), lr multiplier
    base_width / fan_in (paper App. E)."""

    def __init__(self, fan_in, fan_out, base_width=128, zero_init=False):
        super().__init__(fan_in, fan_out, bias=False)
        if zero_init:
            nn.init.zeros_(self.weight)
        else:
            nn.init.normal_(self.weight, std=fan_in ** -0.5)
        self.weight.lr_mult = base_width / fan_in


def optimizer_groups(model, lr, weight_decay):
    """AdamW parameter groups: lr * p.lr_mult (muP), weight decay on every parameter of two or more dimensions
    (weights, BTT cores, BRL's b_rel tables and compressed tokens), none on gains and vectors."""
    groups = {}
    for p in model.parameters():
        if p.requires_grad:
            key = (getattr(p, 'lr_mult', 1.0), p.dim() >= 2)
            groups.setdefault(key, []).append(p)
    return [{'params': ps, 'lr': lr * mult, 'lr_mult': mult, 'weight_decay': weight_decay if decay else 0.0}
            for (mult, decay), ps in groups.items()]


def rope(x, pos, widths=None):
    """Rotary embedding (RoFormer) of x (B, H, T, f) at integer positions pos (T,). Each group of `widths`
    features (default: one group of all f) is rotated on its own, half-split: in a group of n features, feature i
    and i + n/2 turn by the angle pos * 10000^(-i / (n/2)), so a dot product within a group depends on the
    positions only through their difference. An odd group keeps its last feature unrotated."""
    out = []
    for g in x.split(widths or [x.shape[-1]], -1):
        h = g.shape[-1] // 2
        freq = 10000.0 ** (-torch.arange(0, h, device=x.device, dtype=torch.float32) / max(h, 1))
        ang = pos.float()[:, None] * freq[None, :]                   # (T, n/2)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        g1, g2, odd = g[..., :h], g[..., h:2 * h], g[..., 2 * h:]
        out += [g1 * cos - g2 * sin, g1 * sin + g2 * cos, odd]
    return torch.cat(out, dim=-1)


# -----------------------------------------------------------------------------
# FLOPs, one convention for every variant: 2 per multiply-add of the products its algorithm needs. A score of R
# features costs R per scored (query, key) pair and the value product dv per pair; a causal variant scores only
# the pairs j <= i, a window only its w + 1 keys, an MLR level only the pairs inside its blocks. Softmax, masks
# and norms are not counted; RoPE is (two products, one sum) per rotated feature and position. These counts set
# the equal-FLOP budgets of the comparisons.

def scored_pairs(T, w, causal):
    """(query i, key j) pairs with i - w <= j <= i (bidirectional: |i - j| <= w) among T positions; w >= T - 1 is
    full attention: T (T + 1) / 2 causal, T^2 bidirectional."""
    w = min(w, T - 1)
    one_side = T * w - w * (w + 1) // 2                              # pairs with 0 < i - j <= w
    return T + one_side * (1 if causal else 2)


def level_block_pairs(T, b, causal):
    """Pairs inside the same MLR level block of b consecutive positions (b >= T: one block of T)."""
    b = min(b, T)
    return (T // b) * scored_pairs(b, b - 1, causal)


class Cache:
    """Per-layer decoding state: t, the tokens seen so far; each variant keeps what it needs in its attributes."""
    t, k, v = 0, None, None


def _append(old, new, keep=None):
    out = new if old is None else torch.cat([old, new], dim=2)
    return out if keep is None else out[:, :, -keep:]


# -----------------------------------------------------------------------------
# attention variants on per-head q, k, v

class AttentionHeads(nn.Module):
    """H heads of width d, the settings checks, the value and output maps and the forward pass: qkv(), RoPE, then
    attend() (whole sequence) or decode() (one token with a cache). How a head scores pairs is the subclass's
    (SelfAttention's q, k or BilinearAttention's feature maps). `kind` is the registry name."""
    kind = 'standard'
    rope_widths = None                                   # feature groups RoPE rotates each on its own (None: all)

    def __init__(self, cfg):
        super().__init__()
        H = cfg.n_head
        self.cfg, self.H, self.d = cfg, H, cfg.head_dim
        logit_scale_rule(cfg, self.kind)             # refuses a logit_scale this variant cannot honour
        self.n_kv = cfg.n_kv_head or H
        if H % self.n_kv:
            raise ValueError(f"n_kv_head = {self.n_kv} must divide n_head = {H}")
        if self.n_kv != H and type(self) is not StandardAttention:
            raise ValueError("grouped-query attention (n_kv_head) is only implemented for standard attention")

    def rotate(self, q, k, pos):
        """RoPE on the query and key features (B, H, T, f) at positions pos (T,), each group of rope_widths alone."""
        return rope(q, pos, self.rope_widths), rope(k, pos, self.rope_widths)

    def value_output_maps(self):
        """v_proj (B, T, D) -> (B, T, n_kv d), init N(0, 1/D), and o_proj (B, T, H d) -> (B, T, D), zero init."""
        D, d, w = self.cfg.n_embd, self.d, self.cfg.mup_base_width
        return MupLinear(D, self.n_kv * d, w), MupLinear(self.H * d, D, w, zero_init=True)

    def forward(self, x, key_mask=None, cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)                      # q, k (B, H, T, e), v (B, H, T, d); GQA: k, v have Hkv heads
        q, k = q.to(v.dtype), k.to(v.dtype)        # under CUDA autocast, qk_ln's LayerNorm returns float32
        t0 = 0 if cache is None else cache.t
        pos = torch.arange(t0, t0 + T, device=x.device) if self.cfg.pos == 'rope' else None
        if pos is not None:
            q, k = self.rotate(q, k, pos)
        if cache is None:
            y = self.attend(q, k, v, key_mask, pos)
        else:
            if T != 1:
                raise ValueError(f"decoding with a cache takes one token at a time, got T = {T}")
            y = self.decode(q, k, v, cache, pos)
            cache.t += 1
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.d))


class SelfAttention(AttentionHeads):
    """q, k, v projections (B, T, D) -> (B, H, T, d), the q, k LayerNormed per head when qk_ln is on."""

    def __init__(self, cfg):
        super().__init__(cfg)
        D, H, d, w = cfg.n_embd, self.H, self.d, cfg.mup_base_width
        self.q_proj = MupLinear(D, H * d, w)
        self.k_proj = MupLinear(D, self.n_kv * d, w)
        self.v_proj, self.o_proj = self.value_output_maps()     # RNG draws in creation order: q, k, v, o
        self.q_ln, self.k_ln = (nn.LayerNorm(d, bias=False) if cfg.qk_ln else nn.Identity() for _ in 'qk')

    def qkv(self, x):
        B, T, _ = x.shape
        q = self.q_ln(self.q_proj(x).view(B, T, self.H, self.d)).transpose(1, 2)      # (B, H, T, d)
        k = self.k_ln(self.k_proj(x).view(B, T, self.n_kv, self.d)).transpose(1, 2)   # (B, Hkv, T, d)
        v = self.v_proj(x).view(B, T, self.n_kv, self.d).transpose(1, 2)
        return q, k, v

    def scale(self):                                     # c of a whole-head dot product (R = d)
        return logit_scales(self.cfg, self.kind, [self.d])[0]

    def new_cache(self):
        return Cache()

    def cache_numel(self, cache):                        # per batch element; standard and swa keep whole keys
        return cache.k[0].numel()

    def flops(self, T):
        D, rotated = self.cfg.n_embd, (self.H + self.n_kv) * self.d if self.cfg.pos == 'rope' else 0
        return 2 * T * D * self.d * (2 * self.H + 2 * self.n_kv) + self.core_flops(T) + 3 * T * rotated


class StandardAttention(SelfAttention):
    """Softmax attention (SDPA); the scoring matrix W_Q W_K^T of each head has rank d (paper §2.2)."""

    def look_back(self, T):                              # how far back a query sees among T positions: all of them
        return T - 1

    def attend(self, q, k, v, key_mask, pos=None):
        mask = None if key_mask is None else key_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.cfg.causal and mask is None,
                                              scale=self.scale(), enable_gqa=self.n_kv != self.H)

    def decode(self, q, k, v, cache, pos=None):
        n = self.look_back(cache.t + 1) + 1                                    # the keys a query sees
        cache.k, cache.v = _append(cache.k, k, n), _append(cache.v, v, n)
        return F.scaled_dot_product_attention(q, cache.k, cache.v, scale=self.scale(), enable_gqa=self.n_kv != self.H)

    def core_flops(self, T):
        return 2 * self.H * scored_pairs(T, self.look_back(T), self.cfg.causal) * 2 * self.d


class SWAAttention(StandardAttention):
    """Sliding-window attention at O(T w) cost (paper §2.3): query i sees the w + 1 keys i-w..i (bidirectional:
    |i - j| <= w), w the official sliding_block_size."""
    kind = 'swa'

    def look_back(self, T):
        return self.cfg.window

    def attend(self, q, k, v, key_mask, pos=None):
        return kernels.sliding_window_attention(q, k, v, self.cfg.window, self.cfg.causal, self.scale(), key_mask)


class GlobalSWASplitAttention(SWAAttention):
    """Global + SWA inside every head, the official code's `low_rank_with_gswa` (the paper's §5.1 names only the
    layer-wise mix, global_swa): q, k of width d (QK-normed with --qk_ln) split into r_g global and r_s local
    features (gswa_ranks 'r_g|r_s'); one softmax over all keys on the global part, one over the window on the
    local part, the two weight matrices summed (rows sum to 2, as the official code) and applied to one shared v."""
    kind = 'global_swa_split'

    def __init__(self, cfg):
        super().__init__(cfg)
        d = self.d
        self.split = parse_ints(cfg.gswa_ranks or f"{d // 2}|{d - d // 2}", 'gswa_ranks')
        if len(self.split) != 2 or min(self.split) <= 0 or sum(self.split) != d:
            raise ValueError(f"gswa_ranks {cfg.gswa_ranks!r} must be two positive widths 'global|local' summing "
                             f"to the head width {d}, e.g. '{d // 2}|{d - d // 2}'")
        self.scales = logit_scales(cfg, self.kind, self.split)               # [c_global, c_local]
        self.rope_widths = self.split

    def attend(self, q, k, v, key_mask, pos=None):
        (qg, ql), (kg, kl) = q.split(self.split, -1), k.split(self.split, -1)  # (B, H, T, r_g), (B, H, T, r_s)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        glob = F.scaled_dot_product_attention(qg, kg, v, attn_mask=mask, scale=self.scales[0],
                                              is_causal=self.cfg.causal and mask is None)
        loc = kernels.sliding_window_attention(ql.contiguous(), kl.contiguous(), v, self.cfg.window,
                                               self.cfg.causal, self.scales[1], key_mask)
        return glob + loc                                                      # (B, H, T, d)

    def decode(self, q, k, v, cache, pos=None):
        cache.k, cache.v = _append(cache.k, k), _append(cache.v, v)
        n = self.cfg.window + 1
        (qg, ql), (kg, kl) = q.split(self.split, -1), cache.k.split(self.split, -1)
        return (F.scaled_dot_product_attention(qg, kg, cache.v, scale=self.scales[0]) +
                F.scaled_dot_product_attention(ql, kl[:, :, -n:], cache.v[:, :, -n:], scale=self.scales[1]))

    def core_flops(self, T):
        (rg, rs), causal = self.split, self.cfg.causal
        glob, loc = scored_pairs(T, T, causal), scored_pairs(T, self.cfg.window, causal)
        return 2 * self.H * (glob * (rg + self.d) + loc * (rs + self.d))


class MLRAttention(SelfAttention):
    """MLR attention (paper §3.4, Eq. 9). Level l cuts positions into blocks of size block_size/2^l (fixed by the
    model, so a shorter causal sequence just has more global levels); a pair sharing a level-l block adds
    c_l q_l.k_l with R = r_l. QK-LN normalizes the whole head before the rank split, as the official code; RoPE
    (not in the paper) rotates each level's r_l features on their own, so every level's score is relative."""
    kind = 'mlr'

    def __init__(self, cfg):
        super().__init__(cfg)
        self.ranks = parse_ints(cfg.ranks or str(self.d), 'ranks')
        if any(r <= 0 for r in self.ranks) or sum(self.ranks) != self.d:
            raise ValueError(f"MLR ranks {cfg.ranks!r} must be positive and sum to the head width "
                             f"{self.d} (n_embd {cfg.n_embd} / n_head {cfg.n_head}), e.g. "
                             f"'{self.d // 2}|{self.d - self.d // 2}'")
        L = len(self.ranks)
        if cfg.mlr_block_sizes:
            self.level_sizes = parse_ints(cfg.mlr_block_sizes, 'mlr_block_sizes')
        else:
            if cfg.block_size % 2 ** (L - 1):
                raise ValueError(f"MLR with {L} levels needs block_size divisible by {2 ** (L - 1)}, "
                                 f"got {cfg.block_size}")
            self.level_sizes = [cfg.block_size // 2 ** l for l in range(L)]
        kernels.mlr_level_sizes(self.level_sizes[0], L, self.level_sizes)   # validates the list
        self.rope_widths = self.ranks                    # RoPE per level: each level's score is relative
        self.scales = logit_scales(cfg, self.kind, self.ranks)                # c_l per level

    def attend(self, q, k, v, key_mask, pos=None):
        T = q.shape[2]
        Tp = self.valid_length(T)
        if Tp != T:  # causal: padding on the right changes nothing before it
            q, k, v = (F.pad(t, (0, 0, 0, Tp - T)) for t in (q, k, v))
        y = kernels.mlr_attention(q, k, v, self.ranks, self.cfg.causal, self.level_sizes, self.scales,
                                  self.cfg.mlr_divide_levels, key_mask)
        return y[:, :, :T]

    def valid_length(self, T):
        """Shortest length >= T that tiles into the level blocks (T itself when bidirectional)."""
        for Tp in range(T, self.level_sizes[0] + 1):
            if all(b >= Tp or Tp % b == 0 for b in self.level_sizes):
                if Tp != T and not self.cfg.causal:
                    break
                return Tp
        raise ValueError(f"sequence length {T} does not tile into the MLR blocks {self.level_sizes}; valid: "
                         f"{kernels.mlr_valid_lengths(self.level_sizes)}")

    def decode(self, q, k, v, cache, pos=None):
        """Level l keeps only the r_l key features of the current level-l block (paper §3.4, key cache)."""
        t = cache.t
        if t >= self.level_sizes[0]:
            raise ValueError(f"MLR decoding is defined up to block_size = {self.level_sizes[0]} tokens")
        if t == 0:
            cache.keys = [None] * len(self.ranks)
        cache.v = _append(cache.v, v)                                          # (B, H, t+1, d)
        s = torch.zeros(q.shape[:3] + (t + 1,), dtype=q.dtype, device=q.device)
        covering = torch.zeros(t + 1, dtype=q.dtype, device=q.device)
        for l, (q_l, k_l, b, c) in enumerate(zip(q.split(self.ranks, -1), k.split(self.ranks, -1),
                                                  self.level_sizes, self.scales)):
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
        """Level l scores the pairs inside its blocks with r_l features; A V runs over the top level's pairs."""
        Tp, causal = self.valid_length(T), self.cfg.causal   # attend() pads a short causal sequence to Tp
        pairs = [level_block_pairs(Tp, b, causal) for b in self.level_sizes]
        return 2 * self.H * (sum(r * p for r, p in zip(self.ranks, pairs)) + self.d * pairs[0])


class LinearAttention(SelfAttention):
    """Linear attention with phi = ReLU^2 (seed 003 §2.2.2); decoding keeps the d x d state S and the vector z.
    RoPE takes RoFormer's linear form (Su et al. 2021, Eq. 19): the features phi(q), phi(k), not q and k, are
    rotated, in the numerator only, so the denominator stays positive."""
    kind = 'linear'

    def rotate(self, q, k, pos):
        return q, k                                                             # the features turn, in attend

    def attend(self, q, k, v, key_mask, pos=None):
        rotate = None if pos is None else lambda f: rope(f, pos)
        return kernels.linear_attention(q, k, v, self.cfg.causal, key_mask=key_mask, rotate=rotate)

    def decode(self, q, k, v, cache, pos=None):
        qf, kf = kernels.linear_feature_map(q), kernels.linear_feature_map(k)   # (B, H, 1, d)
        qn, kn = (qf, kf) if pos is None else (rope(qf, pos), rope(kf, pos))    # the numerator's features
        if cache.t == 0:
            cache.S, cache.z = 0, 0
        cache.S = cache.S + kn.transpose(-2, -1) @ v                            # (B, H, d, d)
        cache.z = cache.z + kf                                                  # (B, H, 1, d)
        return (qn @ cache.S) / ((qf * cache.z).sum(-1, keepdim=True) + 1e-6)

    def cache_numel(self, cache):
        return cache.S[0].numel() + cache.z[0].numel()

    def core_flops(self, T):
        """The chunked form's count (chunks of c = 64, quadratic inside); RoPE's numerator adds a second
        intra-chunk score product."""
        extra = 2 * T * min(64, T) * self.d if self.cfg.pos == 'rope' and self.cfg.causal else 0
        return self.H * (kernels.linear_attention_flops(T, self.d, self.cfg.causal) + extra)


class BilinearAttention(AttentionHeads):
    """The bilinear variants: per-head query and key features of width e replace q and k (a subclass builds their
    maps after the value and output maps); one batched product, W_h never formed (paper §3.2, App. D)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.v_proj, self.o_proj = self.value_output_maps()

    def qkv(self, x):
        B, T, _ = x.shape
        qf, kf = self.features(x)                                            # (B, H, T, e)
        return qf, kf, self.v_proj(x).view(B, T, self.H, self.d).transpose(1, 2)   # v (B, H, T, d)

    def attend(self, q, k, v, key_mask, pos=None):
        mask = None if key_mask is None else key_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                              is_causal=self.cfg.causal and mask is None)

    def decode(self, q, k, v, cache, pos=None):
        raise ValueError(f"{type(self).__name__} has no decoding cache; run the full forward")

    def flops(self, T):
        D, e = self.cfg.n_embd, self.feature_width
        scores = 2 * self.H * scored_pairs(T, T, self.cfg.causal) * (e + self.d)
        rotated = 2 * self.H * e if self.cfg.pos == 'rope' else 0
        return 2 * T * D * self.d * 2 * self.H + self.feature_flops(T) + scores + 3 * T * rotated


def rms_cap(weights, d_in, d_out):
    """The official rescaling of the bilinear maps, W / max(1, RMS(W) / s0) with s0 = sqrt(min(d_in, d_out)) / d_in
    (the init std 1/sqrt(d_in) when d_out >= d_in): the RMS over all `weights` together never exceeds s0."""
    rms = torch.sqrt(torch.stack([w.pow(2).mean() for w in weights]).mean() + 1e-8)
    div = torch.clamp(rms / (min(d_in, d_out) ** 0.5 / d_in), min=1.0)
    return [w / div for w in weights]


class BilinearMLRAttention(BilinearAttention):
    """W_h = sum_l blockdiag_{p_l}(L_{l,k} R_{l,k}^T): the level-l query of x is x cut into p_l = 2^l parts,
    part k mapped by L_{l,k} (D/p_l -> r_l); score = sum_l c_l LN(q_l).LN(k_l) with R = p_l r_l, a LayerNorm
    per level. bilinear_mlr_ln 'head' (not in the official code) LayerNorms each head's q and k over all levels
    at once: a per-level LayerNorm over 1 feature outputs 0 and over 2 features +-g, so such levels never learn
    (the official heads of width 32 never meet this; small heads do)."""
    kind = 'bilinear_mlr'

    def __init__(self, cfg):
        super().__init__(cfg)
        D, H = cfg.n_embd, self.H
        self.ranks = parse_ints(cfg.ranks or str(self.d), 'ranks')
        if any(r <= 0 for r in self.ranks):
            raise ValueError(f"bilinear MLR ranks must be positive, got {cfg.ranks!r}")
        self.n_blocks = [2 ** l for l in range(len(self.ranks))]
        if D % self.n_blocks[-1]:
            raise ValueError(f"bilinear MLR with {len(self.ranks)} levels cuts n_embd = {D} into "
                             f"{self.n_blocks[-1]} parts; use fewer levels or a width divisible by it")
        w = cfg.mup_base_width
        self.q_maps, self.k_maps = (nn.ModuleList(structured.BlockDiagonal(D, p * H * r, p, base_width=w)
                                                  for p, r in zip(self.n_blocks, self.ranks)) for _ in 'qk')
        self.level_widths = [p * r for p, r in zip(self.n_blocks, self.ranks)]
        self.rope_widths = self.level_widths
        self.feature_width = sum(self.level_widths)
        ln_widths = self.level_widths if cfg.bilinear_mlr_ln == 'level' else [self.feature_width]
        self.q_lns, self.k_lns = (nn.ModuleList(nn.LayerNorm(n, bias=False) for n in ln_widths) for _ in 'qk')
        self.level_scales = logit_scales(cfg, self.kind, self.level_widths)

    def level_map(self, m, x):
        """x (..., D) through one level's block-diagonal map, rescaled by rms_cap when bilinear_rms_cap is on."""
        if not self.cfg.bilinear_rms_cap:
            return m(x)
        w, = rms_cap([m.weight], m.bi, m.bo)                                 # official shapes (D/p_l, H r_l)
        return torch.func.functional_call(m, {'weight': w}, (x,))

    def features(self, x):
        B, T, _ = x.shape
        qs, ks = [], []
        for l, (p, r) in enumerate(zip(self.n_blocks, self.ranks)):
            # block-diagonal output is laid out (block, head, r); each head wants (block, r)
            heads = lambda y: y.view(B, T, p, self.H, r).transpose(2, 3).reshape(B, T, self.H, p * r)
            qs.append(heads(self.level_map(self.q_maps[l], x)))                 # (B, T, H, p_l r_l)
            ks.append(heads(self.level_map(self.k_maps[l], x)))
        if self.cfg.bilinear_mlr_ln == 'head':                                  # one LayerNorm over all levels
            qs, ks = self.q_lns[0](torch.cat(qs, -1)), self.k_lns[0](torch.cat(ks, -1))
            qs, ks = qs.split(self.level_widths, -1), ks.split(self.level_widths, -1)
        else:
            qs, ks = [ln(q) for ln, q in zip(self.q_lns, qs)], [ln(k) for ln, k in zip(self.k_lns, ks)]
        q = torch.cat([c * ql for c, ql in zip(self.level_scales, qs)], -1)
        return q.transpose(1, 2), torch.cat(ks, -1).transpose(1, 2)              # (B, H, T, sum p_l r_l)

    def feature_flops(self, T):
        return 2 * 2 * T * sum(m.macs for m in self.q_maps)


def official_btt_factors(D):
    """The official BilinearBTTAttention.factorize(D, 2): b = the smallest divisor of D above sqrt(D), a = D / b,
    used for input (a, b) and output (a, b): 256 -> (8, 32), 64 -> (4, 16), 16 -> (2, 8)."""
    b = min([f for f in structured.divisors(D) if f * f > D] or [D])
    return D // b, b


class BilinearBTTAttention(BilinearAttention):
    """W_h a D x D BTT (full rank D) per head: score = c x^T LN(W_h x') with R = D; one LayerNorm shared by the
    heads, as the official code. With bilinear_rms_cap, each core's RMS is taken over all heads together."""
    kind = 'bilinear_btt'

    def __init__(self, cfg):
        super().__init__(cfg)
        D = cfg.n_embd
        f = official_btt_factors(D) if cfg.btt_factors == 'official' else None
        self.btts = nn.ModuleList(structured.BTT(D, D, rank=cfg.btt_rank, in_factors=f, out_factors=f,
                                                 base_width=cfg.mup_base_width) for _ in range(self.H))
        self.ln = nn.LayerNorm(D, bias=False)
        self.feature_width = D
        self.c, = logit_scales(cfg, self.kind, [D])

    def cores(self):
        """[(R_h, L_h)] per head; with bilinear_rms_cap, rescaled as the official right map (d_in = c2,
        d_out = H e2 s) and left map (d_in = c1 s, d_out = e1)."""
        Rs, Ls = [b.R for b in self.btts], [b.L for b in self.btts]
        if self.cfg.bilinear_rms_cap:
            b = self.btts[0]
            Rs, Ls = rms_cap(Rs, b.c2, self.H * b.e2 * b.s), rms_cap(Ls, b.c1 * b.s, b.e1)
        return list(zip(Rs, Ls))

    def features(self, x):
        B, T, D = x.shape
        kf = torch.stack([self.ln(torch.func.functional_call(btt, {'R': R, 'L': L}, (x,)))
                          for btt, (R, L) in zip(self.btts, self.cores())], dim=1)    # (B, H, T, D)
        return (self.c * x)[:, None].expand(B, self.H, T, D), kf

    def feature_flops(self, T):
        return 2 * T * sum(b.macs for b in self.btts)


# -----------------------------------------------------------------------------
# BRL attention (seed 004: §2.3-2.5, App. B.2, Algorithm 1)
#
# One layer: x the layer-normed tokens (n x D), c the compressed tokens entering it (m x D), H heads of width D/H,
# h the history the compressed tokens read. F_BRL in Algorithm 1's steps, each a part of BRLAttention:
#   differential_compression  F_comp(c; h) = GroupNorm_h((S1 - gamma_h S2) V),                          line 5
#                               S1|S2 = softmax(c Wq (h Wk1|Wk2)^T / (m sqrt(D)) + b_comp)
#   compressed_token_update   ct = U(c; h) = (1 - beta) LN(F_comp(c; h)) + beta f_M(c)  (no h: LN(c))    line 7
#   local                     F_gen(x), sliding-window attention                                        line 2
#   readout                   ReLU(LN(F_prop(x; ct))),                                                  line 8
#                               F_prop(x; ct) = lambda_h softmax(phi(x) (ct Wk)^T / sqrt(D/H) + b_prop) ct Wv (Eq. 9)
#   F_BRL(x) = F_gen(x) + readout; the block adds ct to c (BRL_BLOCK), so c evolves layer by layer. Eq. 7 wraps
#   U in a ReLU that Algorithm 1 line 7 does not have; we follow Algorithm 1. Eq. 9's sqrt(d), written for one
#   head, is the head width sqrt(D/H) here, as in multi-head attention; Eq. 12's m sqrt(d_ct) keeps the width D.
#
# Which tokens ct reads (the history h), chosen by compressed_tokens():
#   bidirectional: one chunk, ct = U(c; x): the compressed tokens read the whole sequence.
#   causal: chunks of nc tokens (brl_block, default the window), chunk b has its own c_b and ct_b, and
#     'global' (default): ct_0 = U(c_0),  ct_b = U(c_b; [ct_{b-1}; x_{b-1}])   a recurrence over chunks
#     'block' (ablation): ct_0 = U(c_0),  ct_b = U(c_b; x_{b-1})                 all chunks at once
#   'global' is Algorithm 1's history queue: ct_{b-1} stands for everything before chunk b-1, so every token
#   depends on every earlier one at O(n w + n m) cost, the N = T / nc steps in order. 'block' is App. B.2's
#   training rule: a token reaches back about n_layer + 1 chunks. (The paper decodes with all in-context tokens;
#   we decode by the rule we train with, so decoding equals the full forward.)
#
# b_rel (Eqs. 9, 12): the paper fixes no form; we use T5's learned bucketed bias b[h, j, bucket(dist)] for head h
#   and compressed token j (one equal for all j would cancel in F_prop's softmax), zero-initialized. A chunk's
#   compressed tokens sit just before its first token (bidirectional: before the sequence), so dist is, for
#   F_prop, the query's offset in its chunk (0 .. nc-1); for F_comp, bidirectional the token's index, causal
#   nc - s for token s of chunk b-1 and nc for ct_{b-1}.

def relative_buckets(dist, n_buckets, span):
    """T5's bucket of each distance dist >= 0 (long tensor): dist itself below n_buckets/2, then log-spaced
    buckets up to span (at least n_buckets); every distance >= that lands in the last bucket."""
    exact = n_buckets // 2                                                # >= 1
    ratio = torch.log(dist.clamp(min=exact).float() / exact) / math.log(max(span, 2 * exact) / exact)
    far = (exact + ratio * (n_buckets - exact)).long().clamp(max=n_buckets - 1)
    return torch.where(dist < exact, dist, far)


class BRLAttention(nn.Module):
    """F_BRL of Algorithm 1 in the steps above: the tokens x (B, T, D) and one set of compressed tokens per chunk
    c (B, N, m, D) -> (F_BRL (B, T, D), the ct (B, N, m, D) it read)."""

    def __init__(self, cfg):
        super().__init__()
        D, H, m, w = cfg.n_embd, cfg.n_head, cfg.n_compressed, cfg.mup_base_width
        if cfg.brl_rel_buckets == 1:
            raise ValueError(f"brl_rel_buckets must be 0 (no b_rel) or >= 2, got {cfg.brl_rel_buckets}")
        self.cfg, self.H, self.m = cfg, H, m
        self.local = SWAAttention(cfg)                                        # F_gen
        # F_comp: differential cross-attention from the compressed tokens to the history
        self.f_q, self.f_k1, self.f_k2, self.f_v = (MupLinear(D, D, w) for _ in range(4))
        self.comp_norm = nn.GroupNorm(H, D)                                   # per-head normalization
        self.gamma_q, self.gamma_k1, self.gamma_k2 = (nn.Parameter(0.1 * torch.randn(H)) for _ in range(3))
        self.f_m = MupLinear(D, D, w)
        self.ct_ln = nn.LayerNorm(D, bias=False)
        # F_prop: cross-attention from the tokens to the updated compressed tokens, scaled by lambda per head
        self.f_phi, self.f_pk, self.f_pv = (MupLinear(D, D, w) for _ in range(3))
        self.lam = nn.Parameter(torch.full((H,), float(cfg.brl_lambda_init)))
        self.prop_ln = nn.LayerNorm(D, bias=False)
        # b_rel of F_comp (Eq. 12) and F_prop (Eq. 9): (H, m, n_buckets) each
        nbk = cfg.brl_rel_buckets
        self.comp_rel, self.prop_rel = (nn.Parameter(torch.zeros(H, m, nbk)) if nbk else None for _ in range(2))

    def gamma(self):
        """(H,): gamma_h = exp(gq_h gk1_h) - exp(gq_h gk2_h), gq, gk1, gk2 ~ N(0, 0.1) (paper §2.5); or zeros."""
        if not self.cfg.brl_gamma:
            return torch.zeros_like(self.gamma_q)
        return torch.exp(self.gamma_q * self.gamma_k1) - torch.exp(self.gamma_q * self.gamma_k2)

    def rel_bias(self, table, dist, dtype):
        """b_rel (H, m, n) in the scores' dtype for distances dist (n,), or None without b_rel. The buckets span
        the chunk length (bidirectional: block_size, so a distance gets the same bias at every sequence length)."""
        if table is None:
            return None
        span = self.chunk_len(self.cfg.block_size)
        return table[:, :, relative_buckets(dist, table.shape[-1], span)].to(dtype)

    def heads(self, t):
        return t.unflatten(-1, (self.H, -1)).transpose(-3, -2)                # (..., n, D) -> (..., H, n, D/H)

    def chunk_len(self, T):
        """Tokens per chunk: the whole sequence when bidirectional, brl_block (0 = the window) when causal."""
        return (self.cfg.brl_block or self.cfg.window) if self.cfg.causal else T

    def n_chunks(self, T):
        return -(-T // self.chunk_len(T))

    def differential_compression(self, c, hist, dist=None, hist_mask=None):
        """F_comp(c; hist): c (B, N, m, D) reads hist (B, N, n, D) -> (B, N, m, D). dist (n,): the history's
        distances for b_rel (default 0 .. n-1, the bidirectional ones); hist_mask (B, N, n) bool, False = padding."""
        q, k1, k2, v = self.heads(self.f_q(c)), self.heads(self.f_k1(hist)), \
            self.heads(self.f_k2(hist)), self.heads(self.f_v(hist))          # (B, N, H, m or n, D/H)
        dist = torch.arange(hist.shape[2], device=hist.device) if dist is None else dist
        bias = self.rel_bias(self.comp_rel, dist, q.dtype)                    # (H, m, n) or None
        mask = None if hist_mask is None else hist_mask[:, :, None, None, :]  # (B, N, 1, 1, n)
        if bias is not None:
            mask = bias if mask is None else torch.where(mask, bias, float('-inf'))  # (B, N, H, m, n)
        scale = 1.0 / (self.m * math.sqrt(c.shape[-1]))                       # (M1): m sqrt(d_ct), not sqrt(d)
        s1 = F.scaled_dot_product_attention(q, k1, v, attn_mask=mask, scale=scale)
        s2 = F.scaled_dot_product_attention(q, k2, v, attn_mask=mask, scale=scale)
        comp = (s1 - self.gamma()[:, None, None] * s2).transpose(-3, -2).flatten(-2)  # (B, N, m, D)
        return self.comp_norm(comp.flatten(0, 2)).view_as(comp)

    def compressed_token_update(self, c, hist=None, dist=None, hist_mask=None):
        """U(c; hist) = (1 - beta) LN(F_comp(c; hist)) + beta f_M(c); U(c) without a history (Alg. 1 lines 3-7)."""
        comp = c if hist is None else self.differential_compression(c, hist, dist, hist_mask)
        beta = self.cfg.brl_beta
        return (1 - beta) * self.ct_ln(comp) + beta * self.f_m(c)

    def readout(self, x, ct, offset):
        """ReLU(LN(F_prop(x; ct))): x (B, N, n, D) attends the m compressed tokens ct (B, N, m, D) of its chunk;
        offset (n,) is each query's place in its chunk (b_rel's distance)."""
        q, k, v = self.heads(self.f_phi(x)), self.heads(self.f_pk(ct)), self.heads(self.f_pv(ct))
        bias = self.rel_bias(self.prop_rel, offset, q.dtype)                 # (H, m, n) or None
        bias = None if bias is None else bias.transpose(-1, -2)             # (H, n, m)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias) * self.lam[:, None, None]  # (B, N, H, n, D/H)
        return F.relu(self.prop_ln(o.transpose(-3, -2).flatten(-2)))

    def history_dist(self, nc, device):
        """b_rel distances of a causal history: ct_{b-1} at nc ('global' only), then token s of chunk b-1
        at nc - s -> (m + nc,) or (nc,)."""
        tokens = nc - torch.arange(nc, device=device)
        ct_prev = torch.full((self.m,), nc, device=device)
        return tokens if self.cfg.brl_history == 'block' else torch.cat([ct_prev, tokens])

    def compressed_tokens(self, c, xc, key_mask=None):
        """ct (B, N, m, D) of every chunk, from c (B, N, m, D) entering the layer and the chunks xc (B, N, nc, D),
        by the history rule written above."""
        if not self.cfg.causal:                          # one chunk: ct reads the whole (unpadded) sequence
            return self.compressed_token_update(c, xc, None, None if key_mask is None else key_mask[:, None])
        dist = self.history_dist(xc.shape[2], xc.device)
        ct = [self.compressed_token_update(c[:, :1])]                         # (B, 1, m, D); no history yet
        if self.cfg.brl_history == 'block':              # ct_b = U(c_b; x_{b-1}), all chunks at once
            if xc.shape[1] > 1:
                ct.append(self.compressed_token_update(c[:, 1:], xc[:, :-1], dist))
            return torch.cat(ct, dim=1)
        for b in range(1, xc.shape[1]):                  # 'global': ct_b = U(c_b; [ct_{b-1}; x_{b-1}]), in order
            hist = torch.cat([ct[-1], xc[:, b - 1:b]], dim=2)                 # (B, 1, m + nc, D)
            ct.append(self.compressed_token_update(c[:, b:b + 1], hist, dist))
        return torch.cat(ct, dim=1)                                           # (B, N, m, D)

    def forward(self, x, c, key_mask=None):
        """x (B, T, D) (already layer-normed), c (B, N, m, D) -> (F_BRL (B, T, D), ct (B, N, m, D))."""
        B, T, D = x.shape
        y = self.local(x, key_mask)                                           # F_gen
        nc, N = self.chunk_len(T), self.n_chunks(T)
        xc = F.pad(x, (0, 0, 0, N * nc - T)).view(B, N, nc, D)              # (B, N, nc, D)
        ct = self.compressed_tokens(c, xc, key_mask)
        y = y + self.readout(xc, ct, torch.arange(nc, device=x.device)).view(B, N * nc, D)[:, :T]
        return y, ct

    def decode(self, x, c, cache):
        """One token x (B, 1, D), c (B, 1, m, D) the compressed tokens of its chunk entering this layer. At a
        chunk boundary ct is recomputed from the finished chunk, by the same rule as forward()."""
        t, nc = cache.t, self.chunk_len(None)
        if t % nc == 0:
            if t == 0:
                cache.ct = self.compressed_token_update(c)
            else:
                hist = cache.chunk if self.cfg.brl_history == 'block' else torch.cat([cache.ct, cache.chunk], dim=2)
                cache.ct = self.compressed_token_update(c, hist, self.history_dist(nc, x.device))  # (B, 1, m, D)
            cache.chunk = None
        cache.chunk = _append(cache.chunk, x[:, None])                      # (B, 1, t % nc + 1, D)
        offset = torch.full((1,), t % nc, device=x.device)
        y = self.local(x, cache=cache.local) + self.readout(x[:, None], cache.ct, offset)[:, 0]
        cache.t += 1
        return y, cache.ct

    def new_cache(self):
        cache = Cache()
        cache.local = self.local.new_cache()
        return cache

    def cache_numel(self, cache):
        """Per sequence: the local keys, the compressed tokens and the tokens of the unfinished chunk."""
        return self.local.cache_numel(cache.local) + cache.ct[0].numel() + cache.chunk[0].numel()

    def flops(self, T):
        D, m, N = self.cfg.n_embd, self.m, self.n_chunks(T)
        # the keys F_comp reads, counted as all T tokens (+ ct_{b-1} with 'global'); causal, no chunk reads the last
        # one (nor f_q the first): nc tokens' K1, K2, V and scores over, ~2 % of the LM study's BRL forward
        n_hist = T + (N - 1) * m if self.cfg.causal and self.cfg.brl_history == 'global' else T
        comp = 2 * n_hist * D * D * 3 + 2 * 2 * 2 * m * n_hist * D   # K1, K2, V of the history; two score maps + AV
        upd = 2 * N * m * D * D * 4                                  # f_q, f_m, f_pk, f_pv per chunk
        prop = 2 * T * D * D + 2 * 2 * T * m * D
        return self.local.flops(T) + comp + upd + prop


ATTENTION = {'standard': StandardAttention, 'mlr': MLRAttention, 'swa': SWAAttention, 'linear': LinearAttention,
             'bilinear_mlr': BilinearMLRAttention, 'bilinear_btt': BilinearBTTAttention, 'brl': BRLAttention,
             'global_swa_split': GlobalSWASplitAttention}


# -----------------------------------------------------------------------------
# the backbone

class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, hidden = cfg.n_embd, cfg.mlp_hidden or 4 * cfg.n_embd
        self.up = MupLinear(D, hidden, cfg.mup_base_width)
        self.down = MupLinear(hidden, D, cfg.mup_base_width, zero_init=True)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LN block; the compressed-token stream x_ct passes through untouched."""

    def __init__(self, cfg, kind):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd, bias=False), nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = ATTENTION[kind](cfg)
        self.mlp = MLP(cfg)

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
        self.mlp_ct = MLP(cfg)

    def forward(self, x, x_ct, key_mask=None, cache=None):
        if cache is None:
            y, upd = self.attn(self.ln1(x), self.ln_ct1(x_ct), key_mask)
        else:
            y, upd = self.attn.decode(self.ln1(x), self.ln_ct1(x_ct), cache)
        x, x_ct = x + y, x_ct + upd
        return x + self.mlp(self.ln2(x)), x_ct + self.mlp_ct(self.ln_ct2(x_ct))

    def flops(self, T):
        return super().flops(T) + 2 * self.attn.n_chunks(T) * self.attn.m * self.mlp_ct.up.weight.numel() * 2


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
            N = 1 if cache is not None else self.blocks[0].attn.n_chunks(T)
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

def benchmark_layers(kinds, Ts, D=512, H=8, causal=False, window=128, ranks='', n_compressed=64):
    """fwd+bwd of one full attention layer of each kind (projections included), inputs of the same shape."""
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    print(f"one attention layer, fwd+bwd, D = {D}, {H} heads, window {window}, m = {n_compressed}, "
          f"causal = {causal}, on {dev}")
    print(f"{'layer':16s} {'T':>6s} {'ms':>9s} {'x std':>6s} {'peak MB':>8s} {'x std':>6s} {'GFLOP fwd':>10s} "
          f"{'x floor':>8s}   (floor: the layer's FLOPs at the standard layer's FLOP/s)")
    rows = []
    for T in Ts:
        res = {}
        for kind in kinds:
            cfg = ModelConfig(n_layer=1, n_head=H, n_embd=D, block_size=T, causal=causal, attn=kind,
                              window=window, ranks=ranks, n_compressed=n_compressed)
            layer = ATTENTION[kind](cfg).to(dev)
            x = torch.randn(1, T, D, device=dev, requires_grad=True)
            if kind == 'brl':
                ct = torch.randn(1, layer.n_chunks(T), n_compressed, D, device=dev, requires_grad=True)
                step = lambda: sum(t.sum() for t in layer(x, ct)).backward()
            else:
                step = lambda: layer(x).sum().backward()
            res[kind] = kernels.measure(step, reps=1) + (layer.flops(T),)
        b = res[kinds[0]]
        for kind, (ms, mb, fl) in res.items():
            floor = fl / b[2] * b[0]                                  # ms at the first (standard) layer's FLOP/s
            print(f"{kind:16s} {T:6d} {ms:9.1f} {ms / b[0]:6.2f} {mb:8.1f} {mb / max(b[1], 1e-3):6.2f} "
                  f"{fl / 1e9:10.2f} {ms / floor:8.2f}")
            rows.append(dict(layer=kind, T=T, ms=ms, peak_mb=mb, gflop=fl / 1e9, vs_floor=ms / floor))
    return rows


def _lengths(text):
    """--Ts: comma-separated positive sequence lengths."""
    try:
        Ts = [int(t) for t in text.split(',') if t.strip()]
    except ValueError:
        Ts = []
    if not Ts or min(Ts) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers, e.g. 512,1024")
    return Ts


def benchmark_main(argv=None):
    """python attention.py [--brl [--causal]] [--Ts 512,1024]. --brl: one layer of full, local (SWA) and BRL
    attention (seed 004 Figs. 5-6), then how BRL's peak memory grows with n (8k / 1k when both were run):
    linear memory keeps it near the n ratio."""
    from runs import ArgParser
    p = ArgParser(prog='attention.py', description=__doc__)
    p.add_argument('--brl', action='store_true', help='BRL vs full and local attention layers, n = 1k ... 16k')
    p.add_argument('--Ts', type=_lengths, default=None, help="comma list of sequence lengths (default 256,512,1024; "
                   "with --brl 1024 ... 16384)")
    p.add_argument('--causal', action='store_true', help='--brl: causal layers (BRL: the recurrence over chunks)')
    args = p.parse_args(argv)
    if args.causal and not args.brl:
        p.error("--causal goes with --brl (the default benchmark's layers are causal already)")
    if not args.brl and any(T % 8 for T in args.Ts or []):
        p.error(f"--Ts {','.join(map(str, args.Ts))}: multiples of 8 (MLR's 4 levels halve T three times)")
    if not args.brl:
        return benchmark_layers(['standard', 'mlr', 'swa', 'global_swa_split', 'linear', 'bilinear_mlr',
                                 'bilinear_btt', 'brl'],
                                args.Ts or [256, 512, 1024], D=256, H=4, causal=True, ranks='32|16|8|8',
                                n_compressed=16)
    rows = benchmark_layers(['standard', 'swa', 'brl'], args.Ts or [1024, 2048, 4096, 8192, 16384], causal=args.causal)
    mb = {r['T']: r['peak_mb'] for r in rows if r['layer'] == 'brl'}
    lo, hi = (1024, 8192) if {1024, 8192} <= set(mb) else (min(mb), max(mb))
    print(f"brl peak memory ratio {hi}/{lo}: {mb[hi] / max(mb[lo], 1e-3):.2f} (n ratio {hi / lo:g})")
    return rows


if __name__ == '__main__':
    from runs import run_main
    run_main(benchmark_main)
