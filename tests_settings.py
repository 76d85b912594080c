"""
Issue 12 tests: the papers' settings. The presets and defaults hold the official code's values (each with a
source comment), the logit scale is chosen in one place and never silently ignored, one-level MLR equals
standard attention at equal scale, the SWA window and the within-head Global + SWA follow the official masks,
the ICL defaults and the BTT shape follow the official ICL runs, the Chronos tokenizer follows Chronos'
published formula and the relative score aggregates per dataset. Smoke runs keep the presets from rotting.

    python -m pytest tests_settings.py -q
"""
import inspect
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attention as A
import train_icl as icl
import train_lm
import train_lra as lra
import train_ts as ts
from tests import assert_close, randomize_, small_config

torch.set_num_threads(1)


def preset_source_lines(obj_name, module, start_key=None):
    """Source lines of a module-level dict (from `obj_name = ` to the first line that closes it at column 0),
    optionally from the line holding start_key on."""
    src = inspect.getsource(module).splitlines()
    i = next(n for n, line in enumerate(src) if line.startswith(f"{obj_name} = "))
    j = next(n for n in range(i + 1, len(src)) if src[n].startswith((')', '}')))
    lines = src[i:j + 1]
    if start_key:
        lines = lines[next(n for n, line in enumerate(lines) if start_key in line):]
    return lines


# -----------------------------------------------------------------------------
# train_lm.py --preset paper: the official MLR run, value by value

def test_lm_paper_preset_values():
    a = train_lm.parse_args(['--preset', 'paper', '--attn', 'mlr'])
    want = dict(n_layer=6, n_embd=768, n_head=12, block_size=1024, ranks='32|8|6|4|4|4|4|2', mlr_divide_levels=True,
                qk_ln=True, logit_scale='inv', mup_alpha=8.0, mup_base_width=768, emb_std=0.02, window=128,
                global_layers='0,3', gswa_ranks='32|32', bilinear_rms_cap=True, btt_factors='official', batch_size=4,
                grad_accum=8, lr=1.65e-2, weight_decay=0.0, adam_eps=1e-20, beta2=0.95, grad_clip=1.0,
                warmup_iters=2000, lr_schedule='constant', max_iters=100_000, eval_interval=200, eval_iters=200,
                dtype='auto')
    got = {k: getattr(a, k) for k in want}
    assert got == want
    assert a.n_embd // a.n_head == 64                                  # head width of the official run


def test_lm_paper_preset_every_value_names_its_source():
    lines = preset_source_lines('PRESETS', train_lm, start_key="'paper'")
    for key in train_lm.PRESETS['paper']:
        line = next((line for line in lines if f"{key}=" in line), None)
        assert line is not None and '#' in line, f"paper preset value {key!r} has no source comment"


def test_lm_paper_preset_global_layers_are_0_and_3():
    """The paper's 'first and fourth layers' are 0-based 0 and 3 (official MHA|SWA|SWA|MHA|SWA|SWA)."""
    a = train_lm.parse_args(['--preset', 'paper', '--attn', 'global_swa'])
    kinds = train_lm.model_config(vars(a)).layer_kinds()
    assert [i for i, k in enumerate(kinds) if k == 'standard'] == [0, 3]
    assert kinds == ['standard', 'swa', 'swa', 'standard', 'swa', 'swa']


def test_lm_paper_logit_scale_per_variant():
    """logit_scale 'paper': MLR c_l = 1/r_l, standard / SWA 8/d, as the official LM code."""
    scale = {attn: train_lm.parse_args(['--preset', 'paper', '--attn', attn]).logit_scale
             for attn in ('mlr', 'standard', 'swa', 'global_swa', 'global_swa_split', 'bilinear_btt')}
    assert scale == dict(mlr='inv', standard='mup', swa='mup', global_swa='mup', global_swa_split='mup',
                         bilinear_btt='auto')
    cfg = train_lm.model_config(vars(train_lm.parse_args(['--preset', 'paper', '--attn', 'mlr'])))
    layer = A.MLRAttention(cfg)
    assert layer.scales == [1 / r for r in (32, 8, 6, 4, 4, 4, 4, 2)]
    assert isinstance(layer.q_ln, torch.nn.LayerNorm) and layer.q_ln.normalized_shape == (64,)   # whole head
    cfg = train_lm.model_config(vars(train_lm.parse_args(['--preset', 'paper', '--attn', 'standard'])))
    assert A.StandardAttention(cfg).scale() == 8 / 64
    with pytest.raises(ValueError, match='scales these layers differently'):
        train_lm.parse_args(['--preset', 'paper', '--attn', 'mlr', '--layer_pattern', 'mlr,standard,mlr,mlr,mlr,mlr'])


def test_lm_embedding_init_std():
    cfg = A.ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=64)
    for std in (0.02, 1.0):
        torch.manual_seed(0)
        m = train_lm.GPT(cfg, 96, emb_std=std)
        for w in (m.wte.weight, m.wpe.weight):
            assert abs(w.std().item() / std - 1) < 0.05


