"""
Long Range Arena with the project's attention variants: full, local (SWA), BRL, MLR, linear, ... (seed 004
§3.1-3.2: Tables 1-2 accuracies, Figs. 5-6 time and memory against sequence length; App. F, Table 12).

A bidirectional attention.Transformer under a padding mask, pooled (mean / CLS / max) into an MLP classifier;
Retrieval classifies [u, v, u*v, u-v] of its two documents, encoded alike (LRA's dual encoder).

Data. Without --data, ListOps (the LRA recipe, written as the release's TSVs) and 32x32 Pathfinder (two dashed
curves, distractors, two markers on the ends of one curve, label 1, or of two, label 0) are generated here. With
--data the release files are read: ListOps TSVs, IMDB bytes (aclImdb/), AAN pairs (new_aan_pairs.*.tsv), CIFAR-10
python batches, Pathfinder folders. Both are cached under --cache_dir, keyed on the bytes of their files.

Run (CPU, from this directory; 6-12 minutes per ListOps model on a busy shared 2-core machine):
  python train_lra.py --attn standard      # ListOps, max_len 256, 2 layers x 64 wide
  python train_lra.py --attn swa           # local attention, window 32
  python train_lra.py --attn brl           # local attention + 16 compressed tokens
  python train_lra.py --task pathfinder --show --n_train 16    # PNG grid of 16 generated samples to check
  python train_lra.py --task pathfinder --attn brl             # 4000 generated 32 x 32 images (slow on CPU)
  python train_lra.py --bench              # fwd+bwd time and peak memory vs T = 1k..16k (Figs. 5-6)
  python train_lra.py --compare out/lra_listops_standard,out/lra_listops_swa,out/lra_listops_brl
  python train_lra.py --sweep listops      # the study: local, full, BRL, 2 BRL ablations x 3 seeds, 300-1000
                                           # tokens, 96 min on an idle 2-core machine, resumable (rerun it);
                                           # --estimate: its minutes only; --quick: 40-128 tokens, ~2 min
GPU, the paper's Table 12 settings on the release files:
  python train_lra.py --preset lra --task listops --data lra_release/listops-1000 --attn brl
"""
import argparse
import contextlib
import glob
import hashlib
import json
import math
import os
import pathlib
import pickle
import random
import re
import sys
import time
from dataclasses import fields

# runs first: before torch loads, it sets OpenMP's wait policy and a start-up Ctrl-C handler
from runs import (FORMAT, TASK_FIELDS, ArgParser, Interrupted, Run, add_model_args, add_sweep_args, atomic_write,
                  brl_bytes, check_flags_read, check_format, check_mode_flags, check_mode_reads, check_numbers,
                  check_ranges, check_run_length, clear_earlier_run, content_digest, ctrl_c_finishes_step, given_flags,
                  group_flags, guarded_update, io_errors, load_checkpoint, longest_first_wall, mean_std, model_config,
                  no_repeats, one_thread_seconds, owns_run_folders, paired_difference, paired_rows, physical_memory,
                  pick_device, plot_seed_bands, pm, prepare_out_dir, read_json, remove_orphan_tmp, report_outputs,
                  require_keys, require_numbers, resume_settings, rng_state, run_main, run_state, save_checkpoint,
                  set_rng_state, sweep, unread_flags, without_flags, write_json)

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from attention import ATTENTION, ModelConfig, Transformer, optimizer_groups

SCRIPT = 'train_lra.py'
TASKS = ('listops', 'text', 'retrieval', 'image', 'pathfinder')

# Table 12 of seed 004 (its FF size is mlp_hidden) plus LRA's sequence lengths; m = w = 256 is Table 1's best BRL row.
PRESET_KEYS = ('n_layer', 'n_embd', 'n_head', 'mlp_hidden', 'batch_size', 'pooling', 'lr', 'max_len')
LRA_PRESETS = {task: dict(zip(PRESET_KEYS, row)) for task, row in {
    'listops': (6, 512, 8, 1024, 64, 'mean', 1e-4, 2000),
    'text': (6, 512, 8, 1024, 64, 'mean', 1e-4, 4000),
    'retrieval': (4, 128, 8, 512, 16, 'mean', 5e-4, 4000),
    'image': (3, 64, 8, 128, 16, 'max', 5e-4, 1024),
    'pathfinder': (4, 128, 8, 128, 16, 'mean', 5e-4, 1024)}.items()}
PRESET_COMMON = dict(window=256, n_compressed=256, max_iters=5000, warmup_iters=1000,   # LRA's ListOps run
                     min_len=500, n_train=96000, n_val=2000, n_test=2000)     # LRA's ListOps generator
# Without --preset: a CPU-sized model (the model flags' defaults where they differ from attention.ModelConfig's)
LRA_MODEL_DEFAULTS = dict(n_layer=2, n_embd=64, window=32)


# -----------------------------------------------------------------------------
# data caches: made once, used while their bytes match the digest written with them

def write_text(path, text):
    atomic_write(path, lambda tmp: pathlib.Path(tmp).write_text(text))


def cached(digest_path, paths, make):
    """make() writes `paths`, then digest_path records their content_digest. A later run uses the files while their
    bytes match it, and makes them again if not (file times are never trusted)."""
    with contextlib.suppress(FileNotFoundError):
        with open(digest_path) as f:
            if f.read().strip() == content_digest(paths):
                return
        print(f"note: {os.path.dirname(digest_path)}: the cached data changed since it was written; making it again")
    os.makedirs(os.path.dirname(digest_path), exist_ok=True)
    remove_orphan_tmp(os.path.dirname(digest_path))    # of an earlier write that was killed
    make()
    write_text(digest_path, content_digest(paths))


def cached_splits(path, make_splits, what=None):
    """{train, val, test: (x, y)} from the .npz file `path`, cached: make_splits() -> {split: (x, y)} writes it."""
    def make():
        arrays = {f'{s}_{k}': v for s, xy in make_splits().items() for k, v in zip('xy', xy)}

        def write(tmp):
            with open(tmp, 'wb') as f:   # a file object: numpy would append .npz to a name
                np.savez_compressed(f, **arrays)
        atomic_write(path, write)
        if what:
            print(f'wrote {what} to {path}')
    cached(path[:-len('.npz')] + '.sha256', [path], make)
    z = np.load(path)
    return {s: (z[f'{s}_x'], z[f'{s}_y']) for s in ('train', 'val', 'test')}


# -----------------------------------------------------------------------------
# ListOps (LRA recipe; tokens: PAD 0, then digits, operators, ']')

OPERATORS = {'[MIN': min, '[MAX': max, '[MED': lambda a: int(np.median(a)),   # LRA: the middle two's mean, truncated
             '[SM': lambda a: sum(a) % 10}
END = ']'
LISTOPS_VOCAB = ['<pad>'] + [str(v) for v in range(10)] + list(OPERATORS) + [END]
LISTOPS_ID = {t: i for i, t in enumerate(LISTOPS_VOCAB)}


class TooLong(Exception):
    pass


def listops_tree(rng, max_len, count, depth=1):
    """One random tree -> (the release's Source string, its value); [MAX 2 9 ] is '( ( ( [MAX 2 ) 9 ) ] )'. Below
    depth 10 a node is an operator with probability 0.25 (LRA: leaf if random() > 0.25) with randint(2, 10)
    children. count[0] counts tokens; TooLong as soon as there are max_len (such trees are rejected anyway)."""
    if depth < 10 and rng.random() <= 0.25:
        count[0] += 2                                   # the operator and its ']'
        args = [listops_tree(rng, max_len, count, depth + 1) for _ in range(rng.randint(2, 10))]
        op = rng.choice(list(OPERATORS))
        source = f'( {op} {args[0][0]} )'
        for child, _ in args[1:]:
            source = f'( {source} {child} )'
        return f'( {source} {END} )', OPERATORS[op]([v for _, v in args])
    count[0] += 1
    if count[0] >= max_len:
        raise TooLong
    digit = rng.randrange(10)
    return str(digit), digit


def generate_listops(n, min_len, max_len, seed, exclude=()):
    """n distinct (source, label) examples with min_len < #tokens < max_len, none of them in `exclude`."""
    if not 0 <= min_len < max_len - 1:
        raise ValueError(f"need 0 <= min_len < max_len - 1, got min_len={min_len}, max_len={max_len}")
    rng, seen, rows, misses = random.Random(seed), set(exclude), [], 0
    while len(rows) < n:
        count = [0]
        with contextlib.suppress(TooLong):
            source, label = listops_tree(rng, max_len, count)
            if min_len < count[0] < max_len and source not in seen:
                seen.add(source)
                rows.append((source, label))
                misses = -1
        misses += 1
        if misses == 100_000:      # that many trees in a row and none new: these lengths hold too few expressions
            raise ValueError(f"--min_len {min_len} --max_len {max_len}: 100000 random trees in a row gave no new "
                             f"expression of that length ({len(rows)} of {n} found); widen the range")
    return rows


