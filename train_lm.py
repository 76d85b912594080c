r"""
Character-level language modelling with structured attention (paper §5.1, Fig. 4; §3.4, App. E).

A GPT (token embeddings, + learned positions if --pos learned -> the attention.py Transformer -> a muP LM head)
trained with AdamW in the nanoGPT manner. The default corpus needs no download: the source code of the Python
standard library of the interpreter running this script (~12 MB of .py files, tests excluded), split into
train/val by file, so the validation code is never seen in training.

    python train_lm.py --attn mlr                       # MLR attention: val ~1.53 nats/char after 1000 steps,
                                                        # about 4 min on an idle 2-core CPU
    python train_lm.py --attn swa --window 32           # or standard (the default), global_swa, brl, ...
    python train_lm.py --attn mlr --resume              # continue out/lm_mlr exactly where it stopped
    python train_lm.py --attn mlr --sample --prompt "def "   # generate from out/lm_mlr/ckpt.pt with the KV cache
    python train_lm.py --compare out/lm_standard out/lm_mlr --plot out/lm_compare.png
    python train_lm.py --by_position out/lm_standard out/lm_mlr   # val loss at each position of the context
    python train_lm.py --sweep compare --seeds 3        # 5 variants x learned / RoPE x 3 seeds at equal FLOPs,
                                                        # T = 1024, in out/lm_sweep (rerun it to resume)
    python train_lm.py --sweep compare --estimate       # time a few steps per variant and print the sweep's minutes
    python train_lm.py --bench                          # tokens/s: ours vs a nanoGPT-equivalent model
    python train_lm.py --data input.txt                 # any text file, or a directory of text files
    torchrun --standalone --nproc_per_node=2 train_lm.py --device cpu   # DDP (gloo on CPU, nccl on GPU)
    python train_lm.py --preset paper --attn mlr --data owt.txt         # the official MLR run (PRESETS), for a GPU
    python train_lm.py --preset paper --attn mlr --max_iters 2 --batch_size 1 --grad_accum 1 --eval_iters 1 \
        --device cpu                                                    # its CPU smoke run
"""

import argparse
import hashlib
import math
import os
import re
import sys
import sysconfig
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

# runs first: before torch loads, it sets OpenMP's wait policy and a start-up Ctrl-C handler
from runs import (ArgParser, FORMAT, Interrupted, Run, add_model_args, add_sweep_args, atomic_write, check_loss,
                  brl_bytes, check_flags_read, check_model_settings, check_mode_flags, check_mode_reads, check_numbers,
                  check_run_length, check_writable, clear_earlier_run, content_digest, ctrl_c_finishes_step,
                  given_flags, group_flags, io_errors, load_checkpoint, longest_first_wall, mean_std, model_config,
                  no_repeats, one_thread_seconds, owns_run_folders, paired_difference, paired_rows, physical_memory,
                  pick_device, plot_seed_bands, pm, positive_int, prepare_out_dir, read_json, remove_orphan_tmp,
                  report_outputs, require_keys, require_numbers, resume_settings, rng_state, run_main, run_state,
                  save_checkpoint, set_rng_state, sweep, unread_flags, without_flags, write_json)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from attention import (ATTENTION, LOGIT_SCALES, NON_NEGATIVE_FIELDS, POSITIONS, POSITIVE_FIELDS, ModelConfig, MupLinear,
                       Transformer, optimizer_groups, paper_logit_scale)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = 'train_lm.py'


# -----------------------------------------------------------------------------
# config: presets and flags, checked before any work

# Every value of a preset, with its source. "official" = the paper's public code (the MLR run of
# scripts/language_modeling/submit_language_modeling_greene.sh over config/struct_configs/train_struct_gpt2.py and
# train.py's defaults; src/model.py, src/muP.py, src/lr_schedule.py). Flags on the command line override a preset.
PRESETS = {
    # The project's CPU scale (--attn mlr: ~4 min on an idle 2-core CPU); the README's numbers.
    'cpu': dict(
        n_layer=4, n_head=4, n_embd=128, block_size=256,   # CPU scale (official: 6 layers, 12 x 64, T = 1024)
        ranks='auto',                 # official 32|8|6|4|4|4|4|2 scaled to d = 32 (default_ranks)
        window=32,                    # T/8 look-back, as the official 128 at T = 1024
        global_layers='1,3',          # project choice for 4 layers (official: 0-based 0 and 3 of 6)
        gswa_ranks='',                # half|half of the head (official 32|32 at d = 64)
        qk_ln=False, mlr_divide_levels=False,        # project defaults (official: both on)
        bilinear_rms_cap=False, btt_factors='sqrt',  # project defaults (official: on, official factors)
        logit_scale='auto',           # MLR 1/r_l (official), standard / SWA 1/sqrt(d) (official LM: 8/d)
        mup_alpha=8.0, mup_base_width=128,   # base width = our D (official 768)
        emb_std=1.0,                  # the project's N(0, 1) muP input layer (official 0.02)
        batch_size=16, grad_accum=1,  # 4096 chars / step (official 32 x 1024)
        lr=3e-3, weight_decay=0.1, adam_eps=1e-8,    # tuned here (official 1.65e-2, 0, 1e-20)
        warmup_iters=100, lr_schedule='constant', max_iters=1000,   # official schedule shape, shorter
        eval_interval=100, eval_iters=20),
    # The official MLR language-model run (paper §5.1, Fig. 4), value by value.
    'paper': dict(
        n_layer=6,                    # train_struct_gpt2.py: n_layer = 6
        n_embd=768, n_head=12,        # submit script: d_model 768; config: d_head = 64 -> 12 heads
        block_size=1024, ranks='32|8|6|4|4|4|4|2',   # submit script: block_size=1024, mlr_rank_list
        mlr_divide_levels=True,       # submit script: mlr_block_divide_by_num_levels=True (covering levels)
        qk_ln=True,                   # config: do_qk_ln = True (MLR: whole head, before the rank split)
        logit_scale='paper',          # per --attn (attention.LOGIT_SCALE_DEFAULTS): MLR 1/r_l, standard / SWA 8/d
        mup_alpha=8.0,                # src/model.py: k * 8 / sqrt(d) when mha_SP_attn_logits_scaling=False
        mup_base_width=768,           # src/muP.py: base_width_factor = 768 (lr x 768 / fan_in)
        emb_std=0.02,                 # src/muP.py: wte and wpe N(0, 0.02^2), lr x 1
        window=128,                   # paper caption T' = 128; submit script's sequential-GSWA block
        global_layers='0,3',          # config: sequential_GSWA_layer_list MHA|SWA|SWA|MHA|SWA|SWA (paper: 1 and 4)
        gswa_ranks='32|32',           # config: gswa_rank_list (global_swa_split)
        bilinear_rms_cap=True,        # src/model.py: bilinear projections always rescaled (`if True:`)
        btt_factors='official',       # src/model.py: BilinearBTTAttention.factorize
        batch_size=4, grad_accum=8,   # submit script batch_size=4; config gradient_accumulation_steps = 8
        lr=1.65e-2,                   # submit script: init_lr 1.65e-2 (MLR, D = 768)
        weight_decay=0.0, lr_schedule='constant',   # config: weight_decay = 0.0, decay_lr = False
        adam_eps=1e-20,               # src/muP.py: AdamW(..., eps=1e-20); betas 0.9, 0.95 as our default
        warmup_iters=2000,            # train.py: warmup_iters = 2000 (linear from 0)
        max_iters=100_000, eval_interval=200,       # config: max_iters = 100_000, eval_interval = 200
        eval_iters=200),              # train.py: eval_iters = 200; bf16 on GPU is --dtype auto, as train.py
}
# The seeded comparison of `--sweep compare`: the official run at a width, batch and length that fit 5 variants x
# 3 seeds into a few hours on an idle 2-core CPU (--sweep compare --estimate).
PRESETS['compare'] = {
    **PRESETS['paper'],
    'n_embd': 128, 'n_head': 2,       # the official head width 64; width 128 instead of 768: CPU budget
    'ranks': 'auto',                  # = the official 32|8|6|4|4|4|4|2 at d = 64, T = 1024 (default_ranks)
    'batch_size': 4, 'grad_accum': 1,  # 4096 chars / step: CPU budget (official 4 x 8 x 1024)
    'lr': 3e-3,                       # official lr of every structure at the smallest width (D = 256, plotting
                                      # notebook), shared by all variants; not tuned here (MLR at 768: 1.65e-2)
    'warmup_iters': 100,              # official 2000 of 100k steps; longer in proportion for a short run
    'max_iters': 1000,                # the standard run's steps: the sweep's equal FLOPs (official 100k)
    'eval_interval': 50,              # official 200 of 100k; more often for a short run's curves
    'eval_iters': 20,                 # official 200 x 32 sequences; 20 x 4 here, the same batches every time
}

SWEEP_VARIANTS = ('standard', 'mlr', 'swa', 'global_swa', 'brl')
LM_MODEL_DEFAULTS = dict(ranks='auto')   # where train_lm.py's defaults differ from ModelConfig's (and PRESETS['cpu'])


