"""
Structured matrices as linear maps: the families of Table 1 in Kuang et al. (ICML 2025, §3.1 and §3.3, Eqs. 4,
5, 8, App. A) -- Dense, LowRank, BlockDiagonal, LowRankBlockDiagonal, MLR, BTT (Monarch and Kronecker are
special BTTs) and MLBTC (a sum of BTT-like levels).

Every family is an nn.Module mapping (..., d_in) -> (..., d_out) and has
    forward(x)    x @ W.T, never forming W: one einsum per core, O(#params) multiply-adds per vector
    to_dense()    the (d_out, d_in) matrix W, built straight from the definition (for tests / tables)
    num_params    trainable numbers
    macs          multiply-adds of ONE matvec (FlopCounterMode reports 2x this: FLOPs)
    rank          rank of W for generic (random) cores, capped by min(d_in, d_out); the constructor argument
                  `rank` of LowRank / BTT is the family's r or BTT rank s
    bilinear(x,y) the bilinear form x^T W y
Init is muP (paper §3.5, App. E): every core ~ N(0, 1/fan_in) with its own fan_in (the size of the index it
contracts), and every Parameter carries p.lr_mult = base_width / fan_in (base_width defaults to d_in).

    python structured.py                               # Table 1, measured, at 256x256 and 256->512
    python structured.py --d 128 --d_out_rect 384 --out_dir out/structured   # other sizes, + JSON
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

# -----------------------------------------------------------------------------
# helpers: validation, factoring, permutations

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return v


def _blocks(n_blocks, d_in, d_out):
    """(p, d_in / p, d_out / p) of a block-diagonal map with p = n_blocks blocks."""
    _positive_int('n_blocks', n_blocks)
    if d_in % n_blocks or d_out % n_blocks:
        raise ValueError(f"n_blocks={n_blocks} must divide both d_in={d_in} and d_out={d_out}; "
                         f"valid block counts: {divisors(math.gcd(d_in, d_out))}")
    return n_blocks, d_in // n_blocks, d_out // n_blocks


def sqrt_factors(n):
    """(a, b) with a * b = n, a >= b, b the largest divisor <= sqrt(n): 256 -> (16, 16), 512 -> (32, 16)."""
    b = max(d for d in divisors(n) if d * d <= n)
    return n // b, b


def _check_factors(name, factors, dim_name, dim):
    if factors is None:
        return sqrt_factors(dim)
    f = tuple(factors)
    if (len(f) != 2 or any(isinstance(a, bool) or not isinstance(a, int) or a <= 0 for a in f)
            or f[0] * f[1] != dim):
        raise ValueError(f"{name}={f} must be two positive ints whose product is {dim_name}={dim}, "
                         f"e.g. {sqrt_factors(dim)}; first factor can be any of {divisors(dim)}")
    return f


def transpose_perm(a, b):
    """Permutation of range(a*b) that re-reads an (a, b) grid as (b, a): perm[y*a + x] = x*b + y.
    v[..., perm] turns a vector laid out (x, y)-major into one laid out (y, x)-major."""
    return torch.arange(a * b).view(a, b).t().reshape(-1)


def _check_perm(name, perm, dim):
    if perm is None:
        return None
    p = torch.as_tensor(perm, dtype=torch.long).reshape(-1)
    if p.numel() != dim or not torch.equal(p.sort().values, torch.arange(dim)):
        shown = p.tolist() if p.numel() <= 16 else f"{p.tolist()[:16]}..."
        raise ValueError(f"{name}={shown} must be a permutation of range({dim}) (or None for identity)")
    return p


# -----------------------------------------------------------------------------
# base class: muP cores, input check, shared properties

class StructuredLinear(nn.Module):
    def __init__(self, d_in, d_out, base_width=None):
        super().__init__()
        self.d_in = _positive_int('d_in', d_in)
        self.d_out = _positive_int('d_out', d_out)
        self.base_width = d_in if base_width is None else base_width
        if not self.base_width > 0:
            raise ValueError(f"base_width={base_width!r} must be > 0 (the width at which lr_mult = 1)")

    def core(self, shape, fan_in):
        """A muP core: entries N(0, 1/fan_in), tagged with p.lr_mult = base_width / fan_in."""
        p = nn.Parameter(torch.randn(*shape) / math.sqrt(fan_in))
        p.lr_mult = self.base_width / fan_in
        return p

    def check_input(self, x):
        if x.shape[-1] != self.d_in:
            raise ValueError(f"{type(self).__name__} expects inputs of shape (..., d_in={self.d_in}), "
                             f"got {tuple(x.shape)}")

    @property
    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def bilinear(self, x, y):
        """x^T W y for x (..., d_out), y (..., d_in) -> (...,), at the cost of one structured matvec."""
        return (x * self(y)).sum(-1)

    def extra_repr(self):
        return f"d_in={self.d_in}, d_out={self.d_out}, params={self.num_params}, rank={self.rank}"


# -----------------------------------------------------------------------------
# dense, low rank, block diagonal, low-rank block diagonal

class Dense(StructuredLinear):
    """W (d_out, d_in). params d_in*d_out, rank min(d_in, d_out)."""

    def __init__(self, d_in, d_out, base_width=None):
        super().__init__(d_in, d_out, base_width)
        self.weight = self.core((d_out, d_in), fan_in=d_in)
        self.macs, self.rank = d_in * d_out, min(d_in, d_out)

    def forward(self, x):
        self.check_input(x)
        return x @ self.weight.t()

    def to_dense(self):
        return self.weight


class LowRank(StructuredLinear):
    """W = L R^T with L (d_out, r), R (d_in, r). params (d_in + d_out) r, rank min(r, d_in, d_out)."""

    def __init__(self, d_in, d_out, rank, base_width=None):
        super().__init__(d_in, d_out, base_width)
        self.r = _positive_int('rank', rank)
        self.R = self.core((d_in, rank), fan_in=d_in)   # applied first: contracts the d_in input
        self.L = self.core((d_out, rank), fan_in=rank)  # contracts the r latent features
        self.macs, self.rank = rank * (d_in + d_out), min(rank, d_in, d_out)

    def forward(self, x):
        self.check_input(x)
        return (x @ self.R) @ self.L.t()                # (..., r) -> (..., d_out)

    def to_dense(self):
        return self.L @ self.R.t()


class BlockDiagonal(StructuredLinear):
    """W = ⊕_k W_k, W_k (d_out/p, d_in/p); `weight` is (p, d_out/p, d_in/p) and block k's outputs are
    contiguous (out index k*(d_out/p) + i). params d_in*d_out/p, rank min(d_in, d_out)."""

    def __init__(self, d_in, d_out, n_blocks, base_width=None):
        super().__init__(d_in, d_out, base_width)
        self.p, self.bi, self.bo = _blocks(n_blocks, d_in, d_out)
        self.weight = self.core((self.p, self.bo, self.bi), fan_in=self.bi)
        self.macs, self.rank = self.p * self.bo * self.bi, self.p * min(self.bo, self.bi)

    def forward(self, x):
        self.check_input(x)
        x = x.reshape(*x.shape[:-1], self.p, self.bi)              # (..., p, bi)
        y = torch.einsum('...kj,kij->...ki', x, self.weight)       # (..., p, bo)
        return y.reshape(*y.shape[:-2], self.d_out)                # (..., d_out)

    def to_dense(self):
        return torch.block_diag(*self.weight)


class LowRankBlockDiagonal(StructuredLinear):
    """W = ⊕_k L_k R_k^T, L (p, d_out/p, r), R (p, d_in/p, r); block k's outputs contiguous.
    params (d_in + d_out) r, rank p * min(r, d_in/p, d_out/p)."""

    def __init__(self, d_in, d_out, n_blocks, rank, base_width=None):
        super().__init__(d_in, d_out, base_width)
        self.p, self.bi, self.bo = _blocks(n_blocks, d_in, d_out)
        self.r = _positive_int('rank', rank)
        self.R = self.core((self.p, self.bi, rank), fan_in=self.bi)
        self.L = self.core((self.p, self.bo, rank), fan_in=rank)
        self.macs, self.rank = self.p * rank * (self.bi + self.bo), self.p * min(rank, self.bi, self.bo)

    def forward(self, x):
        self.check_input(x)
        x = x.reshape(*x.shape[:-1], self.p, self.bi)              # (..., p, bi)
        h = torch.einsum('...kj,kjr->...kr', x, self.R)            # (..., p, r)
        y = torch.einsum('...kr,kir->...ki', h, self.L)            # (..., p, bo)
        return y.reshape(*y.shape[:-2], self.d_out)                # (..., d_out)

    def to_dense(self):
        return torch.block_diag(*(self.L @ self.R.transpose(1, 2)))  # blocks (p, bo, bi)


# -----------------------------------------------------------------------------
# MLR: a sum of low-rank block-diagonal levels

def parse_ranks(ranks):
    """'8|4|2|2' or [8, 4, 2, 2] -> [8, 4, 2, 2]."""
    if isinstance(ranks, str):
        try:
            ranks = [int(r) for r in ranks.split('|')]
        except ValueError:
            raise ValueError(f"ranks={ranks!r} must look like '8|4|2|2' (integers joined by '|')") from None
    return list(ranks)


class MLR(StructuredLinear):
    """W = Σ_l ⊕_{k=1}^{p_l} L_{l,k} R_{l,k}^T, level l a LowRankBlockDiagonal with p_l blocks and rank
    r_l (default p_l = 2**l). Access the cores as mlr.levels[l].L (p, bo, r) / .R (p, bi, r).
    params (d_in + d_out) Σ r_l, rank min(Σ_l p_l min(r_l, block dims), d_in, d_out): an upper bound
    that random cores attained in every case tried (nested p_l = 2**l and not), not proven in general."""

    def __init__(self, d_in, d_out, ranks, n_blocks=None, base_width=None):
        super().__init__(d_in, d_out, base_width)
        ranks = parse_ranks(ranks)
        if not ranks:
            raise ValueError("ranks=[] must list at least one level rank, e.g. [8, 4, 2, 2]")
        n_blocks = [2 ** l for l in range(len(ranks))] if n_blocks is None else list(n_blocks)
        if len(n_blocks) != len(ranks):
            raise ValueError(f"n_blocks={n_blocks} must have one entry per level, like ranks={ranks}")
        self.levels = nn.ModuleList()
        for l, (r, p) in enumerate(zip(ranks, n_blocks)):
            try:
                self.levels.append(LowRankBlockDiagonal(d_in, d_out, p, r, base_width=self.base_width))
            except ValueError as e:
                raise ValueError(f"MLR level {l} (ranks={ranks}, n_blocks={n_blocks}): {e}") from None
        self.ranks, self.n_blocks = ranks, n_blocks
        self.macs = sum(level.macs for level in self.levels)
        self.rank = min(sum(level.rank for level in self.levels), d_in, d_out)

    def forward(self, x):
        self.check_input(x)
        return sum(level(x) for level in self.levels)

    def to_dense(self):
        return sum(level.to_dense() for level in self.levels)


# -----------------------------------------------------------------------------
# BTT: block tensor train with two cores (Monarch, Kronecker, low rank as special cases)

class BTT(StructuredLinear):
    """Input index (k, j), k < c1, j < c2; output index (m, i), m < e1, i < e2; BTT rank s (paper Eq. 5):
        h[k, i, ρ] = Σ_j R[k, i, ρ, j] x[k, j]            right core, block-diagonal over k
        y[m, i]    = Σ_{k,ρ} L[i, m, k, ρ] h[k, i, ρ]     left core, block-diagonal over i
    i.e. W = P_L (⊕_i L_i) P_R (⊕_k R_k^T), the reshapes being the permutations.
    block_coupled=True keeps only k = i (needs c1 = e2): then R is stored as (c1, s, c2) and L as
    (e2, e1, s), and W is low-rank block diagonal with c1 blocks whose outputs are strided (m*e2 + i);
    this is the MLBTC level that makes MLR.
    params s(d_in e2 + d_out c1) (= 2 D^1.5 s at sqrt factors), rank min(d_in, d_out, c1 e2 s); block-coupled:
    params s(d_in + d_out), rank c1 min(s, c2, e1)."""

    def __init__(self, d_in, d_out, rank=1, in_factors=None, out_factors=None, block_coupled=False,
                 base_width=None):
        super().__init__(d_in, d_out, base_width)
        self.s = _positive_int('rank', rank)
        self.c1, self.c2 = _check_factors('in_factors', in_factors, 'd_in', d_in)
        self.e1, self.e2 = _check_factors('out_factors', out_factors, 'd_out', d_out)
        self.block_coupled = bool(block_coupled)
        c1, c2, e1, e2, s = self.c1, self.c2, self.e1, self.e2, self.s
        if self.block_coupled:
            if c1 != e2:
                raise ValueError(f"block_coupled BTT needs c1 == e2 (one left block per right block), got "
                                 f"in_factors={(c1, c2)}, out_factors={(e1, e2)}")
            self.R = self.core((c1, s, c2), fan_in=c2)         # R[k, ρ, j]  (= full R[k, i=k, ρ, j])
            self.L = self.core((e2, e1, s), fan_in=s)          # L[i, m, ρ]  (= full L[i, m, k=i, ρ])
        else:
            self.R = self.core((c1, e2, s, c2), fan_in=c2)     # R[k, i, ρ, j]
            self.L = self.core((e2, e1, c1, s), fan_in=c1 * s)  # L[i, m, k, ρ]
        # every core entry is used once per vector; the rank of a block-coupled BTT: c1 blocks (e1 x c2) of rank
        # <= s; of a dense one, the min vertex cut of the layered network d_in | c1 e2 s middle h[k, i, ρ] | d_out
        self.macs = s * (d_in + d_out) if self.block_coupled else s * (d_in * e2 + d_out * c1)
        self.rank = c1 * min(s, c2, e1) if self.block_coupled else min(d_in, d_out, c1 * e2 * s)

    @classmethod
    def monarch(cls, d_in, d_out, in_factors=None, out_factors=None, base_width=None):
        """Monarch (Dao et al. 2022) = BTT with s = 1."""
        return cls(d_in, d_out, 1, in_factors, out_factors, base_width=base_width)

    @classmethod
    def kronecker(cls, A, B, base_width=None):
        """The BTT whose to_dense() is torch.kron(A, B): s = 1, L[i, m, k] = A[m, k], R[k, i, j] = B[i, j].
        (Stores A e2 times and B c1 times: a BTT has more freedom than a Kronecker product.)"""
        if A.dim() != 2 or B.dim() != 2:
            raise ValueError(f"kronecker needs two matrices, got shapes {tuple(A.shape)} and {tuple(B.shape)}")
        (a1, a2), (b1, b2) = A.shape, B.shape
        btt = cls(a2 * b2, a1 * b1, 1, (a2, b2), (a1, b1), base_width=base_width).to(A.device, A.dtype)
        with torch.no_grad():
            btt.L.copy_(A[None, :, :, None].expand(b1, a1, a2, 1))   # (e2, e1, c1, 1)
            btt.R.copy_(B[None, :, None, :].expand(a2, b1, 1, b2))   # (c1, e2, 1, c2)
        return btt

    def forward(self, x):
        self.check_input(x)
        x = x.reshape(*x.shape[:-1], self.c1, self.c2)                # (..., c1, c2)  x[k, j]
        if self.block_coupled:
            h = torch.einsum('...kj,krj->...kr', x, self.R)            # (..., c1, s)   only i = k
            y = torch.einsum('...ir,imr->...mi', h, self.L)            # (..., e1, e2)
        else:
            h = torch.einsum('...kj,kirj->...kir', x, self.R)          # (..., c1, e2, s)
            y = torch.einsum('...kir,imkr->...mi', h, self.L)          # (..., e1, e2)
        return y.reshape(*y.shape[:-2], self.d_out)                    # (..., d_out), index m*e2 + i

    def to_dense(self):
        R, L = self.R, self.L
        if self.block_coupled:  # the full R[k, i, ρ, j], L[i, m, k, ρ] of the class docstring: zero unless k = i
            eye = torch.eye(self.c1, dtype=R.dtype, device=R.device)
            R, L = torch.einsum('krj,ki->kirj', R, eye), torch.einsum('imr,ik->imkr', L, eye)
        W = torch.einsum('imkr,kirj->mikj', L, R)      # W[(m, i), (k, j)] = Σ_ρ L[i,m,k,ρ] R[k,i,ρ,j]
        return W.reshape(self.d_out, self.d_in)


monarch = BTT.monarch
kronecker = BTT.kronecker


# -----------------------------------------------------------------------------
# MLBTC: a sum of BTT-like levels with fixed permutations

@dataclass
class Level:
    """One MLBTC level: y += BTT_l(x[..., in_perm])[..., out_perm] (None = identity permutation)."""
    in_factors: tuple
    out_factors: tuple
    rank: int = 1
    block_coupled: bool = False
    in_perm: list = None
    out_perm: list = None


class MLBTC(StructuredLinear):
    """Multi-level block tensor contraction (paper §3.3, Eq. 8, as read here; see README): W = Σ_l P_out,l W_l
    P_in,l, each W_l a BTT with its own (c1, c2, e1, e2, s), dense- or block-coupled. MLR = all levels
    block-coupled with c1 = e2 = p_l, s = r_l and an output transpose (MLBTC.from_mlr); BTT = one level
    (MLBTC.from_btt). params and macs sum over levels; rank = min(Σ_l rank_l, d_in, d_out), an upper bound
    that random cores attain in the settings tested."""

    def __init__(self, d_in, d_out, levels, base_width=None):
        super().__init__(d_in, d_out, base_width)
        if not levels:
            raise ValueError("levels=[] must list at least one Level(in_factors, out_factors, rank, ...)")
        self.levels = nn.ModuleList()
        for l, lv in enumerate(levels):
            lv = Level(**lv) if isinstance(lv, dict) else lv
            try:
                self.levels.append(BTT(d_in, d_out, lv.rank, lv.in_factors, lv.out_factors,
                                       lv.block_coupled, base_width=self.base_width))
                in_perm = _check_perm('in_perm', lv.in_perm, d_in)
                out_perm = _check_perm('out_perm', lv.out_perm, d_out)
            except ValueError as e:
                raise ValueError(f"MLBTC level {l}: {e}") from None
            # fixed by the config, so not saved in state_dict
            self.register_buffer(f'in_perm_{l}', in_perm, persistent=False)
            self.register_buffer(f'out_perm_{l}', out_perm, persistent=False)
        self.macs = sum(btt.macs for btt in self.levels)
        self.rank = min(sum(btt.rank for btt in self.levels), d_in, d_out)

    def perms(self, l):
        return getattr(self, f'in_perm_{l}'), getattr(self, f'out_perm_{l}')

    @classmethod
    def from_mlr(cls, mlr):
        """The MLBTC equal to `mlr`, cores copied: level l block-coupled, c1 = e2 = p_l, s = r_l."""
        levels = [Level((lv.p, lv.bi), (lv.bo, lv.p), lv.r, block_coupled=True,
                        out_perm=transpose_perm(lv.bo, lv.p))   # (m, k)-major -> block k contiguous
                  for lv in mlr.levels]
        ref = mlr.levels[0].R
        m = cls(mlr.d_in, mlr.d_out, levels, base_width=mlr.base_width).to(ref.device, ref.dtype)
        with torch.no_grad():
            for btt, lv in zip(m.levels, mlr.levels):
                btt.R.copy_(lv.R.transpose(1, 2))   # (p, r, bi)  R[k, ρ, j]
                btt.L.copy_(lv.L)                   # (p, bo, r)  L[i, m, ρ]
        return m

    @classmethod
    def from_btt(cls, btt):
        """The one-level MLBTC equal to `btt`, cores copied."""
        level = Level((btt.c1, btt.c2), (btt.e1, btt.e2), btt.s, btt.block_coupled)
        m = cls(btt.d_in, btt.d_out, [level], base_width=btt.base_width).to(btt.R.device, btt.R.dtype)
        with torch.no_grad():
            m.levels[0].R.copy_(btt.R)
            m.levels[0].L.copy_(btt.L)
        return m

    def forward(self, x):
        self.check_input(x)
        y = 0
        for l, btt in enumerate(self.levels):
            in_perm, out_perm = self.perms(l)
            y_l = btt(x if in_perm is None else x[..., in_perm])        # (..., d_out) level layout
            y = y + (y_l if out_perm is None else y_l[..., out_perm])
        return y

    def to_dense(self):
        W = 0
        for l, btt in enumerate(self.levels):
            in_perm, out_perm = self.perms(l)
            W_l = btt.to_dense()
            if out_perm is not None:
                W_l = W_l[out_perm]                                     # row o <- level row out_perm[o]
            if in_perm is not None:
                W_l = torch.zeros_like(W_l).index_copy(1, in_perm, W_l)  # column in_perm[j] <- level col j
            W = W + W_l
        return W


# -----------------------------------------------------------------------------
# Table 1, measured: python structured.py

def table_rows(d_in, d_out, r=16, p=4, mlr_ranks=(8, 4, 2, 2)):
    """(name, module, params by the paper's formula, rank by the paper's formula) for one shape.
    Formulas are the paper's Table 1 written for rectangular shapes (App. A)."""
    lo, d_sum = min(d_in, d_out), d_in + d_out
    rows = [('dense', Dense(d_in, d_out), d_in * d_out, lo),
            (f'low rank r={r}', LowRank(d_in, d_out, r), d_sum * r, r),
            (f'block diag p={p}', BlockDiagonal(d_in, d_out, p), d_in * d_out // p, lo),
            (f'low-rank block diag p={p} r={r}', LowRankBlockDiagonal(d_in, d_out, p, r), d_sum * r, p * r)]
    mlr = MLR(d_in, d_out, list(mlr_ranks))
    rows.append((f"MLR {'|'.join(map(str, mlr_ranks))}", mlr, d_sum * sum(mlr_ranks),
                 sum(rl * 2 ** l for l, rl in enumerate(mlr_ranks))))
    for s in (1, 2):
        btt = BTT(d_in, d_out, s)
        name = f'BTT s={s}' + (' (= Monarch)' if s == 1 else '')
        square = d_in == d_out and math.isqrt(d_in) ** 2 == d_in
        rows.append((name, btt, 2 * math.isqrt(d_in) ** 3 * s if square        # 2 D^1.5 s (Table 1)
                     else s * (d_in * btt.e2 + d_out * btt.c1), lo))           # rectangular (App. A.2)
    (c1, c2), (e1, e2) = sqrt_factors(d_in), sqrt_factors(d_out)
    A, B = torch.randn(e1, c1), torch.randn(e2, c2)
    rows.append((f'Kronecker {e1}x{c1} (x) {e2}x{c2}', BTT.kronecker(A, B), e1 * c1 + e2 * c2,
                 min(e1, c1) * min(e2, c2)))
    mlbtc = MLBTC(d_in, d_out, [Level((c1, c2), (e1, e2), 1),   # a Monarch level
                                Level((p, d_in // p), (d_out // p, p), r // 2, block_coupled=True,
                                      out_perm=transpose_perm(d_out // p, p))])  # + LRBD level
    rows.append((f'MLBTC Monarch + LRBD p={p} r={r // 2}', mlbtc,
                 d_in * e2 + d_out * c1 + d_sum * (r // 2), lo))
    return rows


if __name__ == '__main__':
    from torch.utils.flop_counter import FlopCounterMode

    from runs import ArgParser        # one-line errors, as the train scripts'
    parser = ArgParser(prog='structured.py', description='Table 1 of Kuang et al. 2025, measured on this machine.')
    # shapes
    parser.add_argument('--d', type=int, default=256, help='square size D (also d_in of the rectangular case)')
    parser.add_argument('--d_out_rect', type=int, default=512, help='d_out of the rectangular case')
    # family settings
    parser.add_argument('--r', type=int, default=16, help='rank r of low rank / low-rank block diag')
    parser.add_argument('--p', type=int, default=4, help='number of blocks p of (low-rank) block diag')
    parser.add_argument('--mlr_ranks', type=str, default='8|4|2|2', help='MLR ranks r_l, p_l = 2**l')
    # run
    parser.add_argument('--seed', type=int, default=0, help='random seed for the cores')
    parser.add_argument('--device', type=str, default='cpu', help="'cpu' only: tables are float64 on CPU")
    parser.add_argument('--out_dir', type=str, default='', help="if set, write table.json there")
    args = parser.parse_args()
    if args.device != 'cpu':
        parser.error(f"--device={args.device!r}: this table runs in float64 on cpu; use --device cpu")
    if args.out_dir:    # checked before the work, not after it
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as e:
            parser.error(f"--out_dir {args.out_dir!r} cannot be created: {e.strerror}")
        if not os.access(args.out_dir, os.W_OK):
            parser.error(f"--out_dir {args.out_dir!r} cannot be written")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    try:    # a size the families refuse (e.g. --p not dividing --d) is one line, not a traceback
        rows = {(d_in, d_out): table_rows(d_in, d_out, args.r, args.p, parse_ranks(args.mlr_ranks))
                for d_in, d_out in [(args.d, args.d), (args.d, args.d_out_rect)]}
    except ValueError as e:
        parser.error(str(e))

    results = []
    for (d_in, d_out), table in rows.items():
        print(f"\n{d_in} -> {d_out}   (MACs = multiply-adds of one matvec; FlopCounterMode/2;"
              f" rank = torch.linalg.matrix_rank in float64)")
        print(f"{'family':<34}{'params':>8}{'formula':>9}{'MACs':>8}{'measured':>9}{'rank':>6}"
              f"{'formula':>8}{'measured':>9}")
        for name, m, params_formula, rank_formula in table:
            m = m.double()
            with torch.no_grad():
                # FlopCounterMode counts 2 per multiply-add, and only matmul-like ops: an einsum contracting a
                # size-1 index (r = 1 in a block-coupled level) runs as an elementwise product and is not counted
                with FlopCounterMode(display=False) as counter:
                    m(torch.randn(1, d_in, dtype=torch.float64))
                macs, rank = counter.get_total_flops() // 2, int(torch.linalg.matrix_rank(m.to_dense()))
            print(f"{name:<34}{m.num_params:>8}{params_formula:>9}{m.macs:>8}{macs:>9}{m.rank:>6}"
                  f"{rank_formula:>8}{rank:>9}")
            results.append(dict(d_in=d_in, d_out=d_out, family=name, params=m.num_params,
                                params_formula=params_formula, macs=m.macs, macs_measured=macs,
                                rank=m.rank, rank_formula=rank_formula, rank_measured=rank))
    print("\nKronecker: 'params' counts what the BTT stores (A repeated per i, B per k); 'formula' "
          "counts the free numbers of A and B.")
    if args.out_dir:
        from runs import write_json
        path = os.path.join(args.out_dir, 'table.json')
        write_json(path, results)
        print(f"wrote {path}")