def listops_dataset(cache_dir, n_train, n_val, n_test, min_len, max_len, seed):
    """Generated once into <cache_dir>/listops_<...>/basic_*.tsv (the release's layout): test first (seed), then val
    (seed+1), then train (seed+2), each avoiding the earlier ones, so that the test set does not depend on n_train."""
    d = os.path.join(cache_dir, f'listops_len{min_len}-{max_len}_n{n_train}-{n_val}-{n_test}_seed{seed}')
    splits = [('test', n_test), ('val', n_val), ('train', n_train)]

    def make():
        seen = set()
        for i, (split, n) in enumerate(splits):
            rows = generate_listops(n, min_len, max_len, seed + i, exclude=seen)
            seen.update(r[0] for r in rows)
            lines = ['Source\tTarget'] + [f'{source}\t{label}' for source, label in rows]
            write_text(os.path.join(d, f'basic_{split}.tsv'), '\n'.join(lines) + '\n')
        print(f'wrote ListOps to {d}')
    cached(os.path.join(d, 'sha256'), [os.path.join(d, f'basic_{s}.tsv') for s, _ in splits], make)
    return {split: read_listops(d, split, max_len) for split in ('train', 'val', 'test')}


# -----------------------------------------------------------------------------
# Pathfinder generator (numpy). Geometry in final-pixel units; everything is a capsule (segment + radius).

PATHFINDER32 = dict(   # LRA's 32x32 setting: contour 14 paddles, distractors 14 // 3 long, 20 // 4 of them,
    size=32, contour_length=14, distractor_length=4, n_distractors=5,  # marker radius 1.5, paddle 2 + margin 1
    paddle_length=2.0, paddle_margin=1.0, line_radius=0.5, marker_radius=1.5, padding=1.0,
    max_turn_deg=60.0,  # ours: the original's 'continuity' is not a turning angle; 60 deg lets 42 px fit in 32
    clearance=1.0,      # ours: gap in pixels kept between different curves (and a curve and itself)
    antialias=2)


def clear_of(scene, pts, rad, cid, cfg):
    """scene (N, 6): the segments drawn so far, rows [a, b, half-width, curve id]. For points (M, 2) of half-width
    rad: True where every segment of another curve is >= clearance away."""
    other = scene[scene[:, 5] != cid]
    a, ab = other[:, 0:2], other[:, 2:4] - other[:, 0:2]                           # (N, 2)
    ap = pts[:, None, :] - a[None]                                                  # (M, N, 2)
    t = np.clip((ap * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-12), 0.0, 1.0)
    e = ap - t[..., None] * ab                                    # from the segment's nearest point to p
    gap = np.sqrt((e * e).sum(-1)) - other[:, 4] - rad                             # (M, N)
    return (gap >= cfg['clearance']).all(1)


def add_segments(scene, a, b, rad, cid):
    return np.vstack([scene, np.column_stack([a, b, np.full(len(a), rad), np.full(len(a), cid)])])


def grow_curve(rng, n_paddles, scene, cid, cfg, tries=10, n_cand=16):
    """A dashed curve: n_paddles straight paddles with a gap between, each turning at most max_turn from the last;
    of n_cand random turns the first one that stays inside and clear of the scene and of the curve's own paddles
    3+ back (as curve 0) wins. -> (n_paddles, 2, 2) paddle endpoints, or None."""
    S, pad, r = cfg['size'], cfg['padding'], cfg['line_radius']
    L, gap, turn = cfg['paddle_length'], cfg['paddle_margin'], math.radians(cfg['max_turn_deg'])
    s = np.linspace(0, 1, int(math.ceil(L / 0.5)) + 1)          # centre-line samples every <= 0.5 px
    for _ in range(tries):
        pos, theta = rng.uniform(pad, S - pad, size=2), rng.uniform(0, 2 * math.pi)
        pa, pb = np.zeros((0, 2)), np.zeros((0, 2))
        for k in range(n_paddles):
            th = theta + rng.uniform(-turn, turn, n_cand)
            u = np.stack([np.cos(th), np.sin(th)], 1)                                  # (C, 2)
            ends = pos + L * u
            pts = (pos + (L * s)[None, :, None] * u[:, None, :]).reshape(-1, 2)        # (C * P, 2)
            own = add_segments(scene, pa[:k - 2], pb[:k - 2], r, 0)                 # + paddles 3+ back (k >= 3)
            ok = clear_of(own, pts, r, cid, cfg)
            good = np.flatnonzero(ok.reshape(n_cand, -1).all(1) & ((ends >= pad) & (ends <= S - pad)).all(1))
            if len(good) == 0:
                break
            c = good[0]
            pa, pb = np.vstack([pa, pos]), np.vstack([pb, ends[c]])
            pos, theta = ends[c] + gap * u[c], th[c]
        if len(pa) == n_paddles:
            return np.stack([pa, pb], 1)
    return None


def pathfinder_scene(rng, label, cfg=PATHFINDER32):
    """Two target curves, the two markers, then distractors. -> (curves [(n, 2, 2)], markers (2, 2))."""
    while True:
        scene, curves = np.zeros((0, 6)), []
        for cid in (1, 2):
            c = grow_curve(rng, cfg['contour_length'], scene, cid, cfg)
            if c is None:
                break
            scene = add_segments(scene, c[:, 0], c[:, 1], cfg['line_radius'], cid)
            curves.append(c)
        if len(curves) < 2:
            continue
        ends = [(c[0, 0], c[-1, 1]) for c in curves]
        markers = [(1, ends[0][0]), (1, ends[0][1])] if label == 1 else \
            [(1, ends[0][rng.integers(2)]), (2, ends[1][rng.integers(2)])]
        if not all(clear_of(scene, m[None], cfg['marker_radius'], cid, cfg)[0] for cid, m in markers):
            continue
        for cid, m in markers:
            scene = add_segments(scene, m[None], m[None], cfg['marker_radius'], cid)
        for i in range(cfg['n_distractors']):
            c = grow_curve(rng, cfg['distractor_length'], scene, 3 + i, cfg)
            if c is not None:
                scene = add_segments(scene, c[:, 0], c[:, 1], cfg['line_radius'], 3 + i)
                curves.append(c)
        return curves, np.array([m for _, m in markers])


def render_pathfinder(curves, markers, cfg=PATHFINDER32):
    """Paddles (flat ends, so the gaps show) and marker discs at antialias x resolution, box-downsampled
    to a (size, size) uint8 image, 0 = background, 255 = fully covered pixel."""
    aa, S = cfg['antialias'], cfg['size']
    canvas = np.zeros((S * aa, S * aa), bool)
    for a, b, rad in [(p, q, cfg['line_radius']) for c in curves for p, q in c] + \
                     [(m, m, cfg['marker_radius']) for m in markers]:
        lo = np.clip(np.floor((np.minimum(a, b) - rad) * aa), 0, S * aa - 1).astype(int)
        hi = np.clip(np.ceil((np.maximum(a, b) + rad) * aa), 0, S * aa - 1).astype(int)
        ys, xs = np.mgrid[lo[1]:hi[1] + 1, lo[0]:hi[0] + 1]
        p = (np.stack([xs, ys], -1) + 0.5) / aa                                     # pixel centres
        ab = b - a
        t = ((p - a) @ ab) / max(ab @ ab, 1e-12)
        d = np.linalg.norm(p - a - np.clip(t, 0, 1)[..., None] * ab, axis=-1)
        on = (d <= rad) & ((t >= 0) & (t <= 1) if ab @ ab > 0 else True)
        canvas[lo[1]:hi[1] + 1, lo[0]:hi[0] + 1] |= on
    return np.round(canvas.reshape(S, aa, S, aa).mean((1, 3)) * 255).astype(np.uint8)


def pathfinder_dataset(cache_dir, n_train, n_val, n_test, seed, cfg=PATHFINDER32):
    """Generated once into <cache_dir>/pathfinder32_<...>.npz, test (seed), val (seed+1), train (seed+2): images
    (n, 32 * 32) uint8 and labels (n,) int64, exactly balanced, shuffled."""
    def generate(n, seed):
        rng = np.random.default_rng(seed)
        labels = rng.permutation(np.arange(n) % 2)
        images = np.stack([render_pathfinder(*pathfinder_scene(rng, int(y), cfg), cfg) for y in
                           tqdm(labels, desc=f'pathfinder seed {seed}', leave=False, disable=n < 500)])
        return images, labels.astype(np.int64)
    path = os.path.join(cache_dir, f'pathfinder32_n{n_train}-{n_val}-{n_test}_seed{seed}.npz')
    splits = [('test', n_test), ('val', n_val), ('train', n_train)]
    data = cached_splits(path, lambda: {s: generate(n, seed + i) for i, (s, n) in enumerate(splits)}, 'Pathfinder')
    return {s: (x.reshape(len(x), -1), y) for s, (x, y) in data.items()}


# -----------------------------------------------------------------------------
# the official release files (--data): each task's reader of one part of them -> (x int64 array, y int64 array)

def byte_ids(text, max_len):
    """LRA's byte-level encoding: UTF-8 bytes + 1 (0 is padding), truncated to max_len."""
    return np.frombuffer(text.encode('utf-8'), np.uint8)[:max_len].astype(np.int64) + 1


def pad_rows(rows, max_len):
    x = np.zeros((len(rows), max_len), np.int64)
    for i, r in enumerate(rows):
        x[i, :len(r)] = r[:max_len]
    return x