def build_parser():
    """The flags, one group per stage, in --help order; the defaults shown are preset cpu's."""
    p = ArgParser(prog=SCRIPT, description=__doc__)
    g = p.add_argument_group('mode (default: train)')
    g.add_argument('--sample', action='store_true', help='generate text from <out_dir>/ckpt.pt instead of training')
    g.add_argument('--compare', nargs='+', metavar='RUN_DIR', help='plot val loss vs FLOPs and vs time of runs')
    g.add_argument('--by_position', nargs='+', metavar='RUN_DIR', help="val loss at each position of the context "
                   "of finished runs' checkpoints, seeds of a variant pooled")
    g.add_argument('--plot', default='', help='--compare, --by_position: output image; empty: out/lm_<mode>.png')
    g.add_argument('--bench', action='store_true', help='tokens/s of standard/mlr/swa vs a nanoGPT-equivalent model')
    g = add_sweep_args(p, 'compare', SWEEP_VARIANTS, os.path.join('out', 'lm_sweep'),
                       'seeded sweep (--sweep compare): every variant at equal training FLOPs',
                       'train --variants x --positions x --seeds to the FLOPs of --max_iters standard steps')
    g.add_argument('--positions', default='learned,rope', help='--sweep: comma list of --pos values')
    g.add_argument('--lrs', default='', help='--sweep: lr grid (e.g. 1e-3,3e-2) at 1/3 budget, then seeds at the best')

    g = p.add_argument_group('data')
    g.add_argument('--data', default='', help='text file or directory (default: the Python stdlib source)')
    g.add_argument('--cache_dir', default=os.path.join(HERE, 'data', 'lm'), help='where encoded corpora are cached')

    g = p.add_argument_group('LM model (besides the shared model group below)')
    g.add_argument('--preset', choices=sorted(PRESETS), default='cpu', help='default values (PRESETS)')
    g.add_argument('--block_size', type=positive_int, help='context length T')
    g.add_argument('--emb_std', type=float, help='init std of the token and position embeddings')
    add_model_args(p, **LM_MODEL_DEFAULTS)
    flag = p._option_string_actions
    flag['--ranks'].help += "; auto: the paper's 32|8|6|4|4|4|4|2 scaled to d and T (default_ranks)"
    flag['--logit_scale'].help += "; paper: the official LM run's scale for --attn (attention.LOGIT_SCALE_DEFAULTS)"

    g = p.add_argument_group('optimization')
    g.add_argument('--batch_size', type=positive_int, help='sequences per micro-step per process')
    g.add_argument('--grad_accum', type=positive_int, help='micro-steps per optimizer step')
    g.add_argument('--max_iters', type=positive_int, help='optimizer steps')
    g.add_argument('--max_flops', type=float, default=0.0, help='stop once training FLOPs reach this (0 = off)')
    g.add_argument('--lr', type=float, help='base AdamW lr (muP scales it per parameter)')
    g.add_argument('--lr_schedule', choices=['constant', 'cosine'], default='constant', help='after the warmup')
    g.add_argument('--warmup_iters', type=int, help='linear warmup steps')
    g.add_argument('--weight_decay', type=float, help='AdamW weight decay (matrices only)')
    g.add_argument('--beta2', type=float, default=0.95, help='AdamW beta2 (beta1 0.9)')
    g.add_argument('--adam_eps', type=float, help='AdamW eps')
    g.add_argument('--grad_clip', type=float, default=1.0, help='clip the gradient norm (0 = off)')

    g = p.add_argument_group('eval, logging, checkpoints')
    g.add_argument('--out_dir', default='', help="run directory ('' = out/lm_<attn>)")
    g.add_argument('--eval_interval', type=positive_int, help='steps between val evaluations + checkpoints')
    g.add_argument('--eval_iters', type=positive_int, help='val batches per evaluation')
    g.add_argument('--log_interval', type=positive_int, default=10, help='steps between log lines')
    g.add_argument('--resume', action='store_true', help='continue from <out_dir>/ckpt.pt')
    g.add_argument('--overwrite', action='store_true', help='replace the run in <out_dir>')
    g.add_argument('--progress', action=argparse.BooleanOptionalAction, default=True, help='tqdm progress bar')

    g = p.add_argument_group('system')
    g.add_argument('--device', default='auto', help='auto (cuda if available), cpu, cuda, cuda:N')
    g.add_argument('--dtype', choices=['auto', 'float32', 'bfloat16'], default='auto', help='auto: bf16 on GPU')
    g.add_argument('--compile', action='store_true', help='torch.compile the model')
    g.add_argument('--threads', type=int, default=0, help='torch CPU threads (0 = torch default, one per core)')
    g.add_argument('--seed', type=int, default=1337, help='model init and data order')

    g = p.add_argument_group('sampling (--sample)')
    g.add_argument('--prompt', default='def ', help='text to continue')
    g.add_argument('--max_new_tokens', type=positive_int, default=300, help='characters to generate')
    g.add_argument('--num_samples', type=positive_int, default=1, help='samples to draw')
    g.add_argument('--temperature', type=float, default=0.8, help='0 = greedy')
    g.add_argument('--top_k', type=int, default=0, help='keep the k most likely characters (0 = all)')
    g.add_argument('--no_cache', action='store_true', help='recompute the full context every token')
    g = p.add_argument_group('benchmark (--bench)')
    g.add_argument('--bench_steps', type=positive_int, default=3, help='timed steps per repeat')
    g.add_argument('--bench_reps', type=positive_int, default=6, help='repeats, in rotating order (the best counts)')
    p.set_defaults(**PRESETS['cpu'])  # so --help shows the default preset's values
    return p


def parse_args(argv=None):
    parser = build_parser()
    args, given = parser.parse_args(argv), given_flags(parser, argv)   # the flags on the command line
    preset = args.sweep if args.sweep and 'preset' not in given else args.preset
    parser.set_defaults(**PRESETS[preset], preset=preset)  # --sweep compare: --preset compare unless one is given
    args = parser.parse_args(argv)
    args._given = sorted(given)
    check_args(parser, args)
    args.out_dir = args.out_dir or os.path.join('out', f"lm_{args.attn}")
    if args.logit_scale == 'paper':  # the official LM run's scale for this --attn
        args.logit_scale = paper_logit_scale(args.attn, args.layer_pattern, args.n_layer, args.global_layers)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # --sweep: its runs inherit these flags
    if not (args.resume or args.sample or args.compare or args.by_position):
        models = ((args.variants.split(','), f'--variants {args.variants}') if args.sweep else
                  (['standard', 'mlr', 'swa'], '--bench (standard, mlr, swa)') if args.bench else ())
        check_flags_read(args, args._given, True, *models)
    return args


# the intervals of train_lm.py's numeric flags (runs.RANGES: lr, seed, ...; any other must be finite)
RANGES = {**{name: '(0, inf)' for name in POSITIVE_FIELDS}, **{name: '[0, inf)' for name in NON_NEGATIVE_FIELDS},
          'window': '(0, inf)', 'mlp_hidden': '[0, inf)', 'mup_alpha': '(0, 1000]', 'brl_beta': '[0, 1]',
          'emb_std': '[0, 100]', 'beta2': '[0, 1)', 'adam_eps': '(0, 1]', 'grad_clip': '[0, inf)',
          'warmup_iters': '[0, inf)', 'max_flops': '[0, inf)', 'temperature': '[0, inf)', 'top_k': '[0, inf)'}


def check_args(parser, args):
    """parser.error (one line, exit 2) at the first flag value train_lm.py cannot run; the model's own
    consistency (ranks summing to d, ...) is checked when it is built (attention.check_config)."""
    check_numbers(parser, args, RANGES)
    # a lower bound of a training step's fp32 bytes: weights, gradients and AdamW's moments of the MLPs and position
    # embeddings (16 bytes a parameter), the residual stream and MLP activations kept for the backward pass, and
    # BRL's compressed tokens (brl_bytes)
    a, hidden, ram = args, args.mlp_hidden or 4 * args.n_embd, physical_memory()
    need = (16 * (a.n_layer * 2 * a.n_embd * hidden + a.block_size * a.n_embd) + brl_bytes(a, a.block_size, True) +
            4 * a.n_layer * a.batch_size * a.block_size * (a.n_embd + hidden))
    if need > ram:
        brl = f" --n_compressed {a.n_compressed}" if a.attn == 'brl' else ''
        parser.error(f"--batch_size {a.batch_size} --block_size {a.block_size} --n_embd {a.n_embd} "
                     f"--n_layer {a.n_layer} --mlp_hidden {a.mlp_hidden}{brl}: a training step needs at least "
                     f"{need / 2 ** 30:.0f} GiB of memory, this machine has {ram / 2 ** 30:.0f} GiB")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out_dir and --overwrite replaces it: give one of them")
    valid = list(ATTENTION) + ['global_swa']
    choices = dict(attn=valid, logit_scale=LOGIT_SCALES + ('paper',), btt_factors=('sqrt', 'official'),
                   brl_history=('global', 'block'), pos=POSITIONS)
    for name, ok in choices.items():
        if getattr(args, name) not in ok:
            parser.error(f"--{name} {getattr(args, name)!r}: valid are {', '.join(ok)}")
    bad = [v for v in args.variants.split(',') if v not in valid]
    if bad:
        parser.error(f"--variants {args.variants!r}: {bad[0]!r} is not an attention variant; valid (comma "
                     f"list): {', '.join(valid)}")
    args._positions = [s.strip() for s in args.positions.split(',') if s.strip()]
    if not args._positions or any(p not in POSITIONS for p in args._positions):
        parser.error(f"--positions {args.positions!r}: a comma list of {', '.join(POSITIONS)}")
    try:                                                         # '' = no grid; an empty entry is a mistake
        args._lrs = [float(s) for s in args.lrs.split(',')] if args.lrs.strip() else []
    except ValueError:
        parser.error(f"--lrs {args.lrs!r}: a comma list of learning rates, e.g. 1e-3,3e-3,1e-2")
    if any(not 0 < lr <= 10 for lr in args._lrs):
        parser.error(f"--lrs {args.lrs!r}: every lr must be in (0, 10]")
    for name, items in (('variants', args.variants.split(',')), ('positions', args._positions), ('lrs', args._lrs),
                        ('global_layers', [s.strip() for s in args.global_layers.split(',')]),
                        ('compare', [os.path.normpath(r) for r in args.compare or []]),
                        ('by_position', [os.path.normpath(r) for r in args.by_position or []])):
        no_repeats(parser, name, items)
    check_modes(parser, args)


