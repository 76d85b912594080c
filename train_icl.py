"""
In-context linear regression (Garg et al. 2022) with any attention from the registry: the low-rank
bottleneck of multi-head attention (Kuang et al. ICML 2025, §2.2 and §4, Figs. 2-3) and linear vs
quadratic attention (seed 003 §2). Task: paper §4 and seed 003 §2.1; muP: paper App. E.

Each prompt draws a fresh w ~ N(0, I_d); x_i ~ N(0, Σ); y_i = w·x_i (+ optional label noise). The
tokens interleave x_1, [y_1, 0, .., 0], x_2, [y_2, 0, .., 0], ...; one Linear(d -> D) reads them in,
the causal Transformer body mixes them, and a zero-init Linear(D -> 1) reads out at every x position,
so ŷ_i predicts y_i from (x_1, y_1, .., x_{i-1}, y_{i-1}, x_i). Training loss: MSE over all positions,
with Garg's curriculum (d and N grow during training). Evaluation: normalized squared error
(ŷ - y)² / d per position on held-out prompts from a separate generator seed, with bootstrap
intervals, next to the classical baselines on the same prompts (least squares, averaging, 3-NN, zero).

The defaults are the official ICL runs' settings (MODEL_DEFAULTS, DEFAULTS) at CPU scale: d = 5, D = 32, 2000 steps.
  python train_icl.py --attn standard --n_head 1 --n_embd 32             # one model (about 50 s of CPU)
  python train_icl.py --attn bilinear_btt --n_head 8 --n_embd 64 --d 16 --max_iters 20000   # a bigger one
  python train_icl.py --sweep bottleneck   # Fig. 2/3a: error at N = 2d vs width (8-head, 1-head, bilinear BTT/MLR)
  python train_icl.py --sweep bottleneck --quick   # its short version (one width, one seed; estimate printed)
  python train_icl.py --sweep bottleneck --d 8 --out_dir out/icl_d8   # the same at d = 8 (LARGER_D_RECIPE)
  python train_icl.py --sweep compute      # Fig. 3b: error at N = 2d vs training FLOPs at one width
  python train_icl.py --sweep linear       # seed 003: softmax vs linear attention, depths 1/3/6, d = 5
A run writes a JSON and a checkpoint to --out_dir. A sweep trains each (point, seed) as a run of its own in
<out_dir>/<run>/ (runs.sweep), reusing finished runs, with its CPU recipe (SWEEP_RECIPE, docs/icl.md).
"""
import argparse
import collections
import copy
import functools
import glob
import math
import os
import shutil
import time

# runs first: before torch loads, it sets OpenMP's wait policy and a start-up Ctrl-C handler
import runs
from runs import (FORMAT, ArgParser, Interrupted, add_model_args, check_numbers, check_mode_flags, check_ranges,
                  clear_earlier_run, ctrl_c_finishes_step, given_flags, group_flags, guarded_update, io_errors,
                  load_checkpoint, no_repeats, owns_run_folders, physical_memory, pick_device, prepare_out_dir,
                  read_json, report_outputs, resume_settings, rng_state, run_main, save_checkpoint, set_rng_state,
                  write_json)

import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

matplotlib.use('Agg')                                 # plots are files: no display needed
import matplotlib.pyplot as plt  # noqa: E402

import attention
from attention import ATTENTION, MupLinear, Transformer, optimizer_groups, parse_ints

SCRIPT = 'train_icl.py'
ATTN_NAMES = list(ATTENTION) + ['global_swa']

# -----------------------------------------------------------------------------
# Defaults: the official ICL runs' settings with their sources ("official": the paper's public code,
# scripts/icl_regression/submit_icl_regression.sh over train_ICL.py, src/model.py, src/muP.py), at CPU scale.

MODEL_DEFAULTS = dict(      # the model group's defaults where they differ from attention.ModelConfig's
    n_embd=32,               # CPU scale (official: D = 16 ... 1024)
    n_layer=6,               # train_ICL.py --n_layer default 6
    n_head=8,                # submit script n_head=8
    qk_ln=True,              # train_ICL.py --do_qk_ln default True
    logit_scale='sqrt',      # standard 1/sqrt(d) (mha_SP_attn_logits_scaling=True), bilinear MLR 1/sqrt(p_l r_l),
                             # BTT 1/sqrt(D) (both muP flags False): 'sqrt' of each term's width
    bilinear_rms_cap=True,   # src/model.py: W / max(1, RMS(W) / s0) on every bilinear map (`if True:`)
    btt_factors='official',  # src/model.py BilinearBTTAttention.factorize (256 -> 8 x 32)
    btt_rank=1,              # train_ICL.py --btt_tt_rank default 1
    mup_base_width=768,      # src/muP.py: base_width_factor = 768 (lr x 768 / fan_in)
    window=16,               # not in the official ICL runs (no SWA / BRL there): a look-back of 8 (x, y) pairs
    global_layers='0',       # not in the official ICL runs: global_swa's one standard layer, the first
)
DEFAULTS = dict(
    # CPU scale (official: d = 16 / 64 / 256, 500 001 steps, lr swept per width)
    d=5, max_iters=2000,
    lr=1e-4,                 # in every official lr grid (standard, bilinear MLR, BTT), at the official base width
    n_points=0,              # 0 = 2d pairs: train_ICL.py main, n_positions = 2 * n_dims
    # curriculum: train_ICL.py defaults (dims from 4, points from 8, every 2000 steps, adaptive increments that
    # finish within 6 % of the steps); the interval shrinks with the run (curr_interval 0 = 2000 * steps / 500001)
    curr_d_start=4, curr_n_start=8, curr_interval=0, curr_ratio=0.06,
    read_in_std=0.02,        # src/muP.py: _read_in N(0, 0.02^2), lr x 1
    pos_std=0.02,            # src/muP.py: wpe N(0, 0.02^2)
    batch_size=64,           # train_ICL.py --training_batch_size default 64
    weight_decay=0.0,        # train_ICL.py --weight_decay default 0.0
    adam_eps=1e-20,          # src/muP.py AdamW eps; betas (0.9, 0.95) = train_ICL.py --beta1 / --beta2
    warmup_iters=1000,       # train_ICL.py train: warmup_iters = 1000
    lr_schedule='constant',  # train_ICL.py train: get_lr_mult(.., lr, lr, ..): min_lr = lr
    grad_clip=0.0,           # train_ICL.py train_step: no clipping
)

# -----------------------------------------------------------------------------
# Command line