def tsv_rows(pattern, n_cols, what):
    """(file, line number, columns) of each line of the one file matching pattern, blank lines left out; a line
    of another number of columns is a ValueError naming the file and the line."""
    hits = sorted(glob.glob(pattern))
    if len(hits) != 1:
        raise FileNotFoundError(f"expected exactly one file matching {pattern}, found {hits or 'none'}")
    with open(hits[0], encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            cols = line.rstrip('\n').split('\t')
            if line.strip() and len(cols) != n_cols:
                raise ValueError(f"{f.name} line {n}: expected {what}, got {len(cols)} column(s)")
            if line.strip():
                yield f.name, n, cols


def read_listops(d, part, max_len):
    """listops-1000/basic_<part>.tsv: header Source<TAB>Target, then an expression (read without its parentheses)
    and its value a line."""
    rows = tsv_rows(os.path.join(d, f'*_{part}.tsv'), 2, 'Source<TAB>Target')
    path, _, header = next(rows, (d, 0, None))
    if header != ['Source', 'Target']:
        raise ValueError(f"{path}: expected header Source<TAB>Target, got {header}")
    ids, labels = [], []
    for path, n, (source, target) in rows:
        try:
            ids.append([LISTOPS_ID[t] for t in source.split() if t not in ('(', ')')])
        except KeyError as e:
            raise ValueError(f"{path} line {n}: unknown ListOps token {e.args[0]!r}; valid: {LISTOPS_VOCAB[1:]}") \
                from None
        if not ids[-1]:      # all padding: its pooled features would be 0 / 0
            raise ValueError(f"{path} line {n}: the expression {source!r} has no token besides parentheses")
        if not re.fullmatch(r'\d(\.0*)?', target.strip()):
            raise ValueError(f"{path} line {n}: label {target!r} is not a digit 0-9")
        labels.append(int(float(target)))
    cut = sum(len(r) > max_len for r in ids)
    if cut:   # said, not silent: a cut expression has another value
        print(f"note: {cut} of {len(ids)} {part} examples in {path} are longer than --max_len {max_len} and cut")
    return pad_rows(ids, max_len), np.array(labels, np.int64)


def read_imdb(d, part, max_len):
    """aclImdb/<part>/{neg,pos}/*.txt as bytes, label pos = 1."""
    rows, labels = [], []
    for label, name in enumerate(('neg', 'pos')):
        files = sorted(glob.glob(os.path.join(d, part, name, '*.txt')))
        if not files:
            raise FileNotFoundError(f"no reviews in {os.path.join(d, part, name)}/*.txt")
        for fn in files:
            with open(fn, encoding='utf-8') as f:
                rows.append(byte_ids(f.read(), max_len))
        labels += [label] * len(files)
    return pad_rows(rows, max_len), np.array(labels, np.int64)


def read_aan(d, part, max_len):
    """new_aan_pairs.<part>.tsv: no header, no quoting; label, id1, id2, text1, text2 -> x (N, 2, max_len)."""
    rows = [cols for *_, cols in tsv_rows(os.path.join(d, f'*.{part}.tsv'), 5,
                                          '5 tab-separated columns (label, id1, id2, text1, text2)')]
    bad = next((cols[0] for cols in rows if not re.fullmatch(r'\d(\.0*)?', cols[0].strip())), None)
    if bad is not None:
        raise ValueError(f"{part} label {bad!r} is not a digit 0-9")
    return (np.stack([pad_rows([byte_ids(t, max_len) for t in cols[3:5]], max_len) for cols in rows]),
            np.array([int(float(cols[0])) for cols in rows], np.int64))


def read_cifar(d, part, max_len):
    """CIFAR-10 python batches (data_batch_1..5 or test_batch): pickled dicts, b'data' (N, 3072 uint8, RGB planes)
    and b'labels'; gray as tf.image.rgb_to_grayscale, cast to int (LRA)."""
    xs, ys = [], []
    for name in [f'data_batch_{i}' for i in range(1, 6)] if part == 'train' else ['test_batch']:
        with open(os.path.join(d, name), 'rb') as f:
            batch = pickle.load(f, encoding='bytes')
        rgb = batch[b'data'].reshape(-1, 3, 1024).astype(np.float32)
        xs.append((rgb * np.array([0.2989, 0.5870, 0.1140], np.float32)[None, :, None]).sum(1).astype(np.int64))
        labels = np.asarray(batch[b'labels'])
        if not (np.issubdtype(labels.dtype, np.integer) and labels.size and 0 <= labels.min() <= labels.max() <= 9):
            raise ValueError(f"{os.path.join(d, name)}: b'labels' must be the integers 0-9 of CIFAR-10")
        ys.append(labels.astype(np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def read_pathfinder(d, part, max_len):
    """pathfinder32/curv_contour_length_14/: metadata/<i>.npy are text files of lines '<imgs/i> <sample_j.png> <n>
    <label> ...', the images at <imgs/i>/<sample_j.png>, all of them in file order."""
    from PIL import Image   # Pillow comes with matplotlib
    metas = sorted(glob.glob(os.path.join(d, 'metadata', '*.npy')),
                   key=lambda p: int(re.sub(r'\D', '', os.path.basename(p)) or 0))
    if not metas:
        raise FileNotFoundError(f"no metadata/*.npy under {d}")
    lines = []
    for meta in metas:
        with open(meta) as f:
            lines += [m for m in map(str.split, f) if len(m) >= 4]
    x = np.stack([np.asarray(Image.open(os.path.join(d, m[0], m[1])).convert('L'), np.int64).ravel() for m in lines])
    if x.shape[1] != max_len:
        raise ValueError(f"its images have {x.shape[1]} pixels, --max_len {max_len} (Pathfinder-32: 32 x 32)")
    return x, np.array([int(m[3]) for m in lines], np.int64)


# task -> its reader, and each split as (the release's part, its first and last fraction): LRA has no IMDB validation
# split and validates on test; Image's val is the last 10% of the training batches, Pathfinder splits 80/10/10
RELEASES = {'listops': (read_listops, dict(train=('train', 0, 1), val=('val', 0, 1), test=('test', 0, 1))),
            'text': (read_imdb, dict(train=('train', 0, 1), val=('test', 0, 1), test=('test', 0, 1))),
            'retrieval': (read_aan, dict(train=('train', 0, 1), val=('eval', 0, 1), test=('test', 0, 1))),
            'image': (read_cifar, dict(train=('train', 0, 0.9), val=('train', 0.9, 1), test=('test', 0, 1))),
            'pathfinder': (read_pathfinder, dict(train=('all', 0, 0.8), val=('all', 0.8, 0.9), test=('all', 0.9, 1)))}
RELEASE_CACHE_FORMAT = 2  # bump when a reader changes what it returns


def read_release(task, data_dir, max_len, classes):
    """{split: (x, y)} of the --data folder; a wrong folder or a damaged file is one line naming both."""
    reader, splits = RELEASES[task]
    parts, data = {}, {}
    try:
        for split, (part, lo, hi) in splits.items():
            if part not in parts:
                parts[part] = reader(data_dir, part, max_len)
            x, y = parts[part]
            a, b = int(lo * len(y)), int(hi * len(y))
            data[split] = x[a:b], y[a:b]
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError, EOFError,
            pickle.UnpicklingError) as e:
        raise ValueError(f"--data {data_dir!r} is not a readable {task} release folder: "
                         f"{type(e).__name__}: {e}") from None
    for split, (_, y) in data.items():
        if len(y) == 0 or y.min() < 0 or y.max() >= classes:
            raise ValueError(f"--data {data_dir!r}: {split} labels must be 0..{classes - 1} for {task}, got "
                             f"{sorted(set(y.tolist()))[:12] if len(y) else 'none'}")
    return data


def task_meta(task):
    """{vocab, classes, pixels, dual} of an LRA task."""
    pixels = task in ('image', 'pathfinder')
    return dict(vocab=256 if pixels else (len(LISTOPS_VOCAB) if task == 'listops' else 257),
                classes={'listops': 10, 'image': 10}.get(task, 2), pixels=pixels, dual=task == 'retrieval')


def load_task(args):
    """-> (splits {train, val, test: (x, y)}, task_meta with data_key). The release cache is keyed on the readers'
    version, the task, max_len and the names and bytes of every file under --data (data_key; '' for generated data,
    fixed by its settings): an edited release file is parsed again, and a run of it is not resumed."""
    meta, seed = dict(task_meta(args.task), data_key=''), args.seed if args.data_seed < 0 else args.data_seed
    if not args.data:
        with io_errors('--cache_dir', args.cache_dir):
            if args.task == 'listops':
                return listops_dataset(args.cache_dir, args.n_train, args.n_val, args.n_test, args.min_len,
                                       args.max_len, seed), meta
            return pathfinder_dataset(args.cache_dir, args.n_train, args.n_val, args.n_test, seed), meta
    if not os.path.isdir(args.data):
        raise ValueError(f"--data {args.data!r}: no such folder")
    with io_errors('--data', args.data):
        files = sorted(os.path.join(root, n) for root, _, names in os.walk(args.data) for n in names)
        key = json.dumps([RELEASE_CACHE_FORMAT, args.task, args.max_len, [os.path.relpath(f, args.data) for f in files],
                          content_digest(files)])
    meta['data_key'] = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = os.path.join(args.cache_dir, f"release_{args.task}_{args.max_len}_{meta['data_key']}.npz")
    with io_errors('--cache_dir', args.cache_dir):
        return cached_splits(path, lambda: read_release(args.task, args.data, args.max_len, meta['classes'])), meta


# -----------------------------------------------------------------------------
# model

class LRAClassifier(nn.Module):
    """Embedding + learned positions -> bidirectional Transformer -> pooling -> MLP head.
    Init: token / position embeddings N(0, 1) (nn.Embedding default; the body is pre-LN), CLS vector N(0, 1),
    the body as attention.py (muP), head nn.Linear defaults."""

    def __init__(self, cfg, vocab, classes, pooling='mean', dual=False, pixel_embed='token', learned_pos=True):
        super().__init__()
        if pooling not in ('mean', 'cls', 'max'):
            raise ValueError(f"pooling must be mean, cls or max, got {pooling!r}")
        D = cfg.n_embd
        self.pooling, self.dual, self.pixel_linear = pooling, dual, pixel_embed == 'linear'
        self.embed = nn.Linear(1, D) if self.pixel_linear else nn.Embedding(vocab, D)
        self.cls = nn.Parameter(torch.randn(D)) if pooling == 'cls' else None
        self.pos = nn.Embedding(cfg.block_size, D) if learned_pos else None
        self.body = Transformer(cfg)
        self.head = nn.Sequential(nn.Linear(4 * D if dual else D, D), nn.GELU(), nn.Linear(D, classes))

    def encode(self, x, mask):
        """x (B, T) token ids or pixel values, mask (B, T) bool (True = real) or None -> (B, D)."""
        h = self.embed(x.float().unsqueeze(-1) / 255.0) if self.pixel_linear else self.embed(x)   # (B, T, D)
        if self.cls is not None:
            h = torch.cat([self.cls.expand(len(h), 1, -1), h], 1)                                # (B, 1+T, D)
            mask = None if mask is None else F.pad(mask, (1, 0), value=True)
        if self.pos is not None:
            h = h + self.pos(torch.arange(h.shape[1], device=h.device))
        h = self.body(h, key_mask=mask)
        if self.pooling == 'cls':
            return h[:, 0]
        if mask is None:
            return h.mean(1) if self.pooling == 'mean' else h.max(1).values
        m = mask.unsqueeze(-1)
        if self.pooling == 'mean':
            return (h * m).sum(1) / m.sum(1).clamp(min=1)
        return h.masked_fill(~m, float('-inf')).max(1).values

    def forward(self, x, mask=None):
        """x (B, T), or (B, 2, T) for the dual encoder: [u, v, u*v, u-v] of the two documents to the head."""
        if not self.dual:
            return self.head(self.encode(x, mask))
        u = self.encode(x[:, 0], None if mask is None else mask[:, 0])
        v = self.encode(x[:, 1], None if mask is None else mask[:, 1])
        return self.head(torch.cat([u, v, u * v, u - v], -1))


def build_model(args, meta):
    """The classifier from the model flags. LRA is bidirectional (causal=False); block_size holds max_len
    tokens and the CLS vector (pooling 'cls'); --pos decides the positions, RoPE included."""
    cfg = model_config(args, block_size=args.max_len + (1 if args.pooling == 'cls' else 0), causal=False)
    model = LRAClassifier(cfg, meta['vocab'], meta['classes'], args.pooling, meta['dual'], args.pixel_embed,
                          learned_pos=cfg.pos == 'learned')
    return model, cfg


def make_batch(x, pad, trim, device):
    """x (B, [2,] T) int64 -> tokens, mask. Text tasks: 0 is padding; the batch is cut to its longest row
    rounded up to `trim` (a no-op for the result: padded keys are masked, pooling ignores them)."""
    x = torch.as_tensor(x)
    if not pad:
        return x.to(device), None
    if trim:
        T = int((x != 0).sum(-1).max())
        x = x[..., :min(x.shape[-1], -(-T // trim) * trim)]
    mask = x != 0
    return x.to(device), (None if bool(mask.all()) else mask.to(device))


# -----------------------------------------------------------------------------
# training and evaluation

@torch.no_grad()
def evaluate(model, x, y, args, pad, device):
    model.eval()
    correct = 0
    for i in range(0, len(x), args.eval_batch_size):
        xb, mb = make_batch(x[i:i + args.eval_batch_size], pad, args.trim, device)
        correct += (model(xb, mb).argmax(-1).cpu() == torch.as_tensor(y[i:i + args.eval_batch_size])).sum().item()
    model.train()
    return correct / max(len(x), 1)


def lr_at(step, args, max_iters):
    """Linear warmup, then cosine decay to 10% of the peak at max_iters."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / args.warmup_iters
    p = (step - args.warmup_iters) / max(1, max_iters - args.warmup_iters)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


# --resume: these flags may differ from the checkpoint's; any other flag given must agree with it
RESUME_OVERRIDES = {'max_iters', 'eval_interval', 'eval_batch_size', 'log_interval', 'out_dir', 'device', 'threads',
                    'save', 'progress', 'cache_dir', 'compare', 'bench', 'bench_lens', 'bench_attn', 'bench_batch',
                    'bench_reps', 'bench_max_sec', 'bench_max_gb'}
CKPT_KEYS = ('model', 'optimizer', 'config', 'step', 'history', 'best', 'loop', 'data_rng', 'rng')


def train(args):
    """Train, evaluating and checkpointing <out_dir>/ckpt.pt every eval_interval steps and at the end; --resume
    continues the checkpoint exactly (batch order, RNGs, running log); Ctrl-C ends the step, saves and raises
    Interrupted; a NaN or inf loss stops the run at that step, before the update (Diverged)."""
    # config: the run folder; on --resume the checkpoint, whose settings win
    device = pick_device(args.device)
    ckpt_path, results_path = os.path.join(args.out_dir, 'ckpt.pt'), os.path.join(args.out_dir, 'results.json')
    prepare_out_dir(args.cache_dir, flag='--cache_dir', lock=False)
    earlier = prepare_out_dir(args.out_dir, [] if args.show else [ckpt_path, results_path], args.resume,
                              args.overwrite)
    state = load_checkpoint(ckpt_path, SCRIPT, CKPT_KEYS) if args.resume else None
    if state is not None:
        resume_settings(state['config'], args, args._given, RESUME_OVERRIDES)
        check_run_length(state['step'], lambda s, n: lr_at(s, args, n), state['config']['max_iters'], args.max_iters,
                         '--resume --max_iters')
    torch.manual_seed(args.seed)
    # data
    data, meta = load_task(args)
    if state is not None and state['config'].get('data_key', meta['data_key']) != meta['data_key']:
        raise ValueError(f"--resume: --data {args.data!r} is not the release the run was trained on (its bytes "
                         f"changed): train a new run in another --out_dir")
    if args.show:
        path = os.path.join(args.out_dir, 'lra_pathfinder_samples.png')
        with io_errors('--out_dir', args.out_dir):
            show_pathfinder(data, path)
        return report_outputs(samples=path)
    pad = not meta['pixels']     # token tasks pad with 0 and mask it; pixel tasks are all 1024 long
    (x, y), (xva, _), (xte, yte) = data['train'], data['val'], data['test']
    if args.batch_size > len(x):      # the batches would be the whole set, smaller than asked
        raise ValueError(f"--batch_size {args.batch_size} is more than the {len(x)} training examples of --task "
                         f"{args.task}: give at most {len(x)}")
    # model, optimizer and the loop's state: step, running log, best, training time and the batch order (gen)
    model = build_model(args, meta)[0].to(device)
    opt = torch.optim.AdamW(optimizer_groups(model, args.lr, args.weight_decay), lr=args.lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    st = dict(step=0, history=[], best={'val': -1.0, 'test': None, 'step': 0}, t_train=0.0,
              order=torch.randperm(len(x), generator=gen), pos=0, losses=[], hits=0, seen=0)
    if state is not None:       # all of it from the checkpoint, so that the run continues exactly
        model.load_state_dict(state['model'])
        opt.load_state_dict(state['optimizer'])
        gen.set_state(state['data_rng'])
        set_rng_state(state['rng'])
        st = state['loop']
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LRA {args.task} | attn {args.attn} | {n_params / 1e6:.3f}M params | train/val/test {len(x)}/{len(xva)}/"
          f"{len(xte)} | T {x.shape[-1]} | device {device} | threads: {torch.get_num_threads()}")
    config = {**{k: v for k, v in vars(args).items() if not k.startswith('_')}, 'format': FORMAT,
              'data_key': meta['data_key']}
    print('config: ' + json.dumps(config, sort_keys=True))

    def save():   # ckpt.pt: all that an exact resume needs
        if not args.save:
            return None
        with io_errors('--out_dir', args.out_dir):
            save_checkpoint(ckpt_path, {'script': SCRIPT, 'model': model.state_dict(), 'optimizer': opt.state_dict(),
                                        'config': config, 'step': st['step'], 'history': st['history'],
                                        'best': st['best'], 'loop': st, 'data_rng': gen.get_state(),
                                        'rng': rng_state()})
        clear_earlier_run(earlier, {ckpt_path})     # --overwrite: the earlier run goes with the first one
        return ckpt_path
    # the loop: evaluates and saves every eval_interval steps and at the end
    start, t_start, n_tokens = st['step'], st['t_train'], 0
    bar = tqdm(total=args.max_iters, initial=start, disable=not args.progress, desc=f'{args.task}/{args.attn}',
               leave=False)
    say = tqdm.write if args.progress else print
    with ctrl_c_finishes_step() as ctrl_c:
        for step in range(start, args.max_iters):
            if st['pos'] + args.batch_size > len(st['order']):     # the next batch; a new order when this one ends
                st['order'], st['pos'] = torch.randperm(len(x), generator=gen), 0
            idx = st['order'][st['pos']:st['pos'] + args.batch_size].numpy()
            st['pos'] += args.batch_size
            xb, mb = make_batch(x[idx], pad, args.trim, device)
            yb = torch.as_tensor(y[idx]).to(device)
            for g in opt.param_groups:
                g['lr'] = lr_at(step, args, args.max_iters) * g.get('lr_mult', 1.0)
            t0 = time.perf_counter()
            logits = model(xb, mb)
            loss = F.cross_entropy(logits, yb)
            # backward, clip, AdamW step; a NaN or inf loss stops the run here, before the update
            lossf = guarded_update(loss, step + 1, model, opt, args.grad_clip, args.lr, args.warmup_iters)
            if device.startswith('cuda'):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            st['t_train'] += dt
            st['step'] = step + 1
            n_tokens += int(mb.sum()) if mb is not None else xb.numel()
            st['losses'].append(lossf)
            st['hits'] += (logits.argmax(-1) == yb).sum().item()
            st['seen'] += len(yb)
            bar.update(1)
            if (step + 1) % args.log_interval == 0:
                say(f"step {step + 1}/{args.max_iters} | loss {np.mean(st['losses']):.4f} | train acc "
                    f"{st['hits'] / st['seen']:.3f} | lr {lr_at(step, args, args.max_iters):.2e} | {1e3 * dt:.0f} ms | "
                    f"{n_tokens / max(st['t_train'] - t_start, 1e-9):.0f} tok/s")
                bar.set_postfix(loss=f"{np.mean(st['losses']):.3f}")
                st['losses'], st['hits'], st['seen'] = [], 0, 0
            saved = None
            if (step + 1) % args.eval_interval == 0 or step + 1 == args.max_iters:
                val = evaluate(model, *data['val'], args, pad, device)     # the test accuracy where val is best yet
                if val > st['best']['val']:
                    st['best'] = {'val': val, 'test': evaluate(model, xte, yte, args, pad, device), 'step': step + 1}
                st['history'].append({'step': step + 1, 'val_acc': val, 'train_seconds': st['t_train']})
                say(f"eval step {step + 1}: val acc {val:.4f} | best val {st['best']['val']:.4f} "
                    f"(test {st['best']['test']:.4f})")
                saved = save()
            if ctrl_c.stop and step + 1 < args.max_iters:
                path = saved or save()
                raise Interrupted(f"at step {step + 1}: " + (f"saved {path}; continue with --resume" if path
                                                             else "nothing saved (--no-save)"))
    bar.close()
    # the last evaluation and results.json
    best, history, seconds = st['best'], st['history'], st['t_train'] - t_start
    results = {'task': args.task, 'attn': args.attn, 'params': n_params, 'config': config,
               'final_val_acc': history[-1]['val_acc'],           # the loop always evaluates its last step
               'final_test_acc': evaluate(model, xte, yte, args, pad, device),
               'best_val_acc': best['val'], 'test_acc_at_best_val': best['test'], 'best_step': best['step'],
               'majority_test_acc': float(np.bincount(yte).max() / len(yte)),  # always guess the commonest class
               'train_seconds': st['t_train'], 'ms_per_step': 1e3 * seconds / max(1, args.max_iters - start),
               'tokens_per_second': n_tokens / max(seconds, 1e-9), 'history': history}
    with io_errors('--out_dir', args.out_dir):
        write_json(results_path, results)
    clear_earlier_run(earlier, {ckpt_path, results_path})
    print(f"done: val {results['final_val_acc']:.4f} test {results['final_test_acc']:.4f} | best val "
          f"{best['val']:.4f} -> test {best['test']:.4f} | {st['t_train']:.0f} s training")
    report_outputs(checkpoint=ckpt_path if args.save else None, results=results_path)
    return results


# -----------------------------------------------------------------------------
# --bench: forward+backward time and peak memory against T on the same model (seed 004 Figs. 5-6)

def random_batch_step(a, batch, device='cpu', adamw=False, math_sdpa=False):
    """One step of the ListOps classifier of settings `a` (seeded) on a random (batch, a.max_len) batch, as a function:
    forward, backward, AdamW's update if adamw; math_sdpa: SDPA's math backend, which forms the T x T scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    meta = task_meta('listops')
    model = build_model(a, meta)[0].to(device)
    opt = torch.optim.AdamW(optimizer_groups(model, a.lr, a.weight_decay), lr=a.lr) if adamw else None
    x = torch.randint(1, meta['vocab'], (batch, a.max_len), device=device)         # (B, T)
    y = torch.randint(0, meta['classes'], (batch,), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
        if opt is not None:
            opt.step()
        if device.startswith('cuda'):
            torch.cuda.synchronize()
    return step


def bench_one(attn, T, opts):
    """In a fresh process: one fwd+bwd step of the classifier on a random length-T batch, its peak memory above what
    was held before (CUDA: max_memory_allocated; CPU: the high-water mark VmHWM, reset through /proc/self/clear_refs,
    minus VmRSS before), then the median time of `reps` more steps. 'standard_unfused': standard, math_sdpa (Fig. 5)."""
    unfused, dev = attn == 'standard_unfused', opts['device']
    torch.set_num_threads(opts['threads'])
    a = argparse.Namespace(**{**opts, 'attn': 'standard' if unfused else attn, 'layer_pattern': '', 'max_len': T,
                              'pooling': 'mean', 'pixel_embed': 'token'})
    step = random_batch_step(a, opts['batch'], dev, math_sdpa=unfused)

    def rss_kb(field):
        with open('/proc/self/status') as f:
            return int(re.search(field + r':\s+(\d+)', f.read()).group(1))
    if dev.startswith('cuda'):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak_mb = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    else:
        before = rss_kb('VmRSS')
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')                      # resets VmHWM to the current RSS
        step()
        peak_mb = (rss_kb('VmHWM') - before) / 1024
    times = []
    for _ in range(opts['reps']):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {'attn': attn, 'T': T, 'ms': 1e3 * float(np.median(times)), 'peak_mb': peak_mb}


def bench_options(args, device):
    """What bench_one needs: the model flags (but --attn and --layer_pattern: each point's variant is in every
    layer), and the benchmark's batch, reps, device and threads."""
    model = {f.name: getattr(args, f.name) for f in fields(ModelConfig)
             if f.name not in TASK_FIELDS + ('attn', 'layer_pattern')}
    return dict(model, batch=args.bench_batch, reps=args.bench_reps, device=device,
                threads=args.threads or torch.get_num_threads())


def bench(args):
    """Each --bench_attn variant at each --bench_lens length in a fresh process (a clean allocator and peak), skipped
    where its T x T scores or its predicted time pass the limits, or where it fails (e.g. CUDA out of memory)."""
    import multiprocessing as mp
    device = pick_device(args.device)
    prepare_out_dir(args.out_dir)
    opts = bench_options(args, device)
    print(f"bench: {args.n_layer} layers, D={args.n_embd}, {args.n_head} heads, window {args.window}, "
          f"m={args.n_compressed}, batch {args.bench_batch}, fwd+bwd, device {device}, threads: {opts['threads']}")
    rows = []
    for kind in args._bench_attn:
        for T in args._bench_lens:
            last = [r for r in rows if r['attn'] == kind and 'ms' in r][-1:]
            scores_gb = 3 * args.n_layer * args.bench_batch * args.n_head * T * T * 4 / 2 ** 30   # scores, probs, grad
            skip = None
            if kind == 'standard_unfused' and scores_gb > args.bench_max_gb:
                skip = f'T x T scores ~{scores_gb:.1f} GB > --bench_max_gb'
            elif last and last[0]['ms'] / 1e3 * (T / last[0]['T']) ** 2 > args.bench_max_sec:
                skip = f'predicted > {args.bench_max_sec:g} s per step'
            else:
                try:
                    with mp.get_context('spawn').Pool(1) as pool:
                        r = pool.apply(bench_one, (kind, T, opts))
                except Exception as e:
                    skip = f'{type(e).__name__}: {str(e)[:120]}'
            rows.append({'attn': kind, 'T': T, 'skipped': skip} if skip else r)
            print(f"{kind:16s} T={T:6d}  " + (f"skipped ({skip})" if skip else
                                               f"{r['ms']:9.1f} ms  {r['peak_mb']:8.1f} MB"))
    if not any('ms' in r for r in rows):
        raise ValueError(f"--bench: every point was skipped (the first: {rows[0]['skipped']}); nothing to write")
    paths = os.path.join(args.out_dir, 'bench.json'), os.path.join(args.out_dir, 'lra_bench.png')
    with io_errors('--out_dir', args.out_dir):
        write_json(paths[0], {'options': opts, 'rows': rows})
    with io_errors('--out_dir', args.out_dir), figure(paths[1], 90, 1, 2, figsize=(10, 3.8)) as (fig, axes):
        for kind in dict.fromkeys(r['attn'] for r in rows):
            ok = [r for r in rows if r['attn'] == kind and 'ms' in r]
            label = {'standard': 'standard (fused SDPA)', 'standard_unfused': 'standard, unfused T x T'}.get(kind, kind)
            for ax, key in zip(axes, ('ms', 'peak_mb')):
                ax.plot([r['T'] for r in ok], [r[key] for r in ok], 'o-', label=label)
        for ax, ylabel in zip(axes, ('fwd+bwd time per step (ms)', 'peak memory above model (MB)')):
            ax.set_xscale('log', base=2)
            ax.set(yscale='log', xlabel='sequence length T', ylabel=ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"{opts['n_layer']} layers, D={opts['n_embd']}, w={opts['window']}, m={opts['n_compressed']}, "
                     f"batch {opts['batch']}, {opts['device']}", fontsize=9)
    report_outputs(results=paths[0], plot=paths[1])
    return rows


# -----------------------------------------------------------------------------
# plots: --show, --compare

@contextlib.contextmanager
def figure(path, dpi, *args, **kw):
    """(fig, axes) of plt.subplots(*args, **kw) to draw on; after the block, saved to path and closed."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(*args, **kw)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f'saved {path}')


def show_pathfinder(data, path, n=16):
    with figure(path, 80, 2, n // 2, figsize=(1.6 * n // 2, 3.6)) as (fig, axes):
        for ax in axes.flat:
            ax.axis('off')
        x, y = data['train']
        for ax, img, label in zip(axes.flat, x[:n], y[:n]):
            ax.imshow(img.reshape(32, 32), cmap='gray', vmin=0, vmax=255)
            ax.set_title('connected (1)' if label else 'not (0)', fontsize=8)


def read_results(run_dir, flag):
    """A finished run's results.json, refused in one line when missing, unreadable or of another FORMAT."""
    path = os.path.join(run_dir, 'results.json')
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {run_dir!r}: no results.json there (not a finished train_lra.py run?)")
    r = read_json(path, flag, ['config'])
    check_format(r['config'], f"{flag} {run_dir!r}: its results.json")      # another version first, then what
    require_keys(r, ['attn', 'history'], flag, path)
    require_numbers(r['history'], ['train_seconds', 'val_acc'], flag, path)
    return require_numbers([r], ['test_acc_at_best_val', 'majority_test_acc'], flag, path)[0]


def compare(args):
    """--compare: validation accuracy against training time for several runs (their results.json)."""
    runs = [read_results(d, '--compare') for d in args._compare]
    prepare_out_dir(args.out_dir)
    path = os.path.join(args.out_dir, 'lra_compare.png')
    with io_errors('--out_dir', args.out_dir), figure(path, 90, figsize=(6, 3.8)) as (fig, ax):
        for r in runs:
            ax.plot([e['train_seconds'] for e in r['history']], [e['val_acc'] for e in r['history']], 'o-', ms=3,
                    label=f"{r['attn']}: test {r['test_acc_at_best_val']:.3f}")
        ax.axhline(runs[-1]['majority_test_acc'], color='gray', ls=':', label='commonest class')
        ax.set(xlabel='training time (s)', ylabel='validation accuracy')
        ax.grid(alpha=0.3)
        ax.legend()
    report_outputs(plot=path)


# -----------------------------------------------------------------------------
# --sweep listops: local, full and BRL attention and BRL's two ablations x --seeds on generated ListOps long enough
# that local attention reaches a small part of every sequence; each run a process of one thread (runs.sweep).

# variant -> the flags of its runs (the paper's names, seed 004 Tables 1-2)
STUDY_VARIANTS = {
    'local': ['--attn', 'swa'],                            # Local-Attn: the window only
    'full': ['--attn', 'standard'],                        # Transformer: full attention
    'brl': ['--attn', 'brl'],                              # BRL-Former: the window + m compressed tokens
    'brl_no_gamma': ['--attn', 'brl', '--no-brl_gamma'],   # Table 2's "BRL-Former w/o Attn-Diff" (gamma = 0)
    'brl_beta0': ['--attn', 'brl', '--brl_beta', '0'],     # beta = 0, no carry-over of the compressed tokens (Cor.
}                                                          # 2.5; the paper ablates beta on WikiText, Fig. 7a, not LRA)
# the paper's ListOps test accuracy (%; 2k tokens, 6 layers x 512, m = w = 256), beside ours in table.md
PAPER_LISTOPS = {'local': '15.82', 'full': '36.37 (LRA) / 47.90 (our-imp)', 'brl': '49.98', 'brl_no_gamma': '48.10',
                 'brl_beta0': '-'}
# The study's setting: the defaults of --sweep listops (flags given win). Smaller than the paper's (Table 12) and
# LRA's, for a 2-core CPU budget of <= 120 min for 5 variants x 3 seeds (README, "Settings that differ from the
# papers", says why each value), keeping what makes locality a handicap: 2 layers x window 16 reach 65 of ~600 tokens.
STUDY = dict(min_len=300, max_len=1000, window=16, n_layer=2, n_embd=64, n_head=4, mlp_hidden=128, n_compressed=16,
             n_train=20000, n_val=500, n_test=500, batch_size=16, lr=1e-3, warmup_iters=100, max_iters=1200,
             eval_interval=100,
             data_seed=0)   # one data set for every run: seeds vary init and batch order, pairs share the test set
STUDY_QUICK = dict(STUDY, min_len=40, max_len=128, window=4, n_compressed=4, n_train=400, n_val=100, n_test=100,
                   max_iters=60, warmup_iters=10, eval_interval=20)   # --quick: the machinery end to end, ~2 min
# set per run or used by the study itself: not passed on to its runs (check_args refuses --out_dir, --resume, ...)
STUDY_OWN = ('sweep', 'variants', 'seeds', 'workers', 'sweep_dir', 'attn', 'seed', 'threads', 'quick', 'estimate',
             'reuse', 'progress')
STARTUP_SECONDS = 5.0             # a run's process start: import torch, read the data (for the estimate)


def study_run_dir(args, variant, seed):
    return os.path.join(args.sweep_dir, f'{variant}_seed{seed}')


def study_run_argv(args, variant, seed):
    """One run's command line: the study's setting as resolved here, the other flags given to the study, the
    variant's flags, then its seed and folder, one thread; no model flag the variant does not read."""
    idle = unread_flags(args, [*args._given, *STUDY], False, STUDY_VARIANTS[variant][1])  # e.g. full: --window
    inherited = without_flags(args._argv, STUDY_OWN + tuple(idle), build_parser())
    setting = [f'--{k}={getattr(args, k)!r}' for k in (STUDY_QUICK if args.quick else STUDY) if k not in idle]
    return [*setting, *inherited, *STUDY_VARIANTS[variant], '--seed', str(seed),
            '--out_dir', study_run_dir(args, variant, seed), '--threads', '1', '--no-progress']


def study_run_state(run):
    """runs.run_state of a run's folder: 'done' (results.json), 'partial' (a checkpoint to --resume) or 'new'; a
    folder holding a run of other settings (or of another FORMAT) is refused, so a study never mixes two."""
    results, ckpt = os.path.join(run.out_dir, 'results.json'), os.path.join(run.out_dir, 'ckpt.pt')
    saved = None
    if os.path.exists(results):
        saved = read_results(run.out_dir, '--sweep_dir')['config']
    elif os.path.exists(ckpt):
        saved = load_checkpoint(ckpt, SCRIPT, CKPT_KEYS)['config']
    # compared, though a resume may change them: max_iters sets the lr schedule, eval_interval the best-val selection
    free = (RESUME_OVERRIDES - {'max_iters', 'eval_interval'}) | {'resume', 'overwrite'}
    return run_state(saved, vars(parse_args(run.argv)), free, run.out_dir, os.path.exists(results))


def run_seconds(a, repeats=2):
    """A run's estimated 1-thread seconds: one training step (forward, backward, AdamW) of the run settings `a` on
    a random batch at max_len timed now, times the steps plus the evaluations (a forward ~1/3 of a step; the test
    set counted at every evaluation, an upper bound), plus the process start."""
    s = one_thread_seconds(random_batch_step(a, a.batch_size, adamw=True), repeats)
    evals = -(-a.max_iters // a.eval_interval)
    return (a.max_iters + evals * (a.n_val + a.n_test) / a.batch_size / 3) * s + STARTUP_SECONDS


def study_stats(results, variants):
    """Per variant, mean ± std over its finished seeds ({(variant, seed): results}) of the test accuracy at the best
    validation accuracy (model selection on val), best val, its step and the last step's test accuracy; BRL - each."""
    per, paired = {}, {}
    for v in variants:
        rs = {s: r for (w, s), r in results.items() if w == v}
        if rs:
            per[v] = dict(seeds=list(rs), **{k: mean_std([r[key] for r in rs.values()]) for k, key in (
                ('test_at_best_val', 'test_acc_at_best_val'), ('best_val', 'best_val_acc'),
                ('best_step', 'best_step'), ('final_test', 'final_test_acc'))},
                train_minutes=float(np.mean([r['train_seconds'] for r in rs.values()])) / 60)
    for b in (v for v in per if v != 'brl' and 'brl' in per):
        seeds = [s for s in per['brl']['seeds'] if s in per[b]['seeds']]
        if seeds:
            paired[b] = dict(seeds=seeds, **paired_difference([results['brl', s]['test_acc_at_best_val'] -
                                                               results[b, s]['test_acc_at_best_val'] for s in seeds]))
    return dict(variants=per, paired=paired, majority_test_acc=next(iter(results.values()))['majority_test_acc'])


def study_table(stats):
    """The markdown tables of study_stats (accuracies in %)."""
    pct = lambda ms: pm(ms, 1, 100)
    lines = ['| variant | seeds | test acc at best val | best val acc | best step | last-step test acc | '
             'train min/run | paper (seed 004 Tables 1-2) |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
    lines += [f"| {v} | {len(s['seeds'])} | {pct(s['test_at_best_val'])} | {pct(s['best_val'])} | "
              f"{s['best_step'][0]:.0f} | {pct(s['final_test'])} | {s['train_minutes']:.1f} | {PAPER_LISTOPS[v]} |"
              for v, s in stats['variants'].items()]
    lines.append(f"\ncommonest test label: {100 * stats['majority_test_acc']:.1f} %\n")
    lines += paired_rows(stats['paired'], 'brl', 'BRL − variant (test acc at best val, points)', digits=1, scale=100)
    return '\n'.join(lines) + '\n'


def study(args):
    """--sweep listops: the runs' states (a folder of other settings refused before any work), the data (made here,
    once), the estimate, the runs (runs.sweep), then <sweep_dir>/sweep.json, table.md and lra_study.png."""
    variants, seeds = args.variants.split(','), [args.seed + i for i in range(args.seeds)]
    prepare_out_dir(args.sweep_dir, flag='--sweep_dir')
    prepare_out_dir(args.cache_dir, flag='--cache_dir', lock=False)
    runs = [Run(f'{v}_seed{s}', v, s, study_run_argv(args, v, s), study_run_dir(args, v, s))
            for s in seeds for v in variants]
    states = {r.name: study_run_state(r) if args.reuse else 'new' for r in runs}
    load_task(parse_args(runs[0].argv))
    print("study estimate: s/step timed now at T = max_len, 1 thread, one process (a busy machine reads slower; "
          "parallel runs share memory bandwidth)")
    seconds = {v: run_seconds(parse_args(study_run_argv(args, v, args.seed))) for v in variants}
    for r in runs:
        r.seconds = seconds[r.group]
    print('\n'.join(f"  {v:13s} {s / 60:6.1f} min/run" for v, s in seconds.items()))
    minutes = {v: s / 60 for v, s in seconds.items()}
    if args.estimate:
        wall = longest_first_wall([r.seconds for r in runs], args.workers) / 60
        print(f"  whole study: {len(runs)} runs on {max(1, args.workers)} worker(s): ~{wall:.0f} min")
        return dict(minutes_per_run=minutes, study_minutes=wall)
    codes = sweep(runs, states, __file__, main, args.workers, tag='study')
    results = {(r.group, r.seed): read_results(r.out_dir, '--sweep_dir') for r in runs
               if os.path.exists(os.path.join(r.out_dir, 'results.json'))}
    if not results:
        raise ValueError(f"no run of the study finished; see the train.log files in {args.sweep_dir}")
    stats = study_stats(results, variants)
    table = study_table(stats)
    paths = {k: os.path.join(args.sweep_dir, f) for k, f in (('json', 'sweep.json'), ('table', 'table.md'),
                                                            ('plot', 'lra_study.png'))}
    rows = [dict(variant=v, seed=s, out_dir=study_run_dir(args, v, s),
                 **{k: r[k] for k in ('test_acc_at_best_val', 'best_val_acc', 'best_step', 'final_test_acc',
                                      'majority_test_acc', 'train_seconds', 'ms_per_step', 'history')})
            for (v, s), r in results.items()]
    with io_errors('--sweep_dir', args.sweep_dir):
        write_json(paths['json'], dict(sweep=args.sweep, quick=args.quick, variants=variants, seeds=seeds,
                                       variant_flags={v: STUDY_VARIANTS[v] for v in variants}, command=args._argv,
                                       minutes_per_run=minutes, runs=rows, stats=stats, format=FORMAT))
        write_text(paths['table'], table)
        plot_seed_bands(paths['plot'], {v: [r['history'] for r in rows if r['variant'] == v]
                                        for v in stats['variants']}, ('step', 'train_seconds'),
                        ('training steps', 'training wall time (s), 1 thread per run'), 'val_acc',
                        'validation accuracy (%)', 'generated ListOps: local vs full vs BRL attention, mean over '
                        'seeds, band = ± 1 std', scale=100, hline=(100 * stats['majority_test_acc'],
                                                                  'commonest test label'))
    missing = [r.name for r in runs if (r.group, r.seed) not in results]
    print(table + (f"not finished (left out): {', '.join(missing)}\n" if missing else ''))
    report_outputs(json=paths['json'], table=paths['table'], plot=paths['plot'])
    return dict(runs=rows, stats=stats, table=table, states=states, codes=codes, paths=paths)


# -----------------------------------------------------------------------------
# command line

def build_parser():
    p = ArgParser(prog=SCRIPT, description=__doc__)  # one-line errors, defaults in --help
    g = p.add_argument_group('task and data')
    g.add_argument('--task', choices=TASKS, default='listops', help='LRA task')
    g.add_argument('--data', default='', help='the release files of --task (RELEASES); empty = generate here')
    g.add_argument('--cache_dir', default='data/lra', help='cache of generated data and parsed release data')
    g.add_argument('--max_len', type=int, default=None, help='tokens: ListOps 256, Text / Retrieval 4000, images 1024')
    g.add_argument('--min_len', type=int, default=64, help='ListOps: keep trees with > min_len tokens (LRA: 500)')
    g.add_argument('--n_train', type=int, default=4000, help='generated training examples (LRA ListOps: 96000)')
    g.add_argument('--n_val', type=int, default=500, help='generated validation examples (LRA: 2000)')
    g.add_argument('--n_test', type=int, default=500, help='generated test examples (LRA: 2000)')
    g.add_argument('--data_seed', type=int, default=-1, help='seed of the generated data (-1 = --seed)')
    g.add_argument('--show', action='store_true', help='pathfinder: <out_dir>/lra_pathfinder_samples.png, then exit')
    g = p.add_argument_group('LRA model: preset, embedding, positions, pooling (the encoder: model flags below)')
    g.add_argument('--preset', choices=['none', 'lra'], default='none',
                   help="'lra': seed 004 Table 12 for --task, w = m = 256, LRA lengths, 5000 steps (flags given win)")
    g.add_argument('--pooling', choices=['mean', 'cls', 'max'], default='mean', help='sequence pooling')
    g.add_argument('--pixel_embed', choices=['token', 'linear'], default='token',
                   help='image / pathfinder: pixel value as a token (LRA) or Linear(1 -> D) of value/255')
    add_model_args(p, **LRA_MODEL_DEFAULTS)          # attention.ModelConfig's fields, as in every train script
    g = p.add_argument_group('optimization')
    g.add_argument('--max_iters', type=int, default=600, help='training steps')
    g.add_argument('--batch_size', type=int, default=32, help='training batch size')
    g.add_argument('--lr', type=float, default=1e-3, help='peak learning rate (AdamW, muP multipliers)')
    g.add_argument('--weight_decay', type=float, default=0.01, help='AdamW weight decay on matrices')
    g.add_argument('--warmup_iters', type=int, default=50, help='linear warmup steps, then cosine to 10%%')
    g.add_argument('--grad_clip', type=float, default=1.0, help='gradient norm clip (0 = off)')
    g.add_argument('--trim', type=int, default=64, help='cut batches to the longest row, rounded up to this (0: off)')
    g = p.add_argument_group('evaluation and logging')
    g.add_argument('--eval_interval', type=int, default=100, help='steps between validation passes')
    g.add_argument('--eval_batch_size', type=int, default=128, help='batch size of evaluation')
    g.add_argument('--log_interval', type=int, default=50, help='steps between log lines')
    g.add_argument('--compare', default='', help='comma list of run dirs: <out_dir>/lra_compare.png, then exit')
    g = p.add_argument_group('benchmark (--bench: the model above, random tokens, one fwd+bwd per point)')
    g.add_argument('--bench', action='store_true', help='time and peak memory vs sequence length, then exit')
    g.add_argument('--bench_lens', default='1024,2048,4096,8192,16384', help='comma list of sequence lengths')
    g.add_argument('--bench_attn', default='standard,standard_unfused,swa,brl',
                   help="comma list of variants; standard_unfused: on SDPA's math backend, T x T scores (Fig. 5)")
    g.add_argument('--bench_batch', type=int, default=1, help='batch size of the benchmark')
    g.add_argument('--bench_reps', type=int, default=2, help='timed steps per point (median reported)')
    g.add_argument('--bench_max_sec', type=float, default=30.0,
                   help='skip a point whose predicted s per step (the last point x (T / T_last)^2) are more')
    g.add_argument('--bench_max_gb', type=float, default=4.0,
                   help='skip standard_unfused where its T x T scores, probabilities and gradient take more GB')
    g = add_sweep_args(p, 'listops', STUDY_VARIANTS, '', 'ListOps study (--sweep listops): local, full, BRL, 2 BRL '
                       'ablations x seeds', 'train --variants x --seeds on the study setting (STUDY in the source; '
                       'flags given win), then sweep.json, table.md and lra_study.png in --sweep_dir',
                       dir_help='run folders and results (default out/lra_listops_study[_quick])')
    g.add_argument('--quick', action='store_true', help='--sweep: 40-128 tokens, window 4, 60 steps (minutes)')
    g = p.add_argument_group('system / io')
    g.add_argument('--out_dir', default='', help='output folder (default out/lra_<task>_<attn>)')
    g.add_argument('--device', default='auto', help='auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...')
    g.add_argument('--seed', type=int, default=0, help='seed of init, batch order and (see --data_seed) data')
    g.add_argument('--threads', type=int, default=0, help='torch CPU threads (0 = torch default, one per core)')
    g.add_argument('--resume', action='store_true', help='continue from <out_dir>/ckpt.pt (its settings win)')
    g.add_argument('--overwrite', action='store_true', help='replace the run in --out_dir')
    g.add_argument('--save', action=argparse.BooleanOptionalAction, default=True, help='write ckpt.pt at each eval')
    g.add_argument('--progress', action=argparse.BooleanOptionalAction, default=True, help='tqdm progress bar')
    return p


# The ranges of the numeric flags (the other model flags: attention.check_config, on the meta-device model). Every
# number must be finite and an integer fit int64 (torch's seeds and sizes); these bounds come on top.
POSITIVE = ('n_layer', 'n_embd', 'n_head', 'window', 'n_compressed', 'max_len', 'n_train', 'n_val', 'n_test',
            'max_iters', 'batch_size', 'lr', 'eval_interval', 'eval_batch_size', 'log_interval', 'bench_batch',
            'bench_reps', 'bench_max_sec', 'bench_max_gb')
NON_NEGATIVE = ('mlp_hidden', 'min_len', 'warmup_iters', 'weight_decay', 'grad_clip', 'trim', 'seed', 'threads',
                'workers')
LRA_RANGES = dict(weight_decay='[0, 1]', seeds='(0, 1000]')   # AdamW decays weights by lr * weight_decay per step


def comma_list(p, args, name, kind=str, valid=None):
    """--name's comma list as a list of kind: an empty item, a duplicate, an item that is not a (positive, for
    int) kind or not in valid is parser.error (exit 2)."""
    text = getattr(args, name)

    def ok(t):
        try:
            v = kind(t)
        except ValueError:
            return False
        return t != '' and not (kind is int and v <= 0) and (valid is None or v in valid)
    bad = [t for t in map(str.strip, text.split(',')) if not ok(t)]
    if bad:
        p.error(f"--{name} {text!r}: {bad[0]!r} is not valid; expected a comma list of "
                + (', '.join(valid) if valid is not None else 'positive integers' if kind is int else 'names'))
    items = [kind(t.strip()) for t in text.split(',')]
    no_repeats(p, name, items)
    return items


def check_memory(p, args, model):
    """Refuse (exit 2) a run whose weights, gradients and AdamW moments (16 bytes a parameter), generated data
    (int64 ids) and, on CPU, one training batch's activations (4 floats per token, channel and layer: a lower
    bound) would not fit in this machine's memory."""
    n_params = sum(t.numel() for t in model.parameters())
    docs = 2 if args.task == 'retrieval' else 1
    data = 0 if args.data else 8 * (args.n_train + args.n_val + args.n_test) * args.max_len * docs
    cpu = args.device == 'cpu' or (args.device == 'auto' and not torch.cuda.is_available())
    acts = 4 * 4 * args.batch_size * args.max_len * docs * args.n_embd * args.n_layer if cpu else 0
    need, have = 16 * n_params + data + acts + brl_bytes(args, args.max_len * docs, False), physical_memory()
    if need > have:
        p.error(f"this run needs at least {need / 2 ** 30:.1f} GiB of memory ({n_params:,} parameters, "
                f"{data / 2 ** 30:.1f} GiB of data), this machine has {have / 2 ** 30:.1f} GiB: make the model, "
                f"--max_len, --n_train, --batch_size{', --n_compressed' if args.attn == 'brl' else ''} smaller")


def check_args(p, a):
    """One-line errors before any work: flags out of range or in conflict (exit 2), a model they cannot build
    (exit 1)."""
    check_numbers(p, a, LRA_RANGES)
    check_ranges(p, a, POSITIVE, NON_NEGATIVE)
    sweep_decides = (('--task', a.task != 'listops'), ('--data', a.data), ('--preset', a.preset != 'none'),
                     ('--resume', a.resume), ('--overwrite', a.overwrite), ('--compare', a.compare),
                     ('--bench', a.bench), ('--out_dir', a.out_dir), ('--show', a.show),
                     ('--attn', 'attn' in a._given), ('--layer_pattern', a.layer_pattern))
    for bad, message in (
            (a.data_seed < -1, f"--data_seed {a.data_seed}: must be >= 0, or -1 for --seed"),
            (a.attn not in (*ATTENTION, 'global_swa'), f"--attn {a.attn!r}: valid: {', '.join(ATTENTION)}, global_swa"),
            (a.task in ('image', 'pathfinder') and a.max_len != 1024,
             f"--max_len {a.max_len}: {a.task} images are 32 x 32 = 1024 pixels, use 1024"),
            (a.task in ('text', 'retrieval', 'image') and not (a.data or a.bench or a.compare),
             f"--task {a.task} has no generator here: pass --data with the release files"),
            (a.show and a.task != 'pathfinder', "--show draws Pathfinder samples: use it with --task pathfinder"),
            ('pixel_embed' in a._given and a.task not in ('image', 'pathfinder'),
             f"--pixel_embed embeds the pixels of --task image or pathfinder; --task {a.task} has tokens"),
            (a.resume and a.overwrite, "--resume continues the run in --out_dir and --overwrite replaces it: give one "
                                       "of them"),
            (a.bench and a.layer_pattern, f"--layer_pattern {a.layer_pattern!r}: --bench times each --bench_attn "
                                          f"variant in every layer; drop --layer_pattern"),
            *((a.sweep and on, f"{flag} does not go with --sweep listops (generated ListOps, the --variants' "
                               f"models; its runs live in --sweep_dir, finished ones are reused and cut-off ones "
                               f"resumed by themselves)")
              for flag, on in sweep_decides)):
        if bad:
            p.error(message)
    a._bench_lens = comma_list(p, a, 'bench_lens', int)
    a._bench_attn = comma_list(p, a, 'bench_attn', valid=(*ATTENTION, 'standard_unfused'))
    a._compare = comma_list(p, a, 'compare', os.path.normpath) if a.compare else []   # 'D' = 'D/'
    if a.sweep:
        comma_list(p, a, 'variants', valid=tuple(STUDY_VARIANTS))
    check_unread(p, a)
    if not a.bench:   # the model on the meta device (no memory, no RNG draws): bad model flags before any data
        try:
            with torch.device('meta'):
                model = build_model(a, task_meta(a.task))[0]
        except ValueError as e:     # exit 1, as every script's model errors; block_size named by its flag
            T = f"the sequence length (--max_len {a.max_len}{' + 1 CLS' if a.pooling == 'cls' else ''})"
            raise ValueError(str(e).replace('block_size', T)) from None
        check_memory(p, a, model)


def check_unread(p, a):
    """One line at a flag given that this run would not read (exit 2): of a mode that is off, one its mode does
    not read, generated-data flags with --data; (exit 1) a model flag no layer reads (of no variant, for the
    study), as every script refuses a setting that does not fit the model."""
    check_mode_flags(p, a._given, [(a.sweep, '--sweep', group_flags(p, 'ListOps study')),
                                   (a.bench, '--bench', group_flags(p, 'benchmark'))])
    model = {f.name for f in fields(ModelConfig)} - {'attn', 'layer_pattern'}
    for mode, reads, why in (
            ('compare', {'compare', 'out_dir', 'task', 'attn'}, "reads the runs' results.json (of the flags: "
             "--out_dir, or the --task and --attn that name its default)"),
            ('bench', {'out_dir', *model, *group_flags(p, 'benchmark')}, "times each --bench_attn variant at each "
             "--bench_lens length: random ListOps tokens, mean pooling, the model flags' sizes"),
            ('show', {'task', 'data', 'cache_dir', 'n_train', 'n_val', 'n_test', 'seed', 'data_seed', 'max_len',
                      'out_dir'}, "draws the data's samples (of the flags: the data's and --out_dir)")):
        if getattr(a, mode):
            check_mode_reads(p, a._given, mode, reads, why)
    generated = {'n_train', 'n_val', 'n_test', 'data_seed', 'min_len'} & a._given
    if a.data and generated:
        p.error(f"--{min(generated)} shapes generated data, and --data reads the release's own splits: leave it out")
    if 'min_len' in a._given and a.task == 'pathfinder':
        p.error("--min_len is the shortest generated ListOps sequence; Pathfinder images are 1024 pixels each")
    if a.sweep:
        for k in sorted(a._given):    # a flag that every variant reading it sets itself (--brl_beta, brl_beta0)
            readers = [v for v in a.variants.split(',') if not unread_flags(a, [k], False, STUDY_VARIANTS[v][1])]
            if readers and all(f'--{k}' in STUDY_VARIANTS[v] or f'--no-{k}' in STUDY_VARIANTS[v] for v in readers):
                p.error(f"--{k}: the variants here that read it ({', '.join(readers)}) set it themselves")
    # a model flag no layer reads (--window with full attention): a setting that does not fit the model, exit 1
    if not (a.resume or a.bench or a.compare or a.show):
        check_flags_read(a, a._given, False, *([STUDY_VARIANTS[v][1] for v in a.variants.split(',')],
                                                f'--variants {a.variants}') if a.sweep else ())


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.preset == 'lra':     # preset values become defaults, so explicit flags still override them
        p.set_defaults(**{**PRESET_COMMON, **LRA_PRESETS[args.task]})
        args = p.parse_args(argv)
    if args.max_len is None:
        args.max_len = {'listops': 256, 'text': 4000, 'retrieval': 4000}.get(args.task, 1024)
    if args.sweep:   # the study's setting becomes the defaults, so that explicit flags still override it
        p.set_defaults(**(STUDY_QUICK if args.quick else STUDY))
        args = p.parse_args(argv)
        args.sweep_dir = args.sweep_dir or os.path.join('out', 'lra_listops_study' + ('_quick' if args.quick else ''))
    args._argv = list(sys.argv[1:] if argv is None else argv)   # --sweep: its runs inherit these flags
    args._given = given_flags(p, argv)  # the flags on the command line (--resume refuses conflicting ones)
    check_args(p, args)
    if 'mlr' in (args.layer_pattern.replace(' ', '').split(',') if args.layer_pattern else [args.attn]):
        if 'trim' in args._given:
            p.error(f"--trim {args.trim}: MLR keeps every batch at --max_len (its level blocks are fixed from it)")
        args.trim = 0            # MLR's level blocks are fixed from block_size: keep every batch at max_len
    args.out_dir = args.out_dir or os.path.join('out', f'lra_{args.task}_{args.attn}')
    return args


@owns_run_folders
def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        return study(args)
    if args.compare:
        return compare(args)
    if args.bench:
        return bench(args)
    return train(args)


if __name__ == '__main__':
    run_main(main)  # errors, divergence and Ctrl-C end in one line (runs.run_main)
