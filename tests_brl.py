"""
BRL attention (seed 004): the causal recurrence over blocks, per-head gamma, b_rel.

    python -m pytest tests_brl.py -q

Every check runs in float64 against a plain per-head, per-block reference written from the formulas at
the top of attention.py's BRL section, or checks an invariant that would fail if the code were wrong.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import attention as A
import train_lm
from tests import assert_close, randomize_, small_config

torch.set_num_threads(1)


# -----------------------------------------------------------------------------
# a plain reference: one sequence, one head and one block at a time, softmax and norms by hand

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


# -----------------------------------------------------------------------------
# the layer equals the reference: both causal rules, uneven last block, bidirectional with padding

@pytest.mark.parametrize('kw', [dict(brl_history='global'), dict(brl_history='block'),
                                dict(brl_history='global', window=4, brl_block=6),
                                dict(brl_history='global', brl_gamma=False, brl_rel_buckets=6)])
def test_causal_layer_equals_reference(kw):
    layer = brl_layer(**kw)
    T = 29                                   # not a multiple of the block: a short last block
    nb = layer.block_size(T)
    N = -(-T // nb)
    x = torch.randn(2, T, 64, dtype=torch.float64)
    c = torch.randn(2, N, 4, 64, dtype=torch.float64)
    y, ct = layer(x, c)
    for i in range(2):
        want_y, want_ct = ref_layer(layer, x[i], c[i])
        assert_close(ct[i], want_ct, what=f'{kw}: compressed tokens vs reference')
        assert_close(y[i], want_y, what=f'{kw}: F_BRL vs reference')


def test_bidirectional_layer_equals_reference_with_padding():
    layer = brl_layer(causal=False)
    x = torch.randn(2, 40, 64, dtype=torch.float64)
    c = torch.randn(2, 1, 4, 64, dtype=torch.float64)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 27:] = False
    y, ct = layer(x, c, mask)
    for i, L in enumerate((27, 40)):
        want_y, want_ct = ref_layer(layer, x[i], c[i], L)
        assert_close(ct[i], want_ct, what=f'bidirectional compressed tokens, row {i}')
        assert_close(y[i, :L], want_y, what=f'bidirectional F_BRL, row {i}')


# -----------------------------------------------------------------------------
# receptive field: global through the compressed tokens, never the future

def jacobian_norms(model, T, D):
    """|d out_t / d in_s| (max over features) as a (T, T) matrix, float64."""
    x = torch.randn(1, T, D, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda z: model(z), x)                               # (1, T, D, 1, T, D)
    return J[0, :, :, 0].abs().amax(dim=(1, 3))                                                 # (T, T)


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


def test_perturbing_block_zero_moves_the_last_block():
    """Perturbation (float64, two layers, 6 blocks): a change to token 0 reaches the last block; a change to
    token t leaves every output before t exactly where it was."""
    torch.manual_seed(0)
    model = randomize_(A.Transformer(small_config(attn='brl', n_layer=2, block_size=48)).double())
    x = torch.randn(2, 48, 64, dtype=torch.float64)
    y = model(x)
    x0 = x.clone()
    x0[:, 0] += torch.randn(2, 64, dtype=torch.float64)    # not a constant: LayerNorm would remove that
    assert (model(x0)[:, 40:] - y[:, 40:]).abs().max() > 1e-6, 'token 0 should reach the last block'
    for t in (7, 8, 30):
        xt = x.clone()
        xt[:, t:] += torch.randn_like(xt[:, t:])
        assert_close(model(xt)[:, :t], y[:, :t], atol=0, rtol=0, what=f'outputs before {t} moved')
    # the 'block' rule with the same weights cannot reach 40 tokens back in two layers
    model.cfg.brl_history = 'block'
    assert_close(model(x0)[:, 40:], model(x)[:, 40:], atol=1e-12, what="block rule: token 0 reached the last block")


# -----------------------------------------------------------------------------
# decoding token by token equals the full forward, across several block boundaries

@pytest.mark.parametrize('history', ['global', 'block'])
@pytest.mark.parametrize('window,brl_block', [(8, 0), (4, 6)])
def test_decoding_equals_forward(history, window, brl_block):
    torch.manual_seed(0)
    model = randomize_(A.Transformer(small_config(attn='brl', window=window, brl_block=brl_block,
                                                  brl_history=history)).double())
    x = torch.randn(2, 37, 64, dtype=torch.float64)       # 5 to 7 blocks, the last one unfinished
    full = model(x)
    cache = model.new_cache()
    steps = torch.cat([model(x[:, t:t + 1], cache=cache) for t in range(37)], dim=1)
    assert_close(steps, full, what=f'{history}, window {window}, block {brl_block}: decoding vs forward')
    # the cache holds the local keys, m compressed tokens and the unfinished block, not the whole past
    nb = brl_block or window
    per_layer = model.blocks[0].attn.local.cache_numel(cache[0].local) + 4 * 64 + (37 % nb or nb) * 64
    assert model.key_cache_numel(cache) == 2 * per_layer


# -----------------------------------------------------------------------------
# reductions, gamma per head, b_rel

@pytest.mark.parametrize('kw', [dict(causal=False), dict(brl_history='global'), dict(brl_history='block')])
def test_lambda_zero_is_local_attention(kw):
    layer = brl_layer(**kw)
    with torch.no_grad():
        layer.lam.zero_()
    x = torch.randn(2, 32, 64, dtype=torch.float64)
    y, _ = layer(x, torch.randn(2, layer.cfg.causal and 4 or 1, 4, 64, dtype=torch.float64))
    assert_close(y, layer.local(x), what=f'{kw}: lambda = 0 vs local attention')


@pytest.mark.parametrize('causal', [False, True])
def test_gamma_zero_is_one_softmax_cross_attention_with_b_rel(causal):
    """gamma = 0: F_comp is softmax(Q K1^T / (m sqrt(D)) + b_rel) V per head; K2 plays no part. Distances
    below n_buckets / 2 have a bucket each, so b_rel is the table's first columns (read by hand here)."""
    layer = brl_layer(causal=causal, brl_gamma=False)
    c, hist = torch.randn(2, 1, 4, 64, dtype=torch.float64), torch.randn(2, 1, 12, 64, dtype=torch.float64)
    dist = torch.arange(12) if not causal else torch.arange(12).flip(0) + 1     # 12 .. 1, as block b-1 would
    got = layer.compress(c, hist, dist)
    q = layer.f_q(c).view(2, 1, 4, 4, 16).transpose(2, 3)
    k = layer.f_k1(hist).view(2, 1, 12, 4, 16).transpose(2, 3)
    v = layer.f_v(hist).view(2, 1, 12, 4, 16).transpose(2, 3)
    att = torch.softmax(q @ k.transpose(-2, -1) / (4 * 8) + layer.comp_rel[:, :, dist], dim=-1) @ v
    comp = layer.comp_norm(att.transpose(2, 3).reshape(8, 64)).view(2, 1, 4, 64)
    assert_close(got, 0.5 * layer.ct_ln(comp) + 0.5 * layer.f_m(c), what=f'gamma = 0, causal={causal}')
    with torch.no_grad():
        layer.f_k2.weight.add_(1.0)
    assert_close(layer.compress(c, hist, dist), got, what='gamma = 0 should not read K2')


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
    for name, p in [('b_rel of F_comp', att.comp_rel), ('b_rel of F_prop', att.prop_rel),
                    ('gamma_q', att.gamma_q), ('x_ct', model.compressed_tokens)]:
        assert p.grad is not None and p.grad.abs().sum() > 0, f'no gradient reaches {name}'
    off = A.BRLAttention(small_config(attn='brl', brl_rel_buckets=0))
    assert off.comp_rel is None and off.prop_rel is None
    assert sum(p.numel() for p in att.parameters()) - sum(p.numel() for p in off.parameters()) == 2 * 4 * 4 * 32