def build_parser():
    p = ArgParser(prog=SCRIPT, description=__doc__.split('\n\n')[0])  # one-line errors, defaults in --help
    bool_flag = argparse.BooleanOptionalAction
    g = p.add_argument_group('task (paper §4, seed 003 §2.1)')
    g.add_argument('--d', type=int, help='input dimension of x and w')
    g.add_argument('--n_points', type=int, help='(x, y) pairs per prompt N; 0 = 2d (the official prompt length)')
    g.add_argument('--train_cov', type=str, default='iso', help="x's covariance: iso, aniso or variances")
    g.add_argument('--test_cov', type=str, default='aniso', help="second (shifted) test covariance; '' = none")
    g.add_argument('--noise_std', type=float, default=0.0, help='label noise y = w·x + noise_std·ε (train and test)')
    g = p.add_argument_group('curriculum (the official adaptive one: +k dimensions and +2k points every interval)')
    g.add_argument('--curriculum', action=bool_flag, default=True, help='grow the active dimensions and N')
    g.add_argument('--curr_d_start', type=int, help='active dimensions at step 0 (capped at --d)')
    g.add_argument('--curr_n_start', type=int, help='prompt length at step 0 (capped at N)')
    g.add_argument('--curr_interval', type=int, help='steps between increments; 0 = 2000 x --max_iters / 500001')
    g.add_argument('--curr_ratio', type=float, help='share of the steps within which the curriculum ends')
    add_model_args(p, **MODEL_DEFAULTS)   # attention.ModelConfig's fields, the same in every train script
    g = p.add_argument_group('model, this task (read-in and positions around the attention.Transformer body)')
    g.add_argument('--read_in_std', type=float, help='init std of the read-in Linear(d -> D) (0 = 1/sqrt(d))')
    g.add_argument('--pos_std', type=float, help='init std of the learned position embedding')
    g = p.add_argument_group('optimization')
    g.add_argument('--max_iters', type=int, help='training steps')
    g.add_argument('--batch_size', type=int, help='prompts per step')
    g.add_argument('--lr', type=float, help='base AdamW learning rate (at --mup_base_width under muP)')
    g.add_argument('--mup', action=bool_flag, default=True, help='muP learning rates lr x mup_base_width / fan_in')
    g.add_argument('--weight_decay', type=float, help='AdamW weight decay (matrices only)')
    g.add_argument('--adam_eps', type=float, help='AdamW eps (betas 0.9, 0.95)')
    g.add_argument('--warmup_iters', type=int, help='linear warmup steps')
    g.add_argument('--lr_schedule', type=str, choices=['cosine', 'constant'], help='after warmup: cosine to 10%%')
    g.add_argument('--grad_clip', type=float, help='max grad norm (0 = off)')
    g = p.add_argument_group('evaluation')
    g.add_argument('--eval_seed', type=int, default=-1, help='seed of the held-out prompts; -1 = seed + 1000003')
    g.add_argument('--n_eval', type=int, default=1000, help='held-out prompts for the final evaluation')
    g.add_argument('--eval_interval', type=int, default=100, help='steps between evaluations (0 = end only)')
    g.add_argument('--n_eval_during', type=int, default=256, help='held-out prompts used during training')
    g.add_argument('--n_boot', type=int, default=1000, help='bootstrap resamples for the 95%% intervals')
    g = p.add_argument_group('sweeps (each writes <out_dir>/sweep_<name>.json and icl_<name>.png)')
    g.add_argument('--sweep', type=str, default='', choices=['', *SWEEPS], help="a paper figure's sweep, not one run")
    g.add_argument('--widths', type=str, default='16,32,64', help='bottleneck: model widths D')
    g.add_argument('--full_rank_widths', type=str, default='', help='bottleneck: widths of 1 head, BTT, MLR ("" = all)')
    g.add_argument('--full_rank_models', type=str, default=','.join(FULL_RANK_MODELS), help='bottleneck: which')
    g.add_argument('--width_lrs', type=str, default='', help="bottleneck: the lr at these widths, 'width:lr,...'")
    g.add_argument('--bottleneck_ranks', type=str, default='4:1|1|2,8:4|2|1|1', help="'head width:MLR ranks,...'")
    g.add_argument('--compute_width', type=int, default=64, help='compute: the one width D')
    # not '2|2|2|2': level 0 would LayerNorm 2 features (a sign, no gradient; bottleneck_mlr_ranks)
    g.add_argument('--compute_ranks', type=str, default='4|2|1|1,4|4', help='compute: bilinear-MLR ranks, one run each')
    g.add_argument('--linear_width', type=int, default=64, help='linear: width D (seed 003 used 256)')
    g.add_argument('--depths', type=str, default='1,3,6', help='linear: depths')
    g.add_argument('--workers', type=int, default=2, help='parallel run processes of 1 thread (0 = in this process)')
    g.add_argument('--seeds', type=int, default=3, help='training seeds per point (--seed, --seed + 1, ...)')
    g.add_argument('--quick', action='store_true', help='the short version (QUICK); flags given still win')
    g.add_argument('--reuse', action=bool_flag, default=True, help='keep finished runs, resume cut-off ones')
    g = p.add_argument_group('system / io')
    g.add_argument('--out_dir', type=str, default='out/icl', help="results, checkpoint (a sweep: a folder per run)")
    g.add_argument('--run_name', type=str, default='', help="<run_name>.json / .pt ('' = icl_<attn>_H<n_head>_D<n>)")
    g.add_argument('--assets_dir', type=str, default='', help="sweeps copy their PNG and JSON here ('' = don't)")
    g.add_argument('--resume', action='store_true', help='continue <out_dir>/<run>.pt (check_resume)')
    g.add_argument('--overwrite', action='store_true', help="replace the earlier run's files in --out_dir")
    g.add_argument('--device', type=str, default='auto', help="'auto' (cuda if available else cpu), 'cpu', 'cuda'")
    g.add_argument('--seed', type=int, default=0, help='seed of the model init and the training prompts')
    g.add_argument('--threads', type=int, default=1, help='torch threads (0 = one per core; tiny models gain little)')
    g.add_argument('--log_interval', type=int, default=100, help='steps between log lines')
    g.add_argument('--progress', action=bool_flag, default=True, help='tqdm progress bar')
    g.add_argument('--save', action=bool_flag, default=True, help='write <out_dir>/<run>.pt at every evaluation')
    p.set_defaults(**DEFAULTS)
    return p


def resolve(args):
    """Fill the derived defaults (N = 2d, the eval seed) and check the task settings (the body checks its own)."""
    args = copy.copy(args)
    args.format = FORMAT                        # saved with the run: a run of another version is refused
    args.n_points = args.n_points or 2 * args.d
    if args.n_points < 2 * args.d:
        raise ValueError(f'--n_points {args.n_points} with --d {args.d}: the error at N = 2d needs N >= 2d = '
                         f'{2 * args.d} points per prompt (0 = 2d)')
    if args.eval_seed < 0:
        args.eval_seed = args.seed + 1000003
    if args.seed in (args.eval_seed, args.eval_seed + SHIFTED_SEED_OFFSET):
        raise ValueError(f'--eval_seed {args.eval_seed} collides with --seed {args.seed}: held-out prompts need '
                         f'their own stream (eval_seed and eval_seed + {SHIFTED_SEED_OFFSET} are taken)')
    covariance_scale(args.train_cov, args.d), covariance_scale(args.test_cov, args.d)  # validate early
    return args

# -----------------------------------------------------------------------------
# The task: prompts, curriculum

SEED003_ANISO = (0.5, 1.0, 1.5, 1.0, 1.75)   # seed 003's anisotropic test covariance (variances, d = 5)
SHIFTED_SEED_OFFSET = 7919                    # the shifted test set's generator: eval_seed + this


def covariance_scale(spec, d):
    """Per-dimension standard deviation of x for a covariance spec (see --train_cov); None = isotropic."""
    if spec in ('', 'iso'):
        return None
    if spec == 'aniso':
        var = [SEED003_ANISO[i % len(SEED003_ANISO)] for i in range(d)]
    else:
        try:
            var = [float(v) for v in spec.split(',')]
        except ValueError:
            raise ValueError(f"covariance {spec!r}: expected 'iso', 'aniso' or {d} comma-separated variances") from None
        if len(var) != d:
            raise ValueError(f'covariance {spec!r}: need {d} variances (one per dimension, --d {d}), got {len(var)}')
        if not all(0 < v <= 1e6 for v in var):     # larger: x_i^2 and y_i overflow float32 in a long prompt
            raise ValueError(f'covariance {spec!r}: every variance must be in (0, 1e6]')
    return torch.tensor(var).sqrt()


def sample_prompts(gen, n, d, n_points, d_active=None, x_scale=None, noise_std=0.0):
    """n prompts with a fresh w each: xs (n, N, d), ys (n, N), ws (n, d). Dimensions >= d_active are zeroed in x
    (Garg's curriculum), so only the first d_active of w matter."""
    xs = torch.randn(n, n_points, d, generator=gen)        # (n, N, d)
    ws = torch.randn(n, d, generator=gen)                  # (n, d)
    if x_scale is not None:
        xs = xs * x_scale
    if d_active is not None and d_active < d:
        xs[:, :, d_active:] = 0.0
    ys = torch.einsum('nid,nd->ni', xs, ws)                # (n, N)
    if noise_std > 0:
        ys = ys + noise_std * torch.randn(ys.shape, generator=gen)
    return xs, ys, ws


def curriculum(step, args):
    """(active dimensions, prompt length) at this step: +k dimensions and +2k points every --curr_interval steps (0:
    2000 scaled to the run, 2000 * steps / 500001), k the smallest with which d is reached in the first curr_ratio
    of the steps (official train_ICL.py, adaptive_inc)."""
    if not args.curriculum:
        return args.d, args.n_points
    d0, n0 = min(args.curr_d_start, args.d), min(args.curr_n_start, args.n_points)
    interval = args.curr_interval or max(1, round(2000 * args.max_iters / 500001))
    k = max(1, math.ceil((args.d - d0) / max(1, math.floor(args.curr_ratio * args.max_iters / interval))))
    n = step // interval
    return min(d0 + k * n, args.d), min(n0 + 2 * k * n, args.n_points)

# -----------------------------------------------------------------------------
# Baselines: each maps a prompt to predictions ŷ_i that use only (x_j, y_j), j < i, and x_i

def least_squares_w(X, y):
    """Minimum-norm least squares ŵ = pinv(X) y, batched: X (B, n, d), y (B, n) -> (B, d)."""
    return (torch.linalg.pinv(X) @ y.unsqueeze(-1)).squeeze(-1)


def predict_least_squares(xs, ys):
    xs, ys = xs.double(), ys.double()
    preds = torch.zeros_like(ys)
    for i in range(1, xs.shape[1]):
        w_hat = least_squares_w(xs[:, :i], ys[:, :i])        # (B, d) from the first i pairs
        preds[:, i] = (xs[:, i] * w_hat).sum(-1)
    return preds.float()


def predict_averaging(xs, ys):
    """ŵ_i = mean_{j<i} x_j y_j (exact in expectation for isotropic x)."""
    xy = torch.cumsum(xs * ys.unsqueeze(-1), dim=1)          # (B, N, d): sum_{j<=i} x_j y_j
    w_hat = torch.zeros_like(xs)
    counts = torch.arange(1, xs.shape[1], device=xs.device, dtype=xs.dtype).view(1, -1, 1)
    w_hat[:, 1:] = xy[:, :-1] / counts                       # uses j < i only
    return (xs * w_hat).sum(-1)