# -----------------------------------------------------------------------------
# MLR as the official code: QK-LN over the whole head before the split, c_l = 1/r_l, divide by covering levels

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


# -----------------------------------------------------------------------------
# the logit scale: one place, honoured or refused

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


def test_unusable_scale_settings_are_refused():
    with pytest.raises(ValueError, match='linear attention'):
        A.Transformer(small_config(attn='linear', logit_scale='mup'))
    with pytest.raises(ValueError, match='mup_alpha = 4.0 is only used'):
        A.Transformer(small_config(attn='mlr', mup_alpha=4.0))                 # 'auto' = 1/r_l: no alpha
    with pytest.raises(ValueError, match='logit_scale must be one of'):
        A.Transformer(small_config(logit_scale='sp'))


# -----------------------------------------------------------------------------
# SWA window and the within-head Global + SWA, against the official masks

def official_swa_mask(T, w):
    return torch.ones(T, T).tril().triu(-w).bool()           # official: triu(tril(ones), diagonal=-w), w + 1 keys


@pytest.mark.parametrize('w', [1, 5, 16])
def test_swa_window_is_the_official_lookback(w):
    layer = A.SWAAttention(small_config(attn='swa', window=w))
    q, k, v = (torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    s = (q @ k.transpose(-2, -1) / 4).masked_fill(~official_swa_mask(40, w), float('-inf'))
    assert_close(layer.attend(q, k, v, None), torch.softmax(s, -1) @ v, what=f'SWA w={w}')
    assert layer.keys_seen() == w + 1


def test_global_swa_split_is_the_official_two_softmax_sum():
    cfg = small_config(attn='global_swa_split', window=6, gswa_ranks='10|6')
    layer = A.GlobalSWASplitAttention(cfg)
    q, k, v = (torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    causal = torch.ones(40, 40).tril().bool()
    sg = (q[..., :10] @ k[..., :10].transpose(-2, -1) * 8 / 10).masked_fill(~causal, float('-inf'))
    sl = (q[..., 10:] @ k[..., 10:].transpose(-2, -1) * 8 / 6).masked_fill(~official_swa_mask(40, 6), float('-inf'))
    ref = (torch.softmax(sg, -1) + torch.softmax(sl, -1)) @ v       # summed, rows sum to 2
    assert_close(layer.attend(q, k, v, None), ref, what='global_swa_split vs the official formula')
    with pytest.raises(ValueError, match='gswa_ranks'):
        A.Transformer(small_config(attn='global_swa_split', gswa_ranks='8|4'))


# -----------------------------------------------------------------------------
# train_icl.py defaults: the official ICL runs at CPU scale

def test_icl_defaults_are_official():
    a = icl.resolve(icl.build_parser().parse_args([]))
    want = dict(n_layer=6, n_head=8, qk_ln=True, batch_size=64, weight_decay=0.0, logit_scale='sqrt',
                bilinear_rms_cap=True, btt_factors='official', btt_rank=1, read_in_std=0.02, pos_std=0.02,
                mup_base_width=768, adam_eps=1e-20, warmup=1000, schedule='constant', grad_clip=0.0,
                curr_d_start=4, curr_n_start=8, curr_ratio=0.06)
    assert {k: getattr(a, k) for k in want} == want
    assert a.n_points == 2 * a.d                                     # official n_positions = 2 n_dims
    lines = preset_source_lines('DEFAULTS', icl)
    for key in icl.DEFAULTS:
        line = next(line for line in lines if f"{key}=" in line)
        assert '#' in line or key in ('d', 'n_embd', 'steps', 'curr_d_start', 'curr_n_start', 'curr_interval',
                                      'curr_ratio'), f'ICL default {key!r} has no source comment'


def test_icl_default_logit_scales():
    """Official ICL scales: 1/sqrt(d) standard, 1/sqrt(p_l r_l) bilinear MLR, 1/sqrt(D) bilinear BTT."""
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


def test_icl_official_adaptive_curriculum():
    """train_ICL.py at 500 001 steps, d = 64: 15 updates of 2000 steps, +4 dims and +8 points each."""
    a = icl.resolve(icl.build_parser().parse_args(['--d', '64', '--steps', '500001']))
    assert icl.curriculum_schedule(a) == (2000, 4)
    assert [icl.curriculum(s, a) for s in (0, 1999, 2000, 30000, 400000)] == \
        [(4, 8), (4, 8), (8, 16), (64, 128), (64, 128)]
    short = icl.resolve(icl.build_parser().parse_args([]))             # 2000 steps: the same shape, shorter
    assert icl.curriculum_schedule(short) == (8, 1)


def test_official_btt_factors():
    assert [A.official_btt_factors(D) for D in (16, 32, 64, 256, 512, 1024)] == \
        [(2, 8), (4, 8), (4, 16), (8, 32), (16, 32), (16, 64)]


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


# -----------------------------------------------------------------------------
# Chronos tokenizer and relative score

@pytest.mark.parametrize('vocab,low,high', [(4096, -15.0, 15.0), (40, -2.0, 3.0)])
def test_chronos_tokenizer_is_the_published_formula(vocab, low, high):
    tok = ts.MeanScaleUniformBins(vocab, low, high)
    n = vocab - 3                                                   # centres: n_tokens - n_special - 1
    centres = low + (high - low) * np.arange(n) / (n - 1)
    assert np.allclose(tok.centers.numpy(), centres, atol=1e-5)
    step = (high - low) / (n - 1)
    k = np.array([0, 1, n // 2, n - 2, n - 1])
    x = np.concatenate([centres[k], centres[k] + 0.49 * step, centres[k] - 0.49 * step, [1e6, -1e6, np.nan]])
    # published: id = bucketize(x, [-1e20, midpoints, 1e20], right=True) + 2, clamped to vocab - 1; NaN -> PAD
    mids = (centres[1:] + centres[:-1]) / 2
    want = np.searchsorted(np.concatenate([[-1e20], mids, [1e20]]), x, side='right') + 2
    want = np.minimum(want, vocab - 1)
    want[np.isnan(x)] = 0
    got = tok.tokenize(torch.tensor(x, dtype=torch.float32)[None], torch.ones(1))[0].numpy()
    assert (got == want).all(), (got, want)
    assert got[0] == 3 and got[4] == vocab - 1 and got[-3] == vocab - 1 and got[-2] == 3 and got[-1] == tok.PAD
    assert (tok.PAD, tok.EOS) == (0, 1)
    dec = tok.detokenize(torch.tensor(want[:-1])[None], torch.ones(1))[0].numpy()
    assert np.allclose(dec, centres[np.clip(want[:-1] - 3, 0, n - 1)], atol=1e-5)


def test_relative_score_is_per_dataset_geometric_mean():
    s = lambda mase, naive, ql, nql, y: dict(mase=mase, naive_mase=naive, ql=ql, naive_ql=nql, abs_y=y,
                                             wql=ql / y, naive_wql=nql / y)
    scores = [s(1.0, 2.0, 1.0, 4.0, 10.0), s(3.0, 2.0, 3.0, 2.0, 30.0), s(2.0, 1.0, 5.0, 1.0, 10.0)]
    r = ts.summarize(scores, ['A', 'A', 'B'])
    # A: MASE 2 / 2 = 1, WQL (1 + 3) / 40 over (4 + 2) / 40 = 2/3; B: MASE 2, WQL 5
    assert r['per_dataset']['A']['rel_mase'] == 1.0 and r['per_dataset']['B']['rel_mase'] == 2.0
    assert math.isclose(r['rel_mase'], math.sqrt(1.0 * 2.0))
    assert math.isclose(r['rel_wql'], math.sqrt(2 / 3 * 5.0))
    assert math.isclose(r['per_dataset']['A']['wql'], 4 / 40)
    # per case it would differ: geometric mean of 0.5, 1.5, 2 over three cases
    assert not math.isclose(r['rel_mase'], (0.5 * 1.5 * 2.0) ** (1 / 3))


# -----------------------------------------------------------------------------
# smoke runs of the presets on CPU (small overrides, documented in the README notes)

def test_smoke_lm_paper_preset(tmp_path):
    text = tmp_path / 'corpus.txt'
    text.write_text(''.join(chr(32 + (i * 7919) % 90) + ('\n' if i % 61 == 0 else '') for i in range(20000)))
    r = train_lm.main(['--preset', 'paper', '--attn', 'mlr', '--max_iters', '2', '--batch_size', '1',
                       '--grad_accum', '1', '--eval_iters', '1', '--device', 'cpu', '--n_layer', '1',
                       '--n_embd', '64', '--n_head', '1', '--block_size', '256', '--data', str(text),
                       '--cache_dir', str(tmp_path / 'cache'), '--out_dir', str(tmp_path / 'run'), '--no_bar'])
    assert len(r['losses']) >= 1 and all(math.isfinite(l) for _, l in r['losses'])


def test_smoke_icl_defaults(tmp_path):
    r = icl.main(['--steps', '2', '--n_eval', '16', '--n_eval_during', '8', '--n_boot', '10', '--eval_interval', '0',
                  '--out_dir', str(tmp_path), '--assets_dir', '', '--no-progress', '--attn', 'bilinear_btt'])
    assert all(math.isfinite(v) for v in r['model']['mean'])


def test_smoke_lra_preset(tmp_path):
    r = lra.main(['--preset', 'lra', '--task', 'listops', '--attn', 'swa', '--steps', '2', '--batch_size', '2',
                  '--n_layer', '1', '--n_embd', '32', '--ff', '32', '--window', '16', '--max_len', '160',
                  '--min_len', '40', '--n_train', '8', '--n_val', '4', '--n_test', '4', '--eval_batch_size', '4',
                  '--eval_interval', '2', '--log_interval', '1', '--cache_dir', str(tmp_path / 'data'),
                  '--out_dir', str(tmp_path / 'run'), '--threads', '1', '--no-progress'])
    assert r is not None