def check_modes(parser, args):
    """One mode at a time, and no flag given that the mode does not read (--lr with --sample, --temperature
    without it) or that the sweep sets for each run: one line, exit 2."""
    modes = [f'--{m}' for m in ('sample', 'compare', 'by_position', 'bench', 'sweep') if getattr(args, m)]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)}: one mode at a time")
    model = {f.name for f in fields(ModelConfig)} - {'attn', 'layer_pattern'}
    for mode, reads, why in (
            ('sample', {'out_dir', 'attn', 'seed', *group_flags(parser, 'sampling')}, "reads the checkpoint's "
             "settings (of the flags: --out_dir or --attn, --seed and the sampling group)"),
            ('compare', {'plot'}, "reads the runs' log.json (of the flags: --plot)"),
            ('by_position', {'plot', 'cache_dir'}, "reads the runs' checkpoints (of the flags: --plot, --cache_dir)"),
            ('bench', model | {'batch_size', 'block_size', 'seed', 'preset', *group_flags(parser, 'benchmark')},
             "times nanoGPT, standard, mlr and swa at the model flags' sizes (fp32, no compile; random tokens)")):
        if getattr(args, mode):
            check_mode_reads(parser, args._given, mode, reads, why)
    if args.sample and {'attn', 'out_dir'} <= set(args._given):
        parser.error(f"--attn {args.attn} with --sample only names the run folder out/lm_{args.attn}, and --out_dir "
                     f"names it here: leave --attn out (the model is the checkpoint's)")
    per_run = {'attn', 'layer_pattern', 'pos', 'max_flops', 'resume', 'overwrite', 'out_dir'} & set(args._given)
    if args.sweep and per_run:       # the sweep sets these for each run: --variants, --positions, its budget
        parser.error(f"--{min(per_run)} does not go with --sweep: it sets that for each run (--variants, "
                     f"--positions, the FLOPs of --max_iters standard steps, a folder in --sweep_dir; a rerun "
                     f"resumes by itself)")
    check_mode_flags(parser, args._given, [(args.sweep, '--sweep', group_flags(parser, 'seeded sweep')),
                                           (args.sample, '--sample', group_flags(parser, 'sampling')),
                                           (args.bench, '--bench', group_flags(parser, 'benchmark'))])
    if args.plot and not (args.compare or args.by_position):
        parser.error(f"--plot {args.plot!r}: only with --compare or --by_position")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in ('.png', '.pdf', '.svg'):
        parser.error(f"--plot {args.plot!r}: an image file ending in .png, .pdf or .svg")
    args.plot = args.plot or os.path.join('out', 'lm_by_position.png' if args.by_position else 'lm_compare.png')


# -----------------------------------------------------------------------------
# data: corpus -> character vocabulary -> uint8/uint16 memmap cache, keyed on the corpus's bytes

STDLIB_SKIP_DIRS = {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__'}
CACHE_FORMAT = 1  # bump when the cache layout changes


def list_files(root, keep_dir, keep_file):
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]  # prunes the walk
        files += [os.path.join(dirpath, f) for f in filenames if keep_file(f)]
    return sorted(files)


def stdlib_files():
    """The .py files of the running interpreter's standard library, tests and site-packages excluded, sorted."""
    root = sysconfig.get_paths()['stdlib']
    return root, list_files(root, lambda d: d not in STDLIB_SKIP_DIRS, lambda f: f.endswith('.py'))


def read_text(path):
    """File contents as str, or None for a binary / non-UTF-8 file."""
    with open(path, 'rb') as f:
        raw = f.read()
    try:
        return None if b'\0' in raw[:8192] else raw.decode('utf-8').replace('\r\n', '\n')
    except UnicodeDecodeError:
        return None


def prepare_data(data, cache_dir):
    """Build (once) and return the cache dir holding train.bin, val.bin and meta.json for `data`
    ('' = the standard library corpus). The cache is keyed on the files' bytes (runs.content_digest), so any
    edit builds a new one. Validation text comes from files never used for training: every 10th file (the
    last one if there are fewer than 10); a single file is split 90/10 at a line break."""
    if data:  # a text file, or every non-hidden file under a directory
        if not os.path.exists(data):
            raise ValueError(f"--data {data!r}: no such file or directory")
        root = os.path.abspath(data)
        files = [root] if os.path.isfile(root) else list_files(root, lambda d: d[0] != '.', lambda f: f[0] != '.')
        name = re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(root.rstrip('/')) or 'data')
    else:
        root, files = stdlib_files()
        name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
    with io_errors('--data', data or root):
        key = hashlib.sha256(f"{CACHE_FORMAT} {bool(data)} {content_digest(files)}".encode()).hexdigest()
    out = os.path.join(cache_dir, f"{name}-{key[:10]}")
    meta_path = os.path.join(out, 'meta.json')
    if os.path.exists(meta_path):
        return out  # meta.json is written last, so its presence means the cache is complete

    with io_errors('--data', data or root):
        texts = [read_text(f) for f in files]
    skipped = [os.path.relpath(f, root) if f != root else f for f, t in zip(files, texts) if t is None] if data else []
    if not data:  # printable ASCII and newline only
        texts = [re.sub(r'[^\x20-\x7e\n]', '', t) for t in texts if t]
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"--data {data or root!r}: found no non-empty UTF-8 text in {len(files)} file(s)")
    if len(texts) == 1:
        cut = texts[0].rfind('\n', 0, int(0.9 * len(texts[0]))) + 1 or int(0.9 * len(texts[0]))
        train_text, val_text = texts[0][:cut], texts[0][cut:]
    else:
        val_idx = set(range(9, len(texts), 10)) or {len(texts) - 1}
        train_text = '\n'.join(t for i, t in enumerate(texts) if i not in val_idx)
        val_text = '\n'.join(t for i, t in enumerate(texts) if i in val_idx)
    itos = sorted(set(train_text) | set(val_text))
    if len(itos) > 65535:
        raise ValueError(f"--data {data!r} has {len(itos)} distinct characters; a uint16 cache holds at most 65535")
    dtype = np.uint8 if len(itos) <= 256 else np.uint16
    lut = np.zeros(ord(itos[-1]) + 1, dtype=dtype)  # code point -> token id
    lut[[ord(c) for c in itos]] = np.arange(len(itos))

    with io_errors('--cache_dir', cache_dir):
        os.makedirs(out, exist_ok=True)
        remove_orphan_tmp(out)  # of an earlier build that was killed
        for split, text in (('train', train_text), ('val', val_text)):
            ids = lut[np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)]
            if split == 'train':
                counts = np.bincount(ids, minlength=len(itos)).astype(np.float64)
            atomic_write(os.path.join(out, f"{split}.bin"), ids.tofile)
        p = counts[counts > 0] / counts.sum()
        write_json(meta_path, dict(source=data or root, itos=''.join(itos), dtype=np.dtype(dtype).name,
                                   n_files=len(texts), n_train=len(train_text), n_val=len(val_text),
                                   unigram_entropy=float(-(p * np.log(p)).sum()), skipped=skipped))
    return out


def data_key(cache):
    """The corpus's bytes, as prepare_data keys its cache: what a run records, so that an edited corpus is neither
    resumed nor reused."""
    return os.path.basename(os.path.normpath(cache))


def load_data(cache):
    meta = read_json(os.path.join(cache, 'meta.json'), '--cache_dir', ['dtype', 'itos', 'source'])
    with io_errors('--cache_dir', cache):
        splits = {s: np.memmap(os.path.join(cache, f"{s}.bin"), dtype=meta['dtype'], mode='r')
                  for s in ('train', 'val')}
    if meta.get('skipped'):  # said on every run that uses this cache, not only when it was built
        names = ', '.join(meta['skipped'][:5]) + (', ...' if len(meta['skipped']) > 5 else '')
        print(f"note: --data {meta['source']!r}: skipped {len(meta['skipped'])} file(s) that are not UTF-8 text "
              f"({names})")
    return splits, meta


def get_batch(data, batch_size, block_size, gen, rank=0, world_size=1):
    """Random windows of block_size + 1 characters: inputs x and targets y = x shifted by one, each (B, T).
    One generator is shared by all ranks (each takes its slice of the draw), so the data order is a function
    of (seed, step) only: resume and DDP stay exact."""
    ix = torch.randint(len(data) - block_size, (world_size * batch_size,), generator=gen)
    ix = ix[rank * batch_size:(rank + 1) * batch_size].tolist()
    xy = torch.from_numpy(np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64))  # (B, T+1)
    return xy[:, :-1], xy[:, 1:]


# -----------------------------------------------------------------------------
# model: embeddings -> attention.py Transformer -> muP LM head