def predict_nearest_neighbours(xs, ys, k=3):
    """Mean of the y's of the k nearest earlier x's (fewer when fewer are there; 0 at i = 0)."""
    B, N, _ = xs.shape
    dist = torch.cdist(xs, xs)                               # (B, N, N): |x_i - x_j|
    earlier = torch.ones(N, N, dtype=torch.bool, device=xs.device).tril(-1)  # j < i
    dist = dist.masked_fill(~earlier, float('inf'))
    d_k, idx = dist.topk(min(k, N), dim=-1, largest=False)   # (B, N, k)
    valid = torch.isfinite(d_k).to(xs.dtype)
    y_k = torch.gather(ys.unsqueeze(1).expand(B, N, N), 2, idx)  # (B, N, k)
    return (y_k * valid).sum(-1) / valid.sum(-1).clamp(min=1)


BASELINES = {'least_squares': predict_least_squares, 'averaging': predict_averaging,
             '3-NN': predict_nearest_neighbours, 'zero': lambda xs, ys: torch.zeros_like(ys)}

# -----------------------------------------------------------------------------
# The model: read-in, Transformer body, zero-init read-out at the x positions

class ICLModel(nn.Module):
    def __init__(self, cfg, d, pos_std=0.02, read_in_std=0.02):
        super().__init__()
        D = cfg.n_embd
        self.read_in = MupLinear(d, D, base_width=cfg.mup_base_width)   # init N(0, 1/d) ...
        if read_in_std > 0:                                             # ... or N(0, read_in_std^2), official 0.02
            nn.init.normal_(self.read_in.weight, std=read_in_std)
        self.read_in.weight.lr_mult = 1.0   # muP: the input layer's Adam lr does not scale with width
        # learned positions (--pos learned), as Garg's GPT-2 and the official code: N(0, pos_std^2), official 0.02
        self.wpe = nn.Embedding(cfg.block_size, D) if cfg.pos == 'learned' else None
        if self.wpe is not None:
            nn.init.normal_(self.wpe.weight, std=pos_std)
        self.body = Transformer(cfg)
        self.read_out = MupLinear(D, 1, base_width=cfg.mup_base_width, zero_init=True)  # ŷ = 0 at init

    def forward(self, xs, ys):
        B, N, d = xs.shape                                   # tokens x_1, [y_1, 0..0], x_2, [y_2, 0..0], ...
        y_tok = torch.zeros_like(xs)
        y_tok[:, :, 0] = ys
        tokens = torch.stack([xs, y_tok], dim=2).view(B, 2 * N, d)        # (B, N, 2, d) -> (B, 2N, d)
        h = self.read_in(tokens)                                          # (B, 2N, D)
        if self.wpe is not None:
            h = h + self.wpe(torch.arange(2 * N, device=tokens.device))
        h = self.body(h)                                                  # (B, 2N, D)
        return self.read_out(h[:, 0::2]).squeeze(-1)                      # (B, N): read out at x_i


def model_config(args):
    """The body's ModelConfig from the model flags (runs.model_config), causal, block_size 2N (the prompt's tokens)."""
    T = 2 * args.n_points
    kinds = [k.strip() for k in args.layer_pattern.split(',')] if args.layer_pattern else [args.attn]
    if 'mlr' in kinds:   # MLR fixes its level blocks from block_size: round up so they tile (causal pads)
        levels = len([r for r in args.ranks.split('|') if r.strip()]) or 1
        T = -(-T // 2 ** (levels - 1)) * 2 ** (levels - 1)                 # ceil(T / 2^(L-1)) * 2^(L-1)
    return runs.model_config(args, block_size=T, causal=True)

# -----------------------------------------------------------------------------
# Optimizer: AdamW with muP learning rates, warmup and schedule

def make_optimizer(model, args):
    """AdamW, the official betas (0.9, 0.95) and eps; under --mup each weight's lr is lr x its lr_mult
    (optimizer_groups). Each group keeps its base_lr, which the schedule (lr_at) scales."""
    if args.mup:
        groups = optimizer_groups(model, args.lr, args.weight_decay)
    else:   # one lr for everything: ignore the lr_mult tags
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{'params': [p for p in params if p.ndim >= 2], 'weight_decay': args.weight_decay, 'lr': args.lr},
                  {'params': [p for p in params if p.ndim < 2], 'weight_decay': 0.0, 'lr': args.lr}]
    for g in groups:
        g['base_lr'] = g['lr']
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=args.adam_eps)


def lr_at(step, args):
    """The lr multiplier at this step: linear warmup, then constant or cosine decay to 10 %."""
    if step < args.warmup_iters:
        return (step + 1) / args.warmup_iters
    if args.lr_schedule == 'constant':
        return 1.0
    progress = (step - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

# -----------------------------------------------------------------------------
# Evaluation: normalized squared error per position on held-out prompts, bootstrap intervals, the baselines

def eval_set(args, n, cov):
    """Held-out prompts from their own generator (seeded --eval_seed, never the training one), full d and N."""
    gen = torch.Generator().manual_seed(args.eval_seed + (0 if cov == args.train_cov else SHIFTED_SEED_OFFSET))
    return sample_prompts(gen, n, args.d, args.n_points, x_scale=covariance_scale(cov, args.d),
                          noise_std=args.noise_std)


@torch.no_grad()
def model_errors(model, xs, ys, d, device, chunk=250):
    """(n, N) normalized squared errors (ŷ - y)² / d of the model on these prompts (it trains again after)."""
    model.eval()
    errs = []
    for i in range(0, xs.shape[0], chunk):
        x, y = xs[i:i + chunk].to(device), ys[i:i + chunk].to(device)
        errs.append(((model(x, y) - y) ** 2 / d).float().cpu())
    model.train()
    return torch.cat(errs)


def bootstrap(errs, n_boot, seed=0):
    """Per-position mean and 95% percentile interval over prompts: errs (n, N) -> three lists of N."""
    errs = errs.double().numpy()
    n = errs.shape[0]
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)     # (n_boot, n) resampling weights
    means = counts @ errs / n                                          # (n_boot, N)
    lo, hi = np.percentile(means, [2.5, 97.5], axis=0)
    return errs.mean(0).tolist(), lo.tolist(), hi.tolist()


def evaluate(model, xs, ys, args, device):
    """The model's and the baselines' summaries on these prompts: the per-position curve with CI, and the paper's
    error at N = 2d (predicting y_{2d} from 2d - 1 pairs)."""
    def summary(errs):
        mean, lo, hi = bootstrap(errs, args.n_boot)
        i2d = min(2 * args.d, errs.shape[1]) - 1
        return {'mean': mean, 'lo': lo, 'hi': hi, 'at_2d': mean[i2d], 'at_2d_ci': [lo[i2d], hi[i2d]],
                'query': mean[-1], 'query_ci': [lo[-1], hi[-1]]}
    errs = model_errors(model, xs, ys, args.d, device)
    return summary(errs), {k: summary((f(xs, ys) - ys) ** 2 / args.d) for k, f in BASELINES.items()}


def evaluated(st, step):
    """Whether the training curve has its point at this step (a resumed run's first step may have it)."""
    return st['history'] and st['history'][-1]['step'] == step


def steps_to_90(history, key='query'):
    """First evaluated step at which 90% of the drop from the first to the final eval error is done (seed 003)."""
    if len(history) < 2 or history[-1][key] >= history[0][key]:
        return None                     # no drop to speak of
    target = history[0][key] - 0.9 * (history[0][key] - history[-1][key])
    return next(h['step'] for h in history if h[key] <= target)

# -----------------------------------------------------------------------------
# Training: the loop, checkpoints, --resume

def check_resume(saved, args, given, step):
    """--resume: the checkpoint's settings win and a given flag that differs is refused (resume_settings), except a
    new --max_iters when every step already taken (0 .. step - 1) had the same lr and curriculum under it: the
    longer run is then the run trained that long from scratch (a constant lr after warmup and a curriculum that
    ended before `step` do this; a cosine schedule or a curriculum scaled to the run's length do not)."""
    may_change = set(NOT_TRAINING)
    if 'max_iters' in given and args.max_iters != saved['max_iters']:
        run = lambda n: argparse.Namespace(**dict(saved, max_iters=n))   # the settings of an n-step run
        runs.check_run_length(step, lambda s, n: (lr_at(s, run(n)), curriculum(s, run(n))), saved['max_iters'],
                              args.max_iters, '--resume --max_iters', lambda x: f'lr x {x[0]:.4g}, (d, N) = {x[1]}')
        may_change.add('max_iters')
    resume_settings(saved, args, given, may_change)


def run_config(args):
    """The settings a run saves: its flags (not the command line's bookkeeping, args._given)."""
    return {k: v for k, v in vars(args).items() if not k.startswith('_')}