# -----------------------------------------------------------------------------
# cost: what the backward pass keeps grows linearly with n; config errors; the train_lm flag

def saved_bytes(layer, T):
    """Bytes of the distinct storages autograd saves for the backward pass of one layer at length T."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(1, T, 32, requires_grad=True)
    c = torch.randn(1, -(-T // layer.block_size(T)), 4, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, c)
    del out
    return sum(seen.values())


@pytest.mark.parametrize('kw', [dict(causal=True), dict(causal=False)])
def test_saved_memory_grows_linearly(kw):
    layer = A.BRLAttention(A.ModelConfig(n_head=2, n_embd=32, window=16, n_compressed=4, block_size=2048, **kw))
    ratio = saved_bytes(layer, 2048) / saved_bytes(layer, 256)
    assert ratio <= 9, f'8x longer sequence keeps {ratio:.1f}x the activations (linear: about 8)'


@pytest.mark.parametrize('kw,match', [(dict(brl_history='all'), "brl_history must be 'global' or 'block', got 'all'"),
                                      (dict(brl_rel_buckets=1), 'brl_rel_buckets must be 0')])
def test_bad_brl_settings_raise_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        A.Transformer(small_config(attn='brl', **kw))


def test_train_lm_passes_brl_history():
    args = ['--attn', 'brl', '--n_layer', '1', '--n_embd', '32', '--n_head', '2', '--block_size', '32',
            '--window', '8', '--n_compressed', '4']
    assert train_lm.model_config(vars(train_lm.parse_args(args))).brl_history == 'global'
    assert train_lm.model_config(vars(train_lm.parse_args(args + ['--brl_history', 'block']))).brl_history == 'block'