class GPT(nn.Module):

    def __init__(self, config: ModelConfig, vocab_size, emb_std=1.0):
        super().__init__()
        self.config, self.vocab_size, self.emb_std = config, vocab_size, emb_std
        self.wte = nn.Embedding(vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == 'learned' else None
        self.body = Transformer(config)
        self.lm_head = MupLinear(config.n_embd, vocab_size, base_width=config.mup_base_width, zero_init=True)
        self.init_weights()

    def init_weights(self):
        """wte, wpe ~ N(0, emb_std^2) with lr x1 (muP input layer; --emb_std: ours 1, the official 0.02); the
        body initializes itself (hidden weights N(0, 1/fan_in), output projections zero); lm_head zero with
        lr x base_width/D (muP output layer), so the initial loss is exactly ln(vocab_size)."""
        nn.init.normal_(self.wte.weight, std=self.emb_std)
        if self.wpe is not None:
            nn.init.normal_(self.wpe.weight, std=self.emb_std)

    def forward(self, idx, targets=None, cache=None, pos=0):
        B, T = idx.shape
        x = self.wte(idx)                                                         # (B, T, D)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(pos, pos + T, device=idx.device))
        x = self.body(x) if cache is None else self.body(x, cache=cache)         # (B, T, D)
        logits = self.lm_head(x)                                                  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def forward_flops(self, T):
        """Forward FLOPs of one sequence of length T: the body's count + the LM head (embeddings are lookups)."""
        return self.body.forward_flops(T) + 2 * T * self.config.n_embd * self.vocab_size


PAPER_RANKS = [32, 8, 6, 4, 4, 4, 4, 2]  # paper §5.1: d = 64, 8 levels, T = 1024


def default_ranks(d, T=None, n_levels_ok=lambda L: True):
    """The paper's rank allocation 32|8|6|4|4|4|4|2 scaled to head width d (leftover rank to level 0).
    For MLR attention (T given) the paper's level blocks 1024/2^l (finest 8) are kept: levels whose block
    would cover the whole sequence of length T < 1024 are global and merge into level 0, so every distance
    gets the number of features it gets in the paper. Levels the model cannot have (n_levels_ok(L) False)
    merge into the level above."""
    r = [max(1, x * d // 64) for x in PAPER_RANKS]
    while sum(r) > d:
        r.pop()
    r[0] += d - sum(r)
    if T is not None:
        n_global = sum(1 for l in range(len(r)) if (1024 >> l) >= T)
        if n_global > 1:
            r = [sum(r[:n_global])] + r[n_global:]
    while len(r) > 1 and not n_levels_ok(len(r)):
        last = r.pop()
        r[-1] += last
    return '|'.join(map(str, r))


def build_config(cfg):
    """The ModelConfig of a run config (a plain dict, as stored in checkpoints): every model flag as given, the
    task's context length T, causal attention, and ranks 'auto' resolved by default_ranks for this model
    ('' without MLR); runs.model_config checks it."""
    if cfg['n_embd'] % cfg['n_head']:
        raise ValueError(f"--n_embd {cfg['n_embd']} must be divisible by --n_head {cfg['n_head']}")
    ranks, d, D, T = cfg['ranks'], cfg['n_embd'] // cfg['n_head'], cfg['n_embd'], cfg['block_size']
    if ranks == 'auto':
        mlr_ok = lambda L: T % 2 ** (L - 1) == 0                                  # MLR: T must halve L-1 times
        bilinear_ok = lambda L: D % 2 ** (L - 1) == 0 and D // 2 ** (L - 1) >= 8  # bilinear MLR: 2^(L-1) chunks >= 8
        uses = cfg['layer_pattern'] or cfg['attn']
        ranks = (default_ranks(d, None, lambda L: mlr_ok(L) and bilinear_ok(L)) if 'bilinear_mlr' in uses else
                 default_ranks(d, T, mlr_ok) if 'mlr' in uses else '')
    return model_config(argparse.Namespace(**cfg), block_size=cfg['block_size'], causal=True, ranks=ranks)


# -----------------------------------------------------------------------------
# training, in the order of nanoGPT's train.py: processes (DDP), evaluation, lr schedule, one step; then train():
# run folder and --resume -> data -> model and optimizer -> the loop, checkpointing at every evaluation

CKPT_KEYS = ('model', 'optimizer', 'config', 'step', 'itos')
# --resume: these flags may differ from the checkpoint's; any other flag given must agree with it
RESUME_OVERRIDES = {'max_iters', 'max_flops', 'eval_interval', 'eval_iters', 'log_interval', 'out_dir',
                    'device', 'dtype', 'compile', 'threads', 'progress', 'cache_dir', 'prompt', 'max_new_tokens',
                    'num_samples', 'temperature', 'top_k', 'no_cache', 'bench_steps', 'bench_reps', 'plot'}


def setup_processes(device_name):
    """DDP, nanoGPT-style (torchrun sets RANK / LOCAL_RANK / WORLD_SIZE), or one process."""
    device = pick_device(device_name)
    if int(os.environ.get('RANK', -1)) == -1:
        return argparse.Namespace(ddp=False, rank=0, world=1, device=device, master=True)
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    if device.startswith('cuda'):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return argparse.Namespace(ddp=True, rank=rank, world=world, device=device, master=rank == 0)


def log(proc, msg):
    if proc.master:
        tqdm.write(msg)     # above the progress bar
        sys.stdout.flush()  # so that a log file redirected from stdout is live


@torch.no_grad()
def evaluate(model, val, args, proc, autocast):
    """Mean loss over the same eval_iters batches of the val split every time (fixed seed), averaged over ranks."""
    model.eval()
    g = torch.Generator().manual_seed(0)
    losses = torch.zeros((), device=proc.device)
    for _ in range(args.eval_iters):
        x, y = get_batch(val, args.batch_size, args.block_size, g, proc.rank, proc.world)
        with autocast:
            losses += model(x.to(proc.device), y.to(proc.device))[1].float()
    if proc.ddp:
        dist.all_reduce(losses)
    model.train()
    return losses.item() / (args.eval_iters * proc.world)


def lr_at(it, args, max_iters):
    """Linear warmup to --lr over --warmup_iters steps; then constant, or cosine down to lr / 10 at max_iters."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    if args.lr_schedule == 'constant':
        return args.lr
    progress = (it - args.warmup_iters) / max(1, max_iters - args.warmup_iters)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model, optimizer, data, gen, args, proc, autocast, lr, step):
    """Optimizer step number step + 1 at lr (times each group's muP multiplier), over grad_accum micro-batches.
    -> the train loss (mean over micro-batches and ranks), checked before the update: a NaN stops here."""
    for g in optimizer.param_groups:
        g['lr'] = lr * g['lr_mult']
    loss_sum = torch.zeros((), device=proc.device)
    for micro in range(args.grad_accum):
        x, y = get_batch(data, args.batch_size, args.block_size, gen, proc.rank, proc.world)
        x, y = x.to(proc.device, non_blocking=True), y.to(proc.device, non_blocking=True)
        if proc.ddp:  # only sync gradients on the last micro-step
            model.require_backward_grad_sync = micro == args.grad_accum - 1
        with autocast:
            _, loss = model(x, y)
        (loss / args.grad_accum).backward()
        loss_sum += loss.detach()
    loss_t = loss_sum / args.grad_accum
    if proc.ddp:  # every rank sees the same loss, so that all stop together on a NaN
        dist.all_reduce(loss_t)
        loss_t /= proc.world
    lossf = check_loss(loss_t, step + 1, f"Try a lower --lr than {args.lr:g}, or a longer --warmup_iters "
                                         f"than {args.warmup_iters}")
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lossf


def train(args):
    """Train (or --resume) one GPT. -> its train losses of this invocation and val history (for tests)."""
    proc = setup_processes(args.device)
    # the run folder (DDP: rank 0 owns it for all ranks); --resume: the checkpoint's settings win (resume_settings)
    ckpt_path, log_path, ckpt = os.path.join(args.out_dir, 'ckpt.pt'), os.path.join(args.out_dir, 'log.json'), None
    earlier = prepare_out_dir(args.out_dir, [ckpt_path, log_path], args.resume, args.overwrite,
                              lock=int(os.environ.get('RANK', 0)) == 0)
    if args.resume:
        ckpt = load_checkpoint(ckpt_path, SCRIPT, CKPT_KEYS)
        resume_settings(ckpt['config'], args, args._given, RESUME_OVERRIDES)
    modes = ('compare', 'by_position')
    cfg = {**{k: v for k, v in vars(args).items() if not k.startswith('_') and k not in modes}, 'format': FORMAT}

    # data: rank 0 encodes the corpus once, the others wait for it; each split longer than a window of T + 1
    if proc.master:
        cache = prepare_data(args.data, args.cache_dir)
    if proc.ddp:
        dist.barrier()
        cache = prepare_data(args.data, args.cache_dir)
    splits, meta = load_data(cache)
    T = args.block_size
    for s in ('train', 'val'):
        if len(splits[s]) <= T + 1:
            raise ValueError(f"the {s} split of {meta['source']!r} has {len(splits[s])} characters; "
                             f"--block_size {T} needs more than {T + 1}")
    cfg['data_key'] = data_key(cache)
    if ckpt is not None and ckpt['itos'] != meta['itos']:
        raise ValueError(f"checkpoint {ckpt_path!r} was trained on a different vocabulary than {meta['source']!r}")
    if ckpt is not None and ckpt['config'].get('data_key', cfg['data_key']) != cfg['data_key']:
        raise ValueError(f"checkpoint {ckpt_path!r} was trained on other bytes of {meta['source']!r} (cache "
                         f"{ckpt['config']['data_key']}, now {cfg['data_key']}): train a new run in another --out_dir")

    # model and AdamW over its muP parameter groups; ranks 'auto' is stored resolved, so the checkpoint keeps it
    torch.manual_seed(cfg['seed'])
    mconf = build_config(cfg)
    if cfg['ranks'] == 'auto':
        cfg['ranks'] = mconf.ranks or 'auto'
    raw_model = GPT(mconf, len(meta['itos']), cfg['emb_std']).to(proc.device)
    optimizer = torch.optim.AdamW(optimizer_groups(raw_model, cfg['lr'], cfg['weight_decay']), lr=cfg['lr'],
                                  betas=(0.9, cfg['beta2']), eps=cfg['adam_eps'])
    gen = torch.Generator().manual_seed(args.seed)  # the data order
    step, flops, train_time, history = 0, 0.0, 0.0, []
    if ckpt is not None:  # --resume: weights, AdamW moments, data order and RNG streams as the checkpoint left them
        raw_model.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        gen.set_state(ckpt['data_rng'])
        set_rng_state(ckpt['rng'])
        step, flops, train_time, history = ckpt['step'], ckpt['flops'], ckpt['train_time'], ckpt['history']
    model = torch.compile(raw_model) if args.compile else raw_model
    if proc.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[int(os.environ['LOCAL_RANK'])] if proc.device.startswith('cuda') else None)
    dtype = args.dtype if args.dtype != 'auto' else ('bfloat16' if proc.device.startswith('cuda') else 'float32')
    autocast = (torch.autocast(device_type=proc.device.split(':')[0], dtype=torch.bfloat16)
                if dtype == 'bfloat16' else nullcontext())
    # run length: training FLOPs per step = 3 forwards; --max_flops may end the run before --max_iters
    tokens_per_iter = args.batch_size * args.grad_accum * proc.world * args.block_size
    flops_per_iter = 3 * raw_model.forward_flops(args.block_size) * args.batch_size * args.grad_accum * proc.world
    run_length = lambda c: min(c['max_iters'], math.ceil(c['max_flops'] / flops_per_iter)) if c['max_flops'] > 0 \
        else c['max_iters']
    max_iters = run_length(vars(args))
    if ckpt is not None:       # another --max_iters / --max_flops: the steps taken must keep their lr
        check_run_length(step, lambda s, n: lr_at(s, args, n), run_length(ckpt['config']), max_iters,
                         '--resume --max_iters / --max_flops')
    ranked = {'mlr', 'bilinear_mlr'} & set(raw_model.config.layer_kinds())    # the variants that read --ranks
    log(proc, f"attn={args.attn} ranks={raw_model.config.ranks if ranked else '-'} | "
        f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M params | data {meta['source']} "
        f"({meta['n_train'] / 1e6:.2f}M train / {meta['n_val'] / 1e6:.2f}M val chars, vocab {len(meta['itos'])}, "
        f"unigram entropy {meta['unigram_entropy']:.3f} nats) | {tokens_per_iter} tokens/step x {max_iters} steps, "
        f"{flops_per_iter:.3g} FLOPs/step | device {proc.device} {dtype} x{proc.world} | threads: "
        f"{torch.get_num_threads()}")

    def save():  # all that an exact resume needs (atomic: a failed write keeps the last); log.json for --compare
        with io_errors('--out_dir', args.out_dir):
            save_checkpoint(ckpt_path, dict(
                script=SCRIPT, model=raw_model.state_dict(), optimizer=optimizer.state_dict(), config=cfg,
                step=step, flops=flops, train_time=train_time, history=history, itos=meta['itos'],
                data_rng=gen.get_state(), rng=rng_state()))
            write_json(log_path, dict(config=cfg, history=history))
        clear_earlier_run(earlier, {ckpt_path, log_path})     # --overwrite: the earlier run goes with the first one

    losses = []  # (step, train loss) of every step of this invocation, for tests
    bar = tqdm(total=max_iters, initial=step, disable=not (proc.master and args.progress), leave=False,
               dynamic_ncols=True)
    steps_since_log, time_since_log = 0, 0.0
    # Ctrl-C ends the step, saves and stops; not under DDP, where ranks could stop at different steps
    with nullcontext(argparse.Namespace(stop=False)) if proc.ddp else ctrl_c_finishes_step() as ctrl_c:
        while True:
            evaluated = ((step % args.eval_interval == 0 or step >= max_iters)
                         and not (ckpt is not None and step == ckpt['step']))
            if evaluated:
                val = evaluate(raw_model, splits['val'], args, proc, autocast)
                history.append(dict(step=step, flops=flops, time=train_time, val_loss=val))
                log(proc, f"step {step}: val loss {val:.4f} | {flops:.3g} FLOPs | {train_time:.0f}s")
                if proc.master:
                    save()
            if step >= max_iters:
                break
            if ctrl_c.stop:
                if not evaluated:
                    save()
                raise Interrupted(f"at step {step}: saved {args.out_dir}/ckpt.pt; continue with --resume")

            t0, lr = time.time(), lr_at(step, args, max_iters)
            lossf = train_step(model, optimizer, splits['train'], gen, args, proc, autocast, lr, step)
            dt = time.time() - t0
            step, flops, train_time = step + 1, flops + flops_per_iter, train_time + dt
            steps_since_log, time_since_log = steps_since_log + 1, time_since_log + dt
            losses.append((step, lossf))
            bar.update(1)
            if step % args.log_interval == 0 or step == max_iters:
                log(proc, f"step {step:5d} | loss {lossf:.4f} | lr {lr:.2e} | "
                    f"{1000 * time_since_log / steps_since_log:.0f} ms/step | "
                    f"{tokens_per_iter * steps_since_log / time_since_log:.0f} tok/s | {flops:.3g} FLOPs")
                steps_since_log, time_since_log = 0, 0.0
    bar.close()

    result = dict(losses=losses, history=history, val_loss=history[-1]['val_loss'], out_dir=args.out_dir,
                  flops=flops, train_time=train_time, world_size=proc.world)
    if proc.ddp:  # prove the replicas agree: every rank's parameter checksum, in result and <out_dir>/ddp.json
        with torch.no_grad():
            check = torch.stack([p.double().sum() for p in raw_model.parameters()]).sum().reshape(1)
        checks = [torch.zeros_like(check) for _ in range(proc.world)]  # on the device: nccl gathers GPU tensors
        dist.all_gather(checks, check)
        result['param_checksums'] = [c.item() for c in checks]
        if proc.master:
            with io_errors('--out_dir', args.out_dir):
                write_json(os.path.join(args.out_dir, 'ddp.json'), result)
        dist.barrier()     # no rank tears gloo down while another still uses it (seen once: SIGABRT at exit)
        dist.destroy_process_group()
    if proc.master:
        report_outputs(checkpoint=ckpt_path, log=log_path,
                       ddp_check=os.path.join(args.out_dir, 'ddp.json') if proc.ddp else None)
    return result

# -----------------------------------------------------------------------------
# sampling with the incremental-decoding caches of attention.py

@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, use_cache=True, generator=None):
    """Continue prompt_ids (list of ints). The model sees at most block_size tokens; when the context is full it
    restarts from its last block_size // 2 tokens. With the same generator both paths sample the same text: the
    cached one feeds one token at a time, the other reruns the whole context (padded on the right to block_size,
    which a causal model cannot see). -> (new ids, cache, number of tokens in the cache)."""
    T, device = model.config.block_size, model.lm_head.weight.device       # T = 1: the restart keeps 1 token
    tokens, start, cache, n_cached = list(prompt_ids), 0, None, 0
    for _ in range(max_new_tokens):
        if len(tokens) - start > T:
            start, cache = len(tokens) - max(T // 2, 1), None
        ctx = tokens[start:]
        if use_cache:
            if cache is None:
                cache, n_cached = model.body.new_cache(), 0
            for p in range(n_cached, len(ctx)):  # prefill / one new token
                logits, _ = model(torch.tensor([[ctx[p]]], device=device), cache=cache, pos=p)
            n_cached = len(ctx)
            logits = logits[0, -1]
        else:
            x = torch.tensor([ctx + [0] * (T - len(ctx))], device=device)  # (1, T)
            logits = model(x)[0][0, len(ctx) - 1]
        logits = logits.float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = (logits - logits.max()) / temperature     # <= 0: a tiny temperature cannot overflow to inf
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float('-inf'))
            nxt = int(torch.multinomial(F.softmax(logits, -1).cpu(), 1, generator=generator))
        tokens.append(nxt)
    return tokens[len(prompt_ids):], cache, n_cached


def trained_model(run, device):
    """(checkpoint, model in eval mode) of a run folder's ckpt.pt; a checkpoint whose settings or weights do not
    make a model (or hold NaN / inf) is refused in one line."""
    where = os.path.join(run, 'ckpt.pt')
    ckpt = load_checkpoint(where, SCRIPT, CKPT_KEYS)
    check_model_settings(ckpt['config'], f"checkpoint {where!r}", set_by_task=('causal',))   # block_size: LM's own
    model = GPT(build_config(ckpt['config']), len(ckpt['itos'])).to(device)
    try:
        model.load_state_dict(ckpt['model'])
    except RuntimeError as e:
        first = next(line.strip() for line in str(e).splitlines()[1:] if line.strip())
        raise ValueError(f"checkpoint {where!r}: its weights do not fit the model its config describes "
                         f"({first})") from None
    if not all(p.isfinite().all() for p in model.parameters()):
        raise ValueError(f"checkpoint {where!r} holds non-finite weights (a diverged run): no model to use")
    return ckpt, model.eval()


def sample(args):
    device = pick_device(args.device)
    ckpt, model = trained_model(args.out_dir, device)
    cfg, itos = ckpt['config'], ckpt['itos']
    stoi = {c: i for i, c in enumerate(itos)}
    bad = sorted(set(c for c in args.prompt if c not in stoi))
    if bad:
        raise ValueError(f"--prompt has characters outside the model's vocabulary: {bad}")
    prompt = [stoi[c] for c in args.prompt] or [stoi.get('\n', 0)]
    use_cache = not args.no_cache
    if use_cache:
        try:
            model.body.new_cache()
        except ValueError as e:
            print(f"note: {e}; sampling without a cache")
            use_cache = False
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{args.out_dir}: attn={cfg['attn']} step {ckpt['step']}, val loss "
          f"{ckpt['history'][-1]['val_loss'] if ckpt['history'] else float('nan'):.4f}")
    for _ in range(args.num_samples):
        t0 = time.time()
        ids, cache, n_ctx = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                                     use_cache=use_cache, generator=gen)
        dt = time.time() - t0
        print(args.prompt + ''.join(itos[i] for i in ids))
        print(f"---------- {len(ids) / dt:.0f} chars/s ({'cached' if use_cache else 'no cache'})")
    if cache is not None:
        ours, std = model.body.key_cache_numel(cache), cfg['n_layer'] * cfg['n_embd'] * n_ctx
        print(f"key cache after {n_ctx} cached tokens: {ours} numbers per sequence vs {std} for standard "
              f"attention ({std / max(ours, 1):.2f}x smaller; values not counted)")
    return ids

# -----------------------------------------------------------------------------
# compare runs: the shape of the paper's Fig. 4

def compare(args):
    """--compare RUN_DIR...: val loss vs training FLOPs and vs training time of finished or running runs, from
    their log.json (step 0, ln(vocab) for all, left out)."""
    check_writable(args.plot, '--plot')
    histories = {}
    for run in args.compare:
        path = os.path.join(run, 'log.json')
        if not os.path.exists(path):
            raise ValueError(f"--compare {run!r}: no log.json there (not a train_lm.py run directory?)")
        saved = read_json(path, '--compare', ['config', 'history'])
        c = require_keys(saved['config'], ['attn', 'n_embd'], '--compare', path)
        h = [r for r in require_numbers(saved['history'], ['step', 'flops', 'time', 'val_loss'], '--compare', path)
             if r['step'] > 0]
        if not h:
            raise ValueError(f"--compare {run!r}: no evaluation after step 0 yet")
        label = (f"{run}: {c['attn']}" + (f" w={c.get('window')}" if 'swa' in str(c['attn']) else '') +
                 (f" {c.get('ranks')}" if 'mlr' in str(c['attn']) else '') + f" D={c['n_embd']}")
        histories[label] = [h]
        r = h[-1]
        print(f"{label:40s} step {r['step']:6d} | val {r['val_loss']:.4f} | {r['flops']:.3g} FLOPs | {r['time']:.0f}s")
    with io_errors('--plot', args.plot):
        plot_seed_bands(args.plot, histories, ('flops', 'time'), ('training FLOPs', 'training wall time (s)'),
                        'val_loss', 'val loss (nats/char)', 'character-level LM: val loss vs training FLOPs and time')
    report_outputs(plot=args.plot)
    return {label: hs[0][-1] for label, hs in histories.items()}


@torch.no_grad()
def position_losses(run, cache_dir, corpora, bin, device):
    """(label, curve, T) of a run: its val loss at each position of its context, from its ckpt.pt on the windows its
    own evaluation used (a finished run's mean over positions is its last val loss), in bins of `bin` positions."""
    ckpt, model = trained_model(run, device)
    c = ckpt['config']
    if c['block_size'] < 4 * bin:
        raise ValueError(f"--by_position {run!r}: its context length {c['block_size']} is below {4 * bin} (the "
                         f"plot's 4 bins of {bin} positions)")
    if c['data'] not in corpora:
        splits, meta = load_data(cache := prepare_data(c['data'], cache_dir))
        corpora[c['data']] = splits['val'], meta['itos'], data_key(cache)
    val, itos, key = corpora[c['data']]
    if itos != ckpt['itos'] or c.get('data_key', key) != key:      # (runs that predate data_key: the vocabulary)
        raise ValueError(f"--by_position {run!r}: its --data {c['data']!r} read from here is not the text it was "
                         f"trained on (other bytes): run this where the run was trained")
    g, loss = torch.Generator().manual_seed(0), torch.zeros(c['block_size'])
    for _ in range(c['eval_iters']):                        # evaluate()'s windows: the run's batch, seed 0
        x, y = get_batch(val, c['batch_size'], c['block_size'], g)
        logits = model(x.to(device))[0]                                           # (B, T, V)
        loss += F.cross_entropy(logits.transpose(1, 2).float(), y.to(device), reduction='none').mean(0).cpu()
    binned = (loss / c['eval_iters'])[:len(loss) // bin * bin].view(-1, bin).mean(1)       # (T / bin,)
    official = paper_logit_scale(c['attn'], c['layer_pattern'], c['n_layer'], c['global_layers'])
    label = f"{c['attn']} {c['pos']}" + ('' if c['logit_scale'] == official else f" {c['logit_scale']}")
    return label, dict(run=run, step=ckpt['step'], loss=binned.tolist()), c['block_size']


def by_position(args, bin=8):
    """--by_position RUN_DIR...: the runs' val loss by position (position_losses), seeds of a variant and position
    encoding pooled. MLR's level-1 and level-2 blocks start at T/4, T/2 and 3T/4: 'jump' is the loss of the `bin`
    positions after those boundaries minus the `bin` before (a model without blocks shows only the text's own).
    Plots each variant less standard's loss at each position (one panel per encoding); the curves' JSON beside it."""
    check_writable(args.plot, '--plot')
    data = os.path.splitext(args.plot)[0] + '.json'           # the curves, beside the plot
    if os.path.exists(data) and 'curves' not in read_json(data, '--plot'):
        raise ValueError(f"--plot {args.plot!r}: the curves would replace {data!r}, which --by_position did not "
                         f"write; give another --plot")
    curves, corpora, device, first = {}, {}, pick_device(args.device), None
    for run in tqdm(args.by_position, desc='by position', disable=not args.progress, leave=False):
        label, curve, T = position_losses(run, args.cache_dir, corpora, bin, device)
        first = first or (run, T)                                 # every run must share the first's T
        if T != first[1]:                                         # refused at once, not after evaluating them all
            raise ValueError(f"--by_position: runs of different context lengths ({first[0]!r}: T = {first[1]}, "
                             f"{run!r}: T = {T}): give runs of one --block_size")
        curves.setdefault(label, []).append(curve)
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    encodings = sorted({label.split()[1] for label in curves})
    mean = {label: np.mean([r['loss'] for r in runs], 0) for label, runs in curves.items()}   # (T / bin,)
    colors = {}    # one colour per variant (the label without its encoding) in every panel
    fig, axes = plt.subplots(1, len(encodings), figsize=(5.5 * len(encodings), 5), squeeze=False)
    print(f"{'variant':26s} seeds | val loss | first {bin} | last quarter | jump at T/4, T/2, 3T/4")
    for label, runs in curves.items():
        y = np.array([r['loss'] for r in runs])                                   # (seeds, T / bin)
        nb = y.shape[1]
        jump = (np.mean([y[:, b] - y[:, b - 1] for b in (nb // 4, nb // 2, 3 * nb // 4)], axis=0) if nb >= 4
                else np.full(len(runs), np.nan))                                  # (seeds,)
        print(f"{label:26s} {len(runs):5d} | {pm(mean_std(y.mean(1)))} | {pm(mean_std(y[:, 0]))} | "
              f"{pm(mean_std(y[:, 3 * nb // 4:].mean(1)))} | {pm(mean_std(jump), digits=3)}")
        attn, enc, *rest = label.split()
        if label == f'standard {enc}':
            continue                                        # its panel's zero line: the others are drawn less it
        # the same windows for every run: less standard's loss at each position, the text's own difficulty cancels
        smooth = (mean[label] - mean.get(f'standard {enc}', 0))[:nb // 4 * 4].reshape(-1, 4).mean(1)  # 4 * bin
        variant = ' '.join([attn] + rest)
        colors.setdefault(variant, f'C{len(colors) % 10}')
        axes[0, encodings.index(enc)].plot(4 * bin * np.arange(len(smooth)) + 2 * bin, smooth, lw=1.2,
                                           color=colors[variant], label=f"{variant} ({len(runs)} seed"
                                           f"{'s' if len(runs) > 1 else ''})")
    for ax, enc in zip(axes[0], encodings):
        less = " - standard's" if f'standard {enc}' in curves else ''
        ax.set(xlabel='position in the context', ylabel=f'val loss{less} (nats/char, bins of {4 * bin})',
               title=f"{dict(rope='RoPE').get(enc, enc)} positions")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc='upper center', bbox_to_anchor=(0.5, -0.14), ncol=3)   # below: no curve hidden
    with io_errors('--plot', args.plot):
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        write_json(data, dict(bin=bin, curves=curves))
    plt.close(fig)
    report_outputs(plot=args.plot, curves=data)
    return curves


# -----------------------------------------------------------------------------
# --sweep compare: every variant trained to the same FLOPs, several seeds, each run `python train_lm.py ...` in
# its own folder, by runs.sweep (finished runs reused, cut-off ones resumed); then the table and the plot

@dataclass(frozen=True)
class Point:
    """One run of the sweep: a variant with a position encoding at an lr and a seed, trained to `budget` FLOPs."""
    variant: str
    pos: str
    lr: float
    seed: int
    budget: float
    grid: bool = False                   # a point of the lr grid (seed --seed, a third of the budget)

    @property
    def name(self):
        return f"{'grid_' if self.grid else ''}{self.variant}_{self.pos}_lr{self.lr:g}_seed{self.seed}"


SWEEP_OWN = ('sweep', 'variants', 'positions', 'lrs', 'seeds', 'workers', 'sweep_dir', 'preset', 'attn', 'pos', 'lr',
             'seed', 'out_dir', 'max_flops', 'max_iters', 'threads', 'plot', 'estimate', 'resume', 'overwrite', 'reuse',
             'progress')   # flags the sweep uses itself or sets per run


def run_argv(args, pt):
    """The train_lm.py command line of one run of the sweep: the sweep's flags less those it uses itself or sets
    per run and the model flags this variant does not read, then the run's own (1 thread; it stops once its
    FLOPs reach the budget)."""
    idle = unread_flags(args, args._given, True, pt.variant)                 # the other variants' flags
    return [*without_flags(args._argv, SWEEP_OWN + tuple(idle), build_parser()), '--preset', args.preset, '--attn',
            pt.variant, '--pos', pt.pos, '--lr', repr(pt.lr), '--seed', str(pt.seed), '--out_dir',
            os.path.join(args.sweep_dir, pt.name), '--max_flops', repr(pt.budget), '--max_iters', str(10 ** 9),
            '--threads', '1', '--no-progress']


def run_model(args, variant, vocab_size, pos='learned'):
    """(resolved flags, model, training FLOPs per step) of the sweep's run of `variant`."""
    a = parse_args(run_argv(args, Point(variant, pos, args.lr, args.seed, 0.0)))
    model = GPT(build_config(vars(a)), vocab_size, a.emb_std)
    return a, model, 3 * model.forward_flops(a.block_size) * a.batch_size * a.grad_accum


def seconds_per_step(args, variants, vocab_size):
    """Per variant: s/step of train_step on random tokens, timed here on 1 thread (learned positions; RoPE adds
    little), FLOPs per step per position encoding, and the evaluations' share of a run (a forward ~1/3 of a step)."""
    print("sweep estimate: s/step timed now, 1 thread, one process (a busy machine reads slower; parallel runs "
          "share memory bandwidth)")
    per, proc = {}, argparse.Namespace(ddp=False, rank=0, world=1, device='cpu')
    for v in variants:
        a, model, _ = run_model(args, v, vocab_size)
        opt = torch.optim.AdamW(optimizer_groups(model, a.lr, 0.0), lr=a.lr, betas=(0.9, a.beta2), eps=a.adam_eps)
        data, gen = torch.randint(vocab_size, (2 * a.block_size,)).numpy(), torch.Generator()
        s = one_thread_seconds(lambda: train_step(model, opt, data, gen, a, proc, nullcontext(), a.lr, 0))
        flops = {pos: run_model(args, v, vocab_size, pos)[2] for pos in args._positions}
        per[v] = dict(seconds=s, flops=flops, eval_share=a.eval_iters / 3 / a.eval_interval)
        print(f"  {v:12s} {flops['learned' if 'learned' in flops else args._positions[0]] / 1e9:8.3f} GFLOP/step | "
              f"{s:6.3f} s/step")
    return per


def minutes(pt, per):
    p = per[pt.variant]
    return math.ceil(pt.budget / p['flops'][pt.pos]) * (1 + p['eval_share']) * p['seconds'] / 60


def reached(history, budget):
    return bool(history) and history[-1]['flops'] >= budget * (1 - 1e-9)   # up to the rounding of a sum of steps


def saved_run(run_dir):
    """(run config, val history, has ckpt.pt) of the run in run_dir from its log.json alone, so that a finished
    run kept without its checkpoint is reused; (None, [], False) without log.json."""
    if not os.path.exists(os.path.join(run_dir, 'log.json')):
        return None, [], False
    saved = read_json(os.path.join(run_dir, 'log.json'), '--sweep_dir')
    return saved.get('config', {}), saved.get('history', []), os.path.exists(os.path.join(run_dir, 'ckpt.pt'))


# a resume may change these, but a sweep reuses only runs measured as it asks (and no run past its budget)
MEASURED = {'eval_iters', 'eval_interval', 'dtype', 'compile'}


def train_points(args, points, per, tag, log):
    """runs.sweep over the points: finished runs reused, cut-off ones resumed, a folder of other settings
    refused; a cut-off one without ckpt.pt is trained again. Each run's state ('new', 'partial', 'done') and exit
    code go into log. -> one result per point."""
    runs = [Run(pt.name, pt.variant, pt.seed, run_argv(args, pt), os.path.join(args.sweep_dir, pt.name),
                seconds=60 * minutes(pt, per)) for pt in points]
    states = {}
    for r, pt in zip(runs, points):
        saved, history, has_ckpt = saved_run(r.out_dir)
        if args.reuse and saved and saved.get('max_flops', 0) > pt.budget * (1 + 1e-9):   # a shorter budget
            raise ValueError(f"{r.out_dir} holds a run trained to {saved['max_flops']:.4g} FLOPs, past this sweep's "
                             f"budget {pt.budget:.4g}: use another --sweep_dir, or --no-reuse to train every run again")
        want = {**{k: v for k, v in vars(parse_args(r.argv)).items() if not k.startswith('_')},
                'data_key': args._data_key}                        # a run of an edited corpus is not reused
        auto = {'ranks'} if want['ranks'] == 'auto' else set()
        free = (RESUME_OVERRIDES - MEASURED) | {'resume', 'overwrite'} | auto
        states[r.name] = run_state(saved, want, free, r.out_dir, reached(history, pt.budget)) if args.reuse else 'new'
        if states[r.name] == 'partial' and not has_ckpt:
            print(f"{tag}: {r.name} is short of the budget and has no ckpt.pt to resume: trained again from scratch")
            states[r.name] = 'new'
    log['codes'].update(sweep(runs, states, __file__, main, args.workers, tag))
    log['states'].update(states)
    results = []
    for pt in points:
        h = saved_run(os.path.join(args.sweep_dir, pt.name))[1]
        last, done = (h[-1] if h else dict(step=0, flops=0.0, time=0.0)), reached(h, pt.budget)
        results.append(dict(variant=pt.variant, pos=pt.pos, lr=pt.lr, seed=pt.seed, name=pt.name, done=done,
                            history=h, steps=last['step'], val_loss=last['val_loss'] if done else None,
                            flops=last['flops'], train_time=last['time']))
    return results


def sweep_stats(runs, variants):
    """Per variant: val loss at equal FLOPs (each run's last evaluation, at the budget) and at equal training wall
    time (interpolated at the shortest run's time), mean and std over seeds, and both rankings; per baseline: the
    paired differences MLR - baseline over the seeds both finished, with a paired t-test at 5 %."""
    done = [r for r in runs if r['done']]
    t_eq = min(r['train_time'] for r in done)
    at_time = lambda r: float(np.interp(t_eq, [p['time'] for p in r['history']], [p['val_loss'] for p in r['history']]))
    per = {}
    for v in variants:
        rs = [r for r in done if r['variant'] == v]
        if rs:
            per[v] = dict(seeds=[r['seed'] for r in rs], steps=max(r['steps'] for r in rs), lr=rs[0]['lr'],
                          flops=float(np.mean([r['flops'] for r in rs])),
                          train_time=float(np.mean([r['train_time'] for r in rs])),
                          val_loss=mean_std([r['val_loss'] for r in rs]),
                          val_loss_at_time=mean_std([at_time(r) for r in rs]))
    for key, rank in (('val_loss', 'flop_rank'), ('val_loss_at_time', 'time_rank')):
        for i, v in enumerate(sorted(per, key=lambda v: per[v][key][0])):
            per[v][rank] = i + 1
    paired = {}
    loss = {(r['variant'], r['seed']): r['val_loss'] for r in done}
    for b in (v for v in variants if v != 'mlr' and 'mlr' in per and v in per):
        seeds = [s for s in per['mlr']['seeds'] if s in per[b]['seeds']]
        paired[b] = dict(seeds=seeds, **paired_difference([loss['mlr', s] - loss[b, s] for s in seeds]))
    return dict(equal_time=t_eq, variants=per, paired=paired)


def stats_by_pos(results, variants, positions):
    """{pos: sweep_stats of its runs}, for the position encodings with a finished run."""
    by_pos = {pos: [r for r in results if r['pos'] == pos] for pos in positions}
    return {pos: sweep_stats(rs, variants) for pos, rs in by_pos.items() if any(r['done'] for r in rs)}


def sweep_table(stats, budget, title):
    """The markdown tables of stats_by_pos's {pos: stats}."""
    lines = [f"**{title}**", '', f"| variant | positions | lr | seeds | steps | val loss at equal FLOPs ({budget:.3g}) "
             f"| FLOP rank | train time (min) | val loss at equal time | time rank |",
             '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
    for pos, st in stats.items():
        for v, s in st['variants'].items():
            lines.append(f"| {v} | {pos} | {s['lr']:g} | {len(s['seeds'])} | {s['steps']} | {pm(s['val_loss'])} | "
                         f"{s['flop_rank']} | {s['train_time'] / 60:.1f} | {pm(s['val_loss_at_time'])} "
                         f"({st['equal_time'] / 60:.1f} min) | {s['time_rank']} |")
    for pos, st in stats.items():
        if st['paired']:
            lines += [''] + paired_rows(st['paired'], 'mlr', f'MLR − baseline, {pos} positions (equal FLOPs)')
    return '\n'.join(lines) + '\n'


def grid_table(results, lrs, budget):
    """The lr grid's markdown table: each (variant, positions)'s val loss at each lr, the best in bold."""
    loss = {(r['variant'], r['pos'], r['lr']): r['val_loss'] for r in results if r['done']}
    lines = [f"**lr grid: val loss at a third of the budget ({budget / 3:.3g} FLOPs), one seed**", '',
             '| variant | positions | ' + ' | '.join(f'lr {lr:g}' for lr in lrs) + ' |',
             '| --- ' * (2 + len(lrs)) + '|']
    for v, pos in dict.fromkeys((r['variant'], r['pos']) for r in results):
        row = [loss.get((v, pos, lr)) for lr in lrs]
        best = min((x for x in row if x is not None), default=None)
        lines.append(f'| {v} | {pos} | ' + ' | '.join('not finished' if x is None else f'**{x:.4f}**' if x == best
                                                      else f'{x:.4f}' for x in row) + ' |')
    return '\n'.join(lines) + '\n'


def compare_sweep(args):
    """--sweep compare: variants x position encodings x seeds at the preset's lr (seed-major, so a cut-off sweep
    has whole seeds); with --lrs, first each (variant, positions) on an lr grid (seed --seed, a third of the
    budget), then the seeds again at each one's best lr. runs.sweep trains what is not finished; then
    <sweep_dir>/sweep.json, table.md and one sweep_<positions>.png per position encoding."""
    prepare_out_dir(args.sweep_dir, flag='--sweep_dir')   # writable, and this sweep's alone
    variants, positions = args.variants.split(','), args._positions
    seeds = [args.seed + i for i in range(args.seeds)]
    cache = prepare_data(args.data, args.cache_dir)                          # builds the cache once
    vocab_size, args._data_key = len(load_data(cache)[1]['itos']), data_key(cache)
    budget = args.max_iters * run_model(args, 'standard', vocab_size)[2]   # the standard (learned) run's FLOPs
    per = seconds_per_step(args, variants, vocab_size)
    shared = [Point(v, pos, args.lr, s, budget) for s in seeds for pos in positions for v in variants]
    grid = [Point(v, pos, lr, args.seed, budget / 3, grid=True)
            for pos in positions for v in variants for lr in args._lrs]
    if args.estimate:
        todo = shared + grid + (shared if args._lrs else [])   # at most: every best lr other than the shared one
        wall = longest_first_wall([60 * minutes(pt, per) for pt in todo], args.workers) / 60
        print(f"  whole sweep: at most {len(todo)} runs on {max(1, args.workers)} worker(s): ~{wall:.0f} min "
              f"(~{sum(minutes(pt, per) for pt in todo):.0f} run-minutes)")
        return dict(per_variant=per, sweep_minutes=wall)
    log = dict(states={}, codes={})
    results = train_points(args, shared, per, 'shared lr', log)
    stats = dict(shared=stats_by_pos(results, variants, positions))
    if not stats['shared']:
        raise ValueError(f"no run of the sweep finished; see the train.log files in {args.sweep_dir}")
    table = sweep_table(stats['shared'], budget, f'shared lr {args.lr:g}')
    if grid:
        grid_results = train_points(args, grid, per, 'lr grid', log)
        best = {}                                  # (variant, pos) -> the lr of its finished grid run of lowest loss
        for r in sorted((r for r in grid_results if r['done']), key=lambda r: r['val_loss']):
            best.setdefault((r['variant'], r['pos']), r['lr'])
        tuned = [Point(v, pos, best[v, pos], s, budget) for s in seeds for pos in positions for v in variants
                 if (v, pos) in best]
        tuned_results = train_points(args, tuned, per, 'tuned lr', log)
        stats['tuned'] = stats_by_pos(tuned_results, variants, positions)
        lrs = ', '.join(f'{lr:g}' for lr in args._lrs)
        table += '\n' + grid_table(grid_results, args._lrs, budget)
        table += '\n' + sweep_table(stats['tuned'], budget, f'each at its best lr of {lrs}')
        seen = {r['name'] for r in results}         # a best lr equal to --lr is the shared run: listed once
        results += grid_results + [r for r in tuned_results if r['name'] not in seen]
    paths = dict(json=os.path.join(args.sweep_dir, 'sweep.json'), table=os.path.join(args.sweep_dir, 'table.md'))
    with io_errors('--sweep_dir', args.sweep_dir):
        write_json(paths['json'], dict(format=FORMAT, sweep=args.sweep, budget_flops=budget, variants=variants,
                                       positions=positions, lrs=args._lrs, seeds=seeds, command=args._argv,
                                       per_variant=per, runs=results, stats=stats))
        atomic_write(paths['table'], lambda tmp: open(tmp, 'w').write(table))
        for pos in stats['shared']:          # the shared-lr runs; step 0 is ln(vocab) for all: left out
            histories = {v: hs for v in variants if (hs := [r['history'][1:] for r in results[:len(shared)]
                                                            if r['done'] and (r['variant'], r['pos']) == (v, pos)])}
            paths[f'plot_{pos}'] = os.path.join(args.sweep_dir, f'sweep_{pos}.png')
            plot_seed_bands(paths[f'plot_{pos}'], histories, ('flops', 'time'),
                            ('training FLOPs', 'training wall time (s), 1 thread per run'), 'val_loss',
                            'val loss (nats/char)', f'character-level LM, {pos} positions, lr {args.lr:g}, at '
                            'equal training FLOPs: mean over seeds, band = ± 1 std')
    missing = [r['name'] for r in results if not r['done']]
    print(table + (f"not finished (left out): {', '.join(missing)}\n" if missing else ''))
    report_outputs(**paths)
    return dict(runs=results, stats=stats, table=table, budget=budget, paths=paths, **log)

# -----------------------------------------------------------------------------
# benchmark: our attention variants vs a nanoGPT-equivalent model, same process, same shapes

class NanoGPT(nn.Module):
    """nanoGPT's GPT with bias=False, dropout=0, in its names: learned positions, blocks of causal
    scaled_dot_product_attention and a GELU MLP of width `hidden` (4 D unless --mlp_hidden), final LayerNorm,
    untied head."""

    def __init__(self, V, T, D, L, H, hidden):
        super().__init__()
        self.H = H
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(D, bias=False), c_attn=nn.Linear(D, 3 * D, bias=False),
            c_proj=nn.Linear(D, D, bias=False), ln_2=nn.LayerNorm(D, bias=False),
            c_fc=nn.Linear(D, hidden, bias=False), mlp_proj=nn.Linear(hidden, D, bias=False))) for _ in range(L))
        self.ln_f, self.lm_head = nn.LayerNorm(D, bias=False), nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))                  # (B, T, D)
        for b in self.h:                                                                    # nanoGPT's Block
            q, k, v = b.c_attn(b.ln_1(x)).split(x.shape[2], dim=2)
            q, k, v = (t.view(B, T, self.H, -1).transpose(1, 2) for t in (q, k, v))        # (B, H, T, d)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                     # (B, H, T, d)
            x = x + b.c_proj(y.transpose(1, 2).reshape(B, T, -1))                           # (B, T, D)
            x = x + b.mlp_proj(F.gelu(b.c_fc(b.ln_2(x))))
        logits = self.lm_head(self.ln_f(x))                                                 # (B, T, V)
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def bench(args):
    """Training throughput (forward + backward + AdamW step, random tokens) of NanoGPT and of GPT with standard,
    MLR and SWA attention at the same width, depth, MLP width, T and batch. After two warm-up steps each, the
    models take turns, repeat after repeat, in rotating order, so load from other processes hits all alike; each
    one's best repeat counts."""
    device = pick_device(args.device)
    D, L, H, T, B, V = args.n_embd, args.n_layer, args.n_head, args.block_size, args.batch_size, 96
    cfg = {k: v for k, v in vars(args).items() if not k.startswith('_')}
    torch.manual_seed(args.seed)
    models = {'nanoGPT (sdpa)': NanoGPT(V, T, D, L, H, args.mlp_hidden or 4 * D),
              **{attn: GPT(build_config({**cfg, 'attn': attn}), V) for attn in ('standard', 'mlr', 'swa')}}
    x, y = torch.randint(V, (B, T), device=device), torch.randint(V, (B, T), device=device)
    opts = {name: torch.optim.AdamW(m.to(device).parameters(), lr=1e-4) for name, m in models.items()}

    def run(name, n):
        for _ in range(n):
            models[name](x, y)[1].backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
        if device.startswith('cuda'):
            torch.cuda.synchronize()

    for name in models:
        run(name, 2)  # warm-up
    names, best = list(models), {name: (math.inf, math.inf) for name in models}   # (wall, process CPU) s/step
    for rep in range(args.bench_reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0, c0 = time.time(), time.process_time()
            run(name, args.bench_steps)
            wall, cpu = (time.time() - t0) / args.bench_steps, (time.process_time() - c0) / args.bench_steps
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    print(f"training throughput: D={D} L={L} H={H} T={T} B={B} on {device} with {torch.get_num_threads()} "
          f"threads (best of {args.bench_reps} x {args.bench_steps} steps; CPU time counts every thread, and is "
          f"the fairer measure on a loaded machine)")
    (base, base_cpu), (std, std_cpu), rows = best['nanoGPT (sdpa)'], best['standard'], {}
    for name, (wall, cpu) in best.items():
        rows[name] = dict(ms_per_step=1000 * wall, tokens_per_s=B * T / wall, tokens_per_cpu_s=B * T / cpu,
                          vs_nanogpt=base / wall, vs_nanogpt_cpu=base_cpu / cpu, vs_standard=std / wall,
                          vs_standard_cpu=std_cpu / cpu)
        print(f"{name:16s} {1000 * wall:8.1f} ms/step | {B * T / wall:8.0f} tok/s | {base / wall:5.2f}x nanoGPT"
              f" {std / wall:5.2f}x standard | {B * T / cpu:8.0f} tok/CPU-s | {base_cpu / cpu:5.2f}x nanoGPT"
              f" {std_cpu / cpu:5.2f}x standard")
    return rows


@owns_run_folders
def main(argv=None):
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.compare:
        return compare(args)
    if args.by_position:
        return by_position(args)
    if args.sample:
        return sample(args)
    if args.bench:
        return bench(args)
    if args.sweep:
        return compare_sweep(args)
    return train(args)


if __name__ == '__main__':
    run_main(main)  # errors, divergence and Ctrl-C end in one line (runs.run_main)