def train(args, run_name='run'):
    """Train one model -> the results dict (also <out_dir>/<run_name>.json). In nanoGPT's order: config, data,
    model, optimizer, resume, the loop with its evaluations and checkpoints, the final evaluation."""
    args = resolve(args)                                         # config
    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    ex, ey, _ = eval_set(args, args.n_eval, args.train_cov)      # data: held-out prompts (their own generator)
    gen = torch.Generator().manual_seed(args.seed)               # and the training prompts' generator
    model = ICLModel(model_config(args), args.d, args.pos_std, args.read_in_std).to(device)   # model
    opt = make_optimizer(model, args)                            # optimizer
    ckpt_path, json_path = (os.path.join(args.out_dir, f'{run_name}.{ext}') for ext in ('pt', 'json'))
    earlier = prepare_out_dir(args.out_dir, [ckpt_path, json_path], args.resume, args.overwrite)
    # the run state: what a checkpoint holds besides weights, optimizer and RNGs, to continue exactly
    st = dict(step=0, flops=0, history=[], loss_ema=None, time_s=0.0, cpu_s=0.0, step_ms=0.0)
    if args.resume and os.path.exists(ckpt_path):               # every training setting must agree (check_resume)
        ck = load_checkpoint(ckpt_path, SCRIPT, ('model', 'optimizer', 'config', 'step', 'state'))
        check_resume(ck['config'], args, set(ck['config']) - {'format'}, ck['state']['step'])
        model.load_state_dict(ck['model'])
        opt.load_state_dict(ck['optimizer'])
        gen.set_state(ck['data_rng'])
        set_rng_state(ck['rng'])
        st = ck['state']
        print(f'[{run_name}] resumed from {ckpt_path} at step {st["step"]}')

    def save():   # the checkpoint <run>.pt (with --save): weights, optimizer, config, run state, RNGs -> its path
        if not args.save:
            return None
        with io_errors('--out_dir', ckpt_path):
            save_checkpoint(ckpt_path, {'script': SCRIPT, 'model': model.state_dict(), 'optimizer': opt.state_dict(),
                                        'config': run_config(args), 'step': st['step'], 'state': st,
                                        'data_rng': gen.get_state(), 'rng': rng_state()})
        clear_earlier_run(earlier, {ckpt_path})     # --overwrite: the earlier run goes with the first one
        return ckpt_path

    def curve(step):   # a point of the training curve: the held-out error at N = 2d, at the query and overall
        mean = model_errors(model, ex[:args.n_eval_during], ey[:args.n_eval_during], args.d, device).mean(0)
        i2d = min(2 * args.d, mean.numel()) - 1
        st['history'].append({'step': step, 'flops': st['flops'], 'train_loss': st['loss_ema'],
                              'at_2d': mean[i2d].item(), 'query': mean[-1].item(), 'mean': mean.mean().item(),
                              'time_s': st['time_s']})
    body_params = sum(p.numel() for p in model.body.parameters())
    print(f'[{run_name}] attn={args.attn} L={args.n_layer} H={args.n_head} D={args.n_embd} '
          f'head_width={args.n_embd // args.n_head} d={args.d} N={args.n_points} '
          f'body_params={body_params} device={device} threads: {torch.get_num_threads()}')
    # the loop. Every eval_interval steps: evaluate, then save; then the step's batch, so that a resumed run draws
    # it from the saved generator. Ctrl-C ends the step, saves and raises Interrupted
    forward_flops = functools.cache(model.body.forward_flops)       # T -> the body's forward FLOPs
    time0, cpu0, t0, c0 = st['time_s'], st['cpu_s'], time.time(), time.process_time()
    x_scale = covariance_scale(args.train_cov, args.d)
    bar = tqdm(total=args.max_iters, initial=st['step'], disable=not args.progress, leave=False, desc=run_name,
               mininterval=2.0)
    model.train()
    with ctrl_c_finishes_step() as ctrl_c:
        for step in range(st['step'], args.max_iters):
            st['time_s'], st['cpu_s'] = time0 + time.time() - t0, cpu0 + time.process_time() - c0  # wall, CPU
            if args.eval_interval and step % args.eval_interval == 0 and not evaluated(st, step):
                curve(step)
                save()
            if ctrl_c.stop:
                path = save()
                raise Interrupted(f'[{run_name}] at step {step}: ' + (f'saved {path}; continue with --resume'
                                                                      if path else 'nothing saved (--no-save)'))
            d_active, n_points = curriculum(step, args)   # a fresh batch from the training generator
            xs, ys, _ = sample_prompts(gen, args.batch_size, args.d, n_points, d_active, x_scale, args.noise_std)
            xs, ys = xs.to(device), ys.to(device)
            t = time.time()
            for g in opt.param_groups:
                g['lr'] = g['base_lr'] * lr_at(step, args)
            loss = F.mse_loss(model(xs, ys), ys)                 # MSE over all positions
            # backward, clip, AdamW step; a NaN or inf loss stops the run here, before the update (Diverged)
            lossf = guarded_update(loss, step + 1, model, opt, args.grad_clip, args.lr, args.warmup_iters)
            ms = (time.time() - t) * 1e3
            st['step_ms'] = 0.9 * st['step_ms'] + 0.1 * ms if step else ms
            T = 2 * n_points
            st['flops'] += 3 * forward_flops(T) * args.batch_size       # training ≈ 3× forward, non-embedding
            st['loss_ema'] = lossf if st['loss_ema'] is None else 0.95 * st['loss_ema'] + 0.05 * lossf
            st['step'] = step + 1
            bar.update(1)
            if (step + 1) % args.log_interval == 0 or step + 1 == args.max_iters:
                last = f' | eval@2d {st["history"][-1]["at_2d"]:.4f}' if st['history'] else ''
                tqdm.write(f'[{run_name}] step {step + 1}/{args.max_iters} | d {d_active} N {n_points} | '
                           f'loss {lossf:.4f} (ema {st["loss_ema"]:.4f}){last} | lr {opt.param_groups[0]["lr"]:.2e} | '
                           f'{st["step_ms"]:.1f} ms/step | {args.batch_size * T / st["step_ms"] * 1e3:.0f} tok/s | '
                           f'train FLOPs {st["flops"]:.3e}')
    bar.close()
    st['time_s'], st['cpu_s'] = time0 + time.time() - t0, cpu0 + time.process_time() - c0
    if not evaluated(st, args.max_iters):
        curve(args.max_iters)
    # the final evaluation: the full held-out set (and the shifted one, --test_cov), the baselines on the same prompts
    results = {'run': run_name, 'config': run_config(args), 'body_params': body_params, 'train_flops': st['flops'],
               'train_time_s': st['time_s'], 'cpu_time_s': st['cpu_s'], 'history': st['history'],
               'steps_to_90': steps_to_90(st['history']), 'final_train_loss_ema': st['loss_ema']}
    results['model'], results['baselines'] = evaluate(model, ex, ey, args, device)
    if args.test_cov:
        ax, ay, _ = eval_set(args, args.n_eval, args.test_cov)
        results['model_shifted'], results['baselines_shifted'] = evaluate(model, ax, ay, args, device)
    m = results['model']
    print(f'[{run_name}] done in {st["time_s"]:.0f}s ({st["cpu_s"]:.0f}s CPU) | error at N=2d {m["at_2d"]:.4f} '
          f'[{m["at_2d_ci"][0]:.4f}, {m["at_2d_ci"][1]:.4f}] | query {m["query"]:.4f} | '
          + ' '.join(f'{k} {v["at_2d"]:.3f}' for k, v in results['baselines'].items()) + f' | FLOPs {st["flops"]:.3e}')
    results['outputs'] = {'checkpoint': save(), 'results': json_path}
    with io_errors('--out_dir', json_path):
        write_json(json_path, results)
    clear_earlier_run(earlier, {ckpt_path, json_path})
    results['_model'] = model   # handy for in-process callers (tests); not serialized
    return results

# -----------------------------------------------------------------------------
# Plots

BASELINE_STYLE = {'least_squares': ('k', ':'), 'averaging': ('C7', '--'), '3-NN': ('C8', '-.'), 'zero': ('C9', ':')}
MODEL_COLOR = {'standard, 8 heads': 'C0', 'standard, 1 head': 'C1', 'bilinear BTT, 8 heads': 'C2',
               'bilinear MLR': 'C3'}


def color(label):
    return next((c for k, c in MODEL_COLOR.items() if label.startswith(k)), None)


def save_figure(fig, ax, path, **legend):
    ax.legend(fontsize=7, **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_positions(results, path, title):
    """Error per position (number of in-context examples) for each run, with the baselines of the first."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        m = r['model']
        ax.plot(m['mean'], label=name, color=color(name))
        ax.fill_between(np.arange(len(m['mean'])), m['lo'], m['hi'], alpha=0.25, color=color(name))
    base = next(iter(results.values()))
    for name, b in base['baselines'].items():
        ax.plot(np.maximum(b['mean'], 1e-4), color=BASELINE_STYLE[name][0], ls=BASELINE_STYLE[name][1], label=name)
    d = base['config']['d']
    ax.axvline(d, color='gray', lw=0.5)
    ax.axvline(2 * d - 1, color='gray', lw=0.5, ls='--')
    ax.set(yscale='log', ylim=(1e-3, 3), xlabel='in-context examples (i - 1)', ylabel='normalized squared error',
           title=title)
    save_figure(fig, ax, path)


def plot_curves(path, by_point, key, style, figsize, hlines=(), loc='best', **axes):
    """Training curves per sweep point: history[key] against step or FLOPs (style(label, rs) -> x key, color, line
    style), the mean over seeds and their min-max band (on a log axis mean - std is often below 0 with 3 seeds);
    hlines: (label, y) reference lines."""
    fig, ax = plt.subplots(figsize=figsize)
    for k, rs in by_point.items():
        x_key, c, ls = style(k, rs)
        steps = sorted(set.intersection(*({h['step'] for h in r['history']} for r in rs)))   # shared by all seeds
        by_step = [{h['step']: h for h in r['history']} for r in rs]
        y = np.array([[b[s][key] for s in steps] for b in by_step])                            # (seeds, evals)
        x = np.array([by_step[0][s][x_key] for s in steps])
        keep = (x > 0) | (x_key == 'step')                                                     # log axis: no 0 FLOPs
        ax.plot(x[keep], y.mean(0)[keep], label=f'{k} ({len(rs)} seed{"s" * (len(rs) > 1)})', color=c, ls=ls)
        ax.fill_between(x[keep], y.min(0)[keep], y.max(0)[keep], alpha=0.15, color=c)
    for label, y in hlines:
        ax.axhline(y, color='gray', lw=0.7, ls=':', label=label)
    ax.set(**axes)
    save_figure(fig, ax, path, loc=loc)


def plot_bottleneck(path, sweep, args):
    """Fig. 2/3a from a sweep's JSON dict: error at N = 2d against width D per model: the mean over seeds (line),
    each seed (dots) and their range (band), the models a little apart at each width; the baselines as lines."""
    table, widths = sweep['table'], sorted({t['D'] for t in sweep['table']})   # 8 heads: at every width
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for k, label in enumerate(BOTTLENECK_MODELS):
        rows = sorted((t for t in table if t['model'].startswith(label + ',')), key=lambda t: t['D'])
        if not rows:
            continue
        shift = 1.008 ** (k - (len(BOTTLENECK_MODELS) - 1) / 2)    # side by side at one width, not on top
        x, seeds = np.array([t['D'] for t in rows]) * shift, [np.array(t['err_at_2d_seeds'], float) for t in rows]
        n = rows[0]['seeds']
        ax.plot(x, [t['err_at_2d'] for t in rows], marker='o', label=f'{label} (mean, {n} seed{"s" * (n > 1)})',
                color=color(label))
        ax.fill_between(x, [v.min() for v in seeds], [v.max() for v in seeds], alpha=0.15, color=color(label))
        for xi, v in zip(x, seeds):
            ax.scatter(np.full(len(v), xi), v, s=12, color=color(label), alpha=0.6)
    for name, b in sweep['baselines'].items():
        if name != 'least_squares':
            ax.axhline(b['at_2d'], color=BASELINE_STYLE[name][0], ls=BASELINE_STYLE[name][1], lw=1, label=name)
    ax.set(xscale='log', yscale='log', xlabel='model width D (8 heads: head width D/8)',
           ylabel=f'error at N = 2d (d = {args.d})',
           title=f'in-context regression, d={args.d}, {args.n_layer} layers, {args.max_iters} steps\n'
                 f'lr {lr_text(args, widths)}\n(least squares = 0; dots: seeds, band: their range)')
    ax.title.set_fontsize('medium')
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    save_figure(fig, ax, path, loc='center left', bbox_to_anchor=(1.01, 0.5))   # outside: it hid seeds' dots

# -----------------------------------------------------------------------------
# Sweeps: the papers' figures at CPU scale, every model with the same steps and batch. A sweep is a list of points
# {label: (settings, run name)}, trained with --seeds seeds each through runs.sweep, then a table and a plot.
# Its CPU recipe (why each setting: docs/icl.md, "The CPU recipe") sets every flag not given, then QUICK's.

CPU_RECIPE = dict(
    max_iters=7000,          # official 500 001; at 5000 bilinear MLR 1|1|1 (D = 24) was still near 0.1, falling
    lr=5e-5,                 # at the official 1e-4 a 1-head run could stay on the "predict 0" plateau
    # Garg's curriculum stretched (the official one, scaled, ends at step 28 here): the full task from step 1500 on
    curr_d_start=2, curr_n_start=4, curr_interval=500, curr_ratio=0.5,
    n_eval_during=128, eval_interval=250)    # fewer, smaller evals during training: CPU time
SWEEP_RECIPE = {
    # 8 heads of width 3 (fails at d = 5) and 4 (learns), the full-rank models at D = 24 only: 15 runs. Bilinear
    # MLR 1|1|1 at head width 3, 1|1|2 at 4, one LayerNorm per head (a departure: see bottleneck_mlr_ranks)
    'bottleneck': dict(CPU_RECIPE, bilinear_mlr_ln='head', widths='24,32', full_rank_widths='24',
                       bottleneck_ranks='3:1|1|1,4:1|1|2,8:4|2|1|1'),
    'compute': dict(CPU_RECIPE, bilinear_mlr_ln='head', compute_width=24, compute_ranks='1|1|1'),   # reuses D = 24
    'linear': dict(CPU_RECIPE, max_iters=12000),   # one length for all; lr and batch: SEED003_OPTIMIZER
}
# `--sweep bottleneck --d 8`, on top of SWEEP_RECIPE['bottleneck']: 8 heads of width 4 (< d) and 8 (= d); at D = 64
# lr 1e-4, so that under muP both widths get the hidden lr 1.2e-3 (docs/icl.md, "A larger d: 8")
LARGER_D_RECIPE = {8: dict(widths='32,64', full_rank_widths='32', max_iters=8000, width_lrs='64:1e-4',
                           bottleneck_ranks='4:1|1|2')}
PER_WIDTH = {'full_rank_widths', 'width_lrs'}   # they name the recipe's widths: not applied with --widths given
# each sweep's own flags (its models), refused with another sweep
SWEEP_OWN = dict(bottleneck=('widths', 'full_rank_widths', 'full_rank_models', 'width_lrs', 'bottleneck_ranks'),
                 compute=('compute_width', 'compute_ranks'), linear=('linear_width', 'depths'))
# the flags each sweep sets for every run it trains, refused with it
SWEEP_SETS = dict(bottleneck=('attn', 'layer_pattern', 'n_head', 'n_embd', 'ranks'),
                  compute=('attn', 'layer_pattern', 'n_head', 'n_embd', 'ranks'),
                  linear=('attn', 'layer_pattern', 'n_head', 'n_embd', 'n_layer', 'd', 'n_points', 'test_cov',
                          'grad_clip', 'qk_ln'))
# --quick: the same ordering at lower precision, <= 8 min on an idle 2-core machine with --workers 2 (docs/icl.md)
QUICK = {
    'bottleneck': dict(widths='24', max_iters=4000, seeds=1, n_eval=500, n_boot=200, bottleneck_ranks=''),
    'compute': dict(max_iters=4000, seeds=1, n_eval=500, n_boot=200),   # the bottleneck's runs + bilinear MLR
    'linear': dict(depths='3', max_iters=3000, seeds=1, n_eval=500, n_boot=200),
}
# seed 003 §2.2.1-2.2.2: each architecture's tuned lr and batch, no muP (AdamW's betas, eps, warmup: the official)
SEED003_OPTIMIZER = {'standard': dict(lr=1e-4, batch_size=32, mup=False),
                     'linear': dict(lr=3e-4, batch_size=64, mup=False)}
BOTTLENECK_MODELS = {'standard, 8 heads': ('standard', 8), 'standard, 1 head': ('standard', 1),
                     'bilinear BTT, 8 heads': ('bilinear_btt', 8), 'bilinear MLR, 8 heads': ('bilinear_mlr', 8)}
FULL_RANK_MODELS = {'standard_1head': 'standard, 1 head', 'bilinear_btt': 'bilinear BTT, 8 heads',
                    'bilinear_mlr': 'bilinear MLR, 8 heads'}             # --full_rank_models: name -> label
# flags that are not a run's training settings: a run differing only in these is the same run
NOT_TRAINING = {'sweep', 'run_name', 'out_dir', 'assets_dir', 'workers', 'progress', 'log_interval', 'save',
                'threads', 'device', 'widths', 'compute_width', 'linear_width', 'depths', 'compute_ranks', 'reuse',
                'resume', 'overwrite', 'seeds', 'quick', 'bottleneck_ranks', 'optimizer_given', 'full_rank_widths',
                'full_rank_models', 'width_lrs'}


def ints(text):
    """'8,16' -> [8, 16] (ValueError when not integers)."""
    return [int(v) for v in text.split(',')]


def width_lrs(args):
    """--width_lrs 'width:lr,...' -> {width: lr} (empty: every width at --lr)."""
    return {int(w): float(lr) for w, lr in (item.split(':') for item in args.width_lrs.split(',') if item)}


def lr_text(args, widths):
    """The sweep's lr for a plot title: '1e-04', or per width with --width_lrs ('5e-05 at D = 32, 1e-04 at 64')."""
    lrs = {D: width_lrs(args).get(D, args.lr) for D in sorted(widths)}
    if len(set(lrs.values())) == 1:
        return f'{lrs[min(lrs)]:g}'
    return ', '.join(f'{lr:g} at {"D = " if i == 0 else ""}{D}' for i, (D, lr) in enumerate(lrs.items()))


def bottleneck_mlr_ranks(spec, head_width):
    """Bilinear-MLR ranks for a head width from --bottleneck_ranks ('width:ranks,...'), None when not listed. Under
    a LayerNorm per level ('level', official) a level of 1 or 2 features never learns: the recipe's 'head' does."""
    return {w.strip(): r.strip() for w, _, r in (item.partition(':') for item in spec.split(','))}.get(str(head_width))


def score_rank(c):
    """Rank of one head's scoring matrix: d = D/H for standard attention, D for bilinear BTT, and
    min(D, sum_l 2^l r_l) for bilinear MLR (paper §3.2, Table 1)."""
    D, H = c['n_embd'], c['n_head']
    mlr = min(D, sum(2 ** l * int(r) for l, r in enumerate((c['ranks'] or str(D // H)).split('|'))))
    return {'bilinear_btt': D, 'bilinear_mlr': mlr}.get(c['attn'], D // H)


def run_tag(args):
    """'_d8' at d = 8 (not linear: d = 5), '_quick' with --quick: sweeps' files lie side by side, never collide."""
    other_d = args.d != DEFAULTS['d'] and args.sweep != 'linear'
    return (f'_d{args.d}' if other_d else '') + ('_quick' if args.quick else '')


def switched(a, parser):
    """(on, the flag that turns it on, its flags) of each part of a run that a setting turns off: runs.check_mode_flags
    refuses those flags when it is off."""
    return [(a.curriculum, '--curriculum', group_flags(parser, 'curriculum') - {'curriculum'}),
            (a.pos == 'learned', '--pos learned', {'pos_std'}), (a.mup, '--mup', {'mup_base_width'})]


def unread(a, parser):
    """The flags a run of settings `a` does not read (and refuses when given): model flags no layer reads, the
    curriculum's without --curriculum, --pos_std without learned positions (switched)."""
    return {*runs.unread_flags(a, attention.READ_BY, True), *(f for on, _, fs in switched(a, parser) if not on
                                                               for f in fs)}


def variant(args, **overrides):
    """One sweep run's settings; a flag it does not read (the recipe's bilinear_mlr_ln for standard attention)
    stays at its default, so that its command line (run_argv) names only what it reads."""
    a, parser = copy.copy(args), build_parser()
    vars(a).update(sweep='', **overrides)
    for k in unread(a, parser):
        setattr(a, k, parser.get_default(k))
    return a


def run_argv(a, name, run_dir):
    """One sweep run's command line: every training setting of `a` as a flag, its own folder, one thread."""
    argv = [f'--run_name={name}', f'--out_dir={run_dir}', '--no-progress', '--threads=1',
            f'--log_interval={a.log_interval}', f'--device={a.device}', '--save' if a.save else '--no-save']
    parser = build_parser()
    idle = unread(a, parser)   # at their defaults (variant)
    for act in parser._actions:
        k, v = act.dest, getattr(a, act.dest, None)
        if k in NOT_TRAINING or k in idle or v is None or not act.option_strings:
            continue
        if isinstance(act, argparse.BooleanOptionalAction):
            argv.append(f'--{k}' if v else f'--no-{k}')
        elif act.nargs != 0:
            argv.append(f'--{k}={v}')
    return argv


def run_status(args, a, name, run_dir):
    """-> (runs.run_state of the run's folder: 'done', 'partial' or 'new'; the step its checkpoint reached). Other
    settings are refused unless --overwrite; with --resume a run may continue to a larger --max_iters."""
    json_path, ckpt_path = (os.path.join(run_dir, f'{name}.{ext}') for ext in ('json', 'pt'))
    want = resolve(a)
    if not args.reuse:
        return 'new', 0
    ck = load_checkpoint(ckpt_path, SCRIPT, ('config', 'step')) if os.path.exists(ckpt_path) else None
    if args.resume and ck:
        check_resume(ck['config'], want, set(ck['config']) - {'format'}, ck['step'])
        return ('done' if ck['step'] == want.max_iters and os.path.exists(json_path) else 'partial'), ck['step']
    saved = ck and ck['config']
    if os.path.exists(json_path):
        saved = read_json(json_path, '--out_dir', ['config'])['config']
    try:
        state = runs.run_state(saved, vars(want), NOT_TRAINING, run_dir, os.path.exists(json_path),
                               redo='another --out_dir, or --overwrite to train these runs again')
    except ValueError:
        if args.overwrite:
            return 'new', 0
        raise
    return state, ck['step'] if ck else 0


def run_seconds(a, start, ms):
    """A run's estimated 1-thread seconds: the steps left (from `start`) at each prompt length N of the curriculum
    x one step's time at N (measured once per model and N, kept in ms; timing every step at the full length read
    ~40 % high), plus its evaluations at the full length (a forward ~ 1/3 step) and ~2 s of baselines."""
    a = resolve(a)
    lengths = collections.Counter(curriculum(s, a)[1] for s in range(start, a.max_iters))
    model = (a.attn, a.layer_pattern, a.n_head, a.n_embd, a.n_layer, a.ranks, a.d, a.batch_size)
    for n in {a.n_points, *lengths} - {n for m, n in ms if m == model}:
        torch.manual_seed(0)
        net = ICLModel(model_config(a), a.d, a.pos_std, a.read_in_std)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        xs, ys, _ = sample_prompts(torch.Generator().manual_seed(0), a.batch_size, a.d, n)
        ms[model, n] = runs.one_thread_seconds(
            lambda: (F.mse_loss(net(xs, ys), ys).backward(), opt.step(), opt.zero_grad(set_to_none=True)))
    evals = (sum(lengths.values()) // a.eval_interval if a.eval_interval else 0) * a.n_eval_during + 2 * a.n_eval
    return sum(ms[model, n] * k for n, k in lengths.items()) + ms[model, a.n_points] * evals / a.batch_size / 3 + 2.0


def table_row(label, rs, **values):
    """A sweep table's row for one point (rs: its results per seed): for each key=get, the mean, std (0 for one
    seed) and per-seed values of get(result), None ones left out; the mean training and CPU seconds."""
    def mean_std(values):
        v = [x for x in values if x is not None]
        return (None, None) if not v else (runs.mean_std(v)[0], runs.mean_std(v)[1] if len(v) > 1 else 0.0)
    row = {'model': label, 'seeds': len(rs)}
    for key, get in values.items():
        vals = [get(r) for r in rs]
        row[key], row[f'{key}_std'] = mean_std(vals)
        row[f'{key}_seeds'] = vals
    row['time_s'], row['cpu_s'] = (mean_std([r.get(k) for r in rs])[0] for k in ('train_time_s', 'cpu_time_s'))
    return row


def print_table(rows, cols):
    """A markdown table; a column with a '<col>_std' companion prints as 'mean ± std' (over seeds)."""
    def cell(v, s=None):
        if isinstance(v, float):
            return f'{v:.4g}' if s is None else f'{v:.4g} ± {s:.2g}'
        return '[' + ', '.join('-' if x is None else f'{x:.3g}' for x in v) + ']' if isinstance(v, list) else str(v)
    print('| ' + ' | '.join(cols) + ' |')
    print('|' + '---|' * len(cols))
    for r in rows:
        print('| ' + ' | '.join(cell(r[c], r.get(f'{c}_std')) for c in cols) + ' |')


def run_sweep(args, points, row, cols, plot, extra=lambda first, table: {}):
    """Every sweep's one path: each point {label: (settings, run name)} trained with --seeds seeds on the same
    held-out prompts, a run in <out_dir>/<name>_s<seed> each (runs.sweep); the table, row(label, results per seed)
    per point, printed; <out_dir>/sweep_<name>.json (table, extra(first run, table), the baselines, every run)
    and icl_<name>.png (plot(path, that dict, by_point)), copied to --assets_dir. -> (that dict, by_point)"""
    t0 = time.time()
    attns = sorted({a.attn for a, _ in points.values()})
    runs.check_flags_read(args, args._given, True, attns, f"--sweep {args.sweep}'s models ({', '.join(attns)})")
    prepare_out_dir(args.out_dir)             # writable, and this sweep's own; each run locks its own folder
    if args.assets_dir:
        prepare_out_dir(args.assets_dir, flag='--assets_dir')
    eval_seed, todo, states, ms = resolve(args).eval_seed, [], {}, {}
    for label, (a, name) in points.items():
        for s in range(args.seed, args.seed + args.seeds):
            # resolved (--n_points 0 -> 2d): a resumed run's argv must agree with its checkpoint
            a_s, run = resolve(variant(a, seed=s, eval_seed=eval_seed)), f'{name}_s{s}'
            run_dir = os.path.join(args.out_dir, run)
            states[run], step = run_status(args, a_s, run, run_dir)
            seconds = 0.0 if states[run] == 'done' else run_seconds(a_s, step, ms)
            todo.append(runs.Run(run, label, s, run_argv(a_s, run, run_dir), run_dir, seconds))
    codes = runs.sweep(todo, states, __file__, main, args.workers, tag='icl')
    failed = [r.name for r in todo if codes.get(r.name, 0) != 0]
    if failed:
        raise ValueError(f"{len(failed)} run(s) failed: {', '.join(failed)} (see their train.log)")
    by_point = {}
    for r in todo:
        result = read_json(os.path.join(r.out_dir, f'{r.name}.json'), '--out_dir', ['config'])
        by_point.setdefault(r.group, []).append(dict(result, reused=True) if states[r.name] == 'done' else result)
    wall = time.time() - t0
    table = [row(k, rs) for k, rs in by_point.items()]
    print_table(table, cols)
    name = args.sweep + run_tag(args)          # 'bottleneck', 'bottleneck_d8', 'compute_quick', ...
    first = next(iter(by_point.values()))[0]
    seed_runs = {f'{k}, seed={r["config"]["seed"]}': r for k, rs in by_point.items() for r in rs}
    payload = {'sweep': name, 'wall_s': wall, 'seeds': list(range(args.seed, args.seed + args.seeds)),
               'reused': [k for k, r in seed_runs.items() if r.get('reused')], 'table': table,
               **extra(first, table), 'baselines': first['baselines'],
               'runs': {k: {f: v for f, v in r.items() if f not in ('baselines', 'baselines_shifted')}
                        for k, r in seed_runs.items()}}
    jpath, ppath = os.path.join(args.out_dir, f'sweep_{name}.json'), os.path.join(args.out_dir, f'icl_{name}.png')
    if len(payload['reused']) == len(payload['runs']) and os.path.exists(jpath):   # a replot of the same runs
        old = read_json(jpath, '--out_dir', ['runs', 'wall_s'])                       # keeps the training's wall time
        same = [{k: (r.get('run'), r['model']['at_2d']) for k, r in p['runs'].items()} for p in (old, payload)]
        if same[0] == same[1]:
            payload['wall_s_when_trained'] = old.get('wall_s_when_trained', old['wall_s'])
    with io_errors('--out_dir', args.out_dir):
        write_json(jpath, payload)
        plot(ppath, payload, by_point)
    if args.assets_dir:
        with io_errors('--assets_dir', args.assets_dir):
            shutil.copy(ppath, args.assets_dir)
            shutil.copy(jpath, os.path.join(args.assets_dir, f'icl_{name}.json'))
    return payload, by_point


def sweep_bottleneck(args):
    """Fig. 2/3a: error at N = 2d against width: 8-head and 1-head standard, 8-head bilinear BTT and MLR; and the
    error per position at the narrowest width (the bottlenecked one), first seed."""
    widths, full_rank = ints(args.widths), ints(args.full_rank_widths or args.widths)
    full_rank_labels = {FULL_RANK_MODELS[m] for m in args.full_rank_models.split(',')}
    points = {}
    for D in sorted(widths, reverse=True):                            # costliest first
        for label, (attn, H) in reversed(BOTTLENECK_MODELS.items()):
            if label != 'standard, 8 heads' and (D not in full_rank or label not in full_rank_labels):
                continue
            ranks = bottleneck_mlr_ranks(args.bottleneck_ranks, D // H) if attn == 'bilinear_mlr' else ''
            if ranks is None:
                print(f'{label}, D={D}: not trained (head width {D // H} has no entry in --bottleneck_ranks)')
                continue
            a = variant(args, attn=attn, n_head=H, n_embd=D, ranks=ranks, lr=width_lrs(args).get(D, args.lr))
            points[f'{label}, D={D}'] = a, f'bottleneck_{attn}{ranks.replace("|", "")}_H{H}_D{D}{run_tag(args)}'

    def row(k, rs):
        c = rs[0]['config']
        return {**table_row(k, rs, err_at_2d=lambda r: r['model']['at_2d']), 'D': c['n_embd'],
                'head_width': c['n_embd'] // c['n_head'], 'ranks': c['ranks'], 'score_rank': score_rank(c),
                'ci_seed0': rs[0]['model']['at_2d_ci'], 'train_flops': rs[0]['train_flops']}
    payload, by_point = run_sweep(
        args, points, row, ['model', 'D', 'head_width', 'score_rank', 'err_at_2d', 'err_at_2d_seeds', 'train_flops',
                            'time_s'], lambda path, sweep, _: plot_bottleneck(path, sweep, args),
        lambda first, table: dict(d=args.d, sum_run_time_s=sum(t['time_s'] * t['seeds'] for t in table),
                                  baselines_at_2d={k: v['at_2d'] for k, v in first['baselines'].items()}))
    print('baselines at N=2d: ' + ', '.join(f'{k} {v:.4f}' for k, v in payload['baselines_at_2d'].items())
          + f' | sweep wall {payload["wall_s"]:.0f}s')
    narrowest = {k.rsplit(',', 1)[0]: rs[0] for k, rs in by_point.items() if rs[0]['config']['n_embd'] == min(widths)}
    pos_path = os.path.join(args.out_dir, f'icl_position{run_tag(args)}.png')
    with io_errors('--out_dir', args.out_dir):
        plot_positions(narrowest, pos_path, f'error per position, D = {min(widths)}, d = {args.d}, seed {args.seed}')
    if args.assets_dir:
        with io_errors('--assets_dir', args.assets_dir):
            shutil.copy(pos_path, args.assets_dir)
    return payload


def sweep_compute(args):
    """Fig. 3b: error at N = 2d against training FLOPs at one width: bilinear MLR, bilinear BTT, 1 and 8 heads."""
    D = args.compute_width
    models = {f'bilinear MLR {r.replace("|", "/")}, 8 heads': ('bilinear_mlr', 8, r)   # '|' would break tables
              for r in args.compute_ranks.split(',')}
    models.update({'bilinear BTT, 8 heads': ('bilinear_btt', 8, ''), 'standard, 1 head': ('standard', 1, ''),
                   'standard, 8 heads': ('standard', 8, '')})
    points = {label: (variant(args, attn=attn, n_head=H, n_embd=D, ranks=ranks),
                      f'compute_{attn}{ranks.replace("|", "")}_H{H}_D{D}{run_tag(args)}')
              for label, (attn, H, ranks) in models.items()}
    first = next(iter(points))

    def plot(path, sweep, by_point):
        plot_curves(path, by_point, 'at_2d', lambda k, rs: (
            'flops', color(k), ':' if k.startswith('bilinear MLR') and k != first else '-'), (6.5, 4.2),
            loc='lower left', xscale='log', yscale='log', xlabel='training FLOPs (non-embedding)',
            ylabel=f'error at N = 2d (d = {args.d})', title=f'error vs compute, D = {D}, {args.n_layer} layers\n'
            f'(evals in training, {args.n_eval_during} held-out prompts; mean, seed range)')
    return run_sweep(args, points, lambda k, rs: {
        **table_row(k, rs, err_at_2d=lambda r: r['model']['at_2d']), 'score_rank': score_rank(rs[0]['config']),
        'flops_per_step': rs[0]['train_flops'] / args.max_iters, 'train_flops': rs[0]['train_flops']},
        ['model', 'score_rank', 'err_at_2d', 'err_at_2d_seeds', 'flops_per_step', 'train_flops', 'time_s'], plot)[0]


def sweep_linear(args):
    """Seed 003: softmax (quadratic) vs linear attention at depths 1/3/6, d = 5, 10 pairs + query, 4 heads,
    each with its own lr and batch (SEED003_OPTIMIZER; a flag given on the command line wins, for both);
    isotropic and anisotropic test error at the query, steps and samples to 90% of the loss drop."""
    given = getattr(args, 'optimizer_given', [])
    if given:
        print(f"--sweep linear: {', '.join('--' + k for k in given)} given: used for both architectures instead "
              f"of seed 003's per-architecture values (SEED003_OPTIMIZER)")
    optimizer = {attn: {k: v for k, v in o.items() if k not in given} for attn, o in SEED003_OPTIMIZER.items()}
    points = {f'{attn} {L}-layer': (variant(args, attn=attn, n_layer=L, n_head=4, n_embd=args.linear_width, d=5,
                                            n_points=11, test_cov='aniso', **optimizer[attn],
                                            grad_clip=1.0, qk_ln=False),   # seed 003: clip 1, GPT-2 blocks (no QK-LN)
                                    f'linear_{attn}_L{L}{run_tag(args)}')
              for L in sorted(ints(args.depths), reverse=True) for attn in ('standard', 'linear')}
    depths = sorted({a.n_layer for a, _ in points.values()})

    def row(k, rs):
        row = table_row(k, rs, train_loss=lambda r: r['final_train_loss_ema'] / r['config']['d'],
                        test=lambda r: r['model']['query'], aniso_test=lambda r: r['model_shifted']['query'],
                        steps_to_90=lambda r: steps_to_90(r['history']))
        batch = rs[0]['config']['batch_size']
        return dict(row, params=rs[0]['body_params'], lr=rs[0]['config']['lr'], batch_size=batch,
                    samples_to_90=None if row['steps_to_90'] is None else row['steps_to_90'] * batch)

    def plot(path, sweep, by_point):
        plot_curves(path, by_point, 'query', lambda k, rs: (
            'step', f"C{depths.index(rs[0]['config']['n_layer'])}", '-' if k.startswith('standard') else '--'), (6, 4),
            [(f'{name} baseline', sweep['baselines'][name]['query']) for name in ('averaging', 'zero')],
            yscale='log', xlabel='step', ylabel='held-out error at the query (d = 5, 10 pairs)',
            title='softmax vs linear attention (seed 003 setting, CPU scale)\nmean and min-max over seeds')
    return run_sweep(args, points, row, ['model', 'lr', 'batch_size', 'params', 'train_loss', 'test', 'aniso_test',
                                         'steps_to_90', 'samples_to_90', 'time_s'], plot, lambda first, table: dict(
        baselines_query={k: v['query'] for k, v in first['baselines'].items()},
        baselines_query_aniso={k: v['query'] for k, v in first['baselines_shifted'].items()}))[0]


SWEEPS = {'bottleneck': sweep_bottleneck, 'compute': sweep_compute, 'linear': sweep_linear}

# -----------------------------------------------------------------------------
# main: flags checked, a sweep's recipe applied, then one run or a sweep

def check_args(parser, args):
    """One-line errors (exit 2) for flag values outside their range, before any work."""
    if args.attn not in ATTN_NAMES:
        parser.error(f'--attn {args.attn!r} is not in the registry; valid: {", ".join(ATTN_NAMES)}')
    check_numbers(parser, args, dict(read_in_std='[0, 100]', pos_std='[0, 100]', noise_std='[0, 100]',
                                     curr_ratio='(0, 1]', eval_seed=f'[-1, {2 ** 63 - 1 - SHIFTED_SEED_OFFSET}]'))
    n_tokens = 2 * max(args.n_points, 2 * args.d)               # a prompt: (x, y) tokens, n_points 0 = 2d pairs
    scores = 4 * args.batch_size * args.n_head * n_tokens ** 2  # one layer's fp32 attention scores: a lower bound
    evals = 8 * args.n_eval * n_tokens * (args.d + 2)            # held-out prompts and their errors, float64
    boot = 8 * args.n_boot * (args.n_eval + n_tokens)            # the bootstrap's weights and means
    for what, need in ((f"--n_points {args.n_points} with --batch_size {args.batch_size} --n_head {args.n_head}: "
                        "one layer's attention scores alone", scores), (f"--n_eval {args.n_eval}", evals),
                       (f"--n_boot {args.n_boot} with --n_eval {args.n_eval}", boot)):
        if need > physical_memory():
            parser.error(f"{what} would need {need / 2 ** 30:.0f} GiB, this machine has "
                         f"{physical_memory() / 2 ** 30:.0f} GiB")
    check_ranges(parser, args, positive=[
        'd', 'max_iters', 'batch_size', 'lr', 'n_layer', 'n_head', 'n_embd', 'window', 'btt_rank', 'mup_base_width',
        'n_eval', 'n_eval_during', 'n_boot', 'log_interval', 'compute_width', 'linear_width',
        'curr_d_start', 'curr_n_start', 'seeds'], non_negative=[
        'n_points', 'warmup_iters', 'weight_decay', 'grad_clip', 'noise_std', 'pos_std', 'eval_interval',
        'curr_interval', 'threads', 'workers'])
    for name in ('widths', 'depths') + (('full_rank_widths',) if args.full_rank_widths else ()):   # '' = every width
        try:
            values = ints(getattr(args, name))
        except ValueError:
            values = [0]
        if min(values) <= 0:
            parser.error(f"--{name} {getattr(args, name)!r}: expected comma-separated positive integers")
        no_repeats(parser, name, values)
    for name, items, like in (
            ('compute_ranks', [('1', r) for r in args.compute_ranks.split(',')], "ranks, e.g. '4|2|1|1,4|4'"),
            ('bottleneck_ranks', [i.partition(':')[::2] for i in args.bottleneck_ranks.split(',')]
             if args.bottleneck_ranks else [], "'head width:ranks,...', e.g. '4:1|1|2,8:4|2|1|1'")):
        try:
            ok = all(int(w) > 0 and min(parse_ints(r, name) or [0]) > 0 for w, r in items)
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"--{name} {getattr(args, name)!r}: expected comma-separated {like}, every rank positive")
    bad = [m for m in args.full_rank_models.split(',') if m not in FULL_RANK_MODELS]
    if bad:
        parser.error(f"--full_rank_models {args.full_rank_models!r}: {bad[0]!r} is not a model here; expected "
                     f"comma-separated names among {', '.join(FULL_RANK_MODELS)}")
    try:
        ok = all(w > 0 and lr > 0 for w, lr in width_lrs(args).items())  # lr > 0 is False for nan too
    except ValueError:
        ok = False
    if not ok:
        parser.error(f"--width_lrs {args.width_lrs!r}: expected 'width:lr,...' with positive widths and lrs, "
                     "e.g. '32:5e-5'")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out_dir and --overwrite replaces it: give one of them")
    if os.path.basename(args.run_name) != args.run_name or args.run_name in ('.', '..'):
        parser.error(f"--run_name {args.run_name!r}: a file name in --out_dir, without a '/'")


def apply_recipe(parser, args, given):
    """The sweep's CPU recipe (SWEEP_RECIPE, LARGER_D_RECIPE), then --quick's, for every flag not given."""
    larger_d = LARGER_D_RECIPE.get(args.d, {}) if args.sweep == 'bottleneck' else {}
    if larger_d and args.quick:
        parser.error(f'--quick is the d = {DEFAULTS["d"]} bottleneck sweep\'s short version; the d = {args.d} '
                     f'sweep has none (drop --quick, or --d)')
    for k, v in {**SWEEP_RECIPE[args.sweep], **larger_d, **(QUICK[args.sweep] if args.quick else {})}.items():
        if k not in given and not (k in PER_WIDTH and 'widths' in given):   # per-width: the recipe's widths
            setattr(args, k, v)
    args.optimizer_given = sorted(given & set(SEED003_OPTIMIZER['linear']))   # sweep_linear: these win too
    for flag in ('full_rank_widths', 'width_lrs'):
        ws = ints(args.full_rank_widths or args.widths) if flag == 'full_rank_widths' else width_lrs(args)
        if not set(ws) <= set(ints(args.widths)):
            parser.error(f"--{flag} {getattr(args, flag)!r}: its widths must be among --widths {args.widths!r}")


@owns_run_folders
def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    given = given_flags(parser, argv)
    args._given = sorted(given)
    check_args(parser, args)
    check_mode_flags(parser, given, [(args.sweep, '--sweep', group_flags(parser, 'sweeps') | {'assets_dir'}),
                                     *switched(args, parser)])
    per_run = sorted(set(SWEEP_SETS.get(args.sweep, ())) & given)
    if per_run:
        parser.error(f"--{per_run[0]} does not go with --sweep {args.sweep}: it sets that for each of its runs")
    other = {f: k for k, fs in SWEEP_OWN.items() if k != args.sweep for f in fs if f in given}
    if args.sweep and other:
        parser.error(f"--{min(other)} is a flag of --sweep {other[min(other)]}, not of --sweep {args.sweep}")
    if args.sweep:
        apply_recipe(parser, args, given)
    a = resolve(args)          # bad settings: a ValueError, one line from runs.run_main, before any work
    pick_device(args.device)
    if not args.sweep:
        Transformer(model_config(a))
        if not args.resume:
            runs.check_flags_read(a, args._given, True)
    if args.sweep:
        payload = SWEEPS[args.sweep](args)
        plots = [f"icl_{payload['sweep']}.png"] + [f'icl_position{run_tag(args)}.png'] * (args.sweep == 'bottleneck')
        report_outputs(results=os.path.join(args.out_dir, f"sweep_{payload['sweep']}.json"),
                       runs=os.path.join(args.out_dir, '<run>', '<run>.json and .pt'),
                       plots=', '.join(os.path.join(args.out_dir, p) for p in plots), copies_in=args.assets_dir or None)
        return payload
    layers = args.layer_pattern.replace(' ', '').replace(',', '-') or args.attn     # a layer pattern overrides --attn
    run_name = args.run_name or f'icl_{layers}_H{args.n_head}_D{args.n_embd}'
    if args.resume:   # one run: the checkpoint's settings win, and a flag that conflicts with them is refused
        path = os.path.join(args.out_dir, f'{run_name}.pt')
        others = [] if os.path.exists(path) else sorted(glob.glob(os.path.join(glob.escape(args.out_dir), 'icl_*.pt')))
        if others:   # the run's name comes from --attn, --n_head, --n_embd (or --run_name)
            raise ValueError(f"--resume: no checkpoint {os.path.basename(path)} in {args.out_dir!r}, which holds "
                             f"{', '.join(map(os.path.basename, others))}: give the --attn, --n_head and --n_embd "
                             f"of that run (or its --run_name)")
        ck = load_checkpoint(path, SCRIPT, ('config', 'state'))
        args.n_points = a.n_points                   # resolved: a given 0 is 2d, as the checkpoint holds it
        check_resume(ck['config'], args, args._given, ck['state']['step'])
    results = train(args, run_name=run_name)
    plot = os.path.join(args.out_dir, 'icl_position.png')
    plot_positions({f'{args.attn}, H={args.n_head}, D={args.n_embd}': results}, plot, 'error per position')
    report_outputs(**results['outputs'], plot=plot)
    return results


if __name__ == '__main__':
    run_main(main)  # errors, divergence and Ctrl-C end in one line (runs.run_main)
