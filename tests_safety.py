"""
Run safety of the four train scripts (issue 17): one-line errors with the right exit code for bad flags, files
and checkpoints; no run destroyed by a rerun; no orphaned tmp files after a kill mid-checkpoint; a NaN loss
stops the run at that step with no NaN checkpoint on disk; Ctrl-C saves and --resume continues exactly.

    python -m pytest tests_safety.py -q
"""
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attention as A
import train_lm
from tests import lm_corpus, lm_one_thread, lm_tiny_args  # noqa: F401  (fixtures; lm_one_thread: autouse)

HERE = os.path.dirname(os.path.abspath(__file__))


def run_cli(main, argv, capsys):
    """What `python train_x.py ARGV` does, in this process: -> (exit code, its stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        A.run_main(main, argv)
    return e.value.code, capsys.readouterr().err


CTRL_C_ACK = 'Ctrl-C: saving a checkpoint after this step (Ctrl-C again to quit at once)'


def assert_one_line_error(code, err, want_code, words, prog):
    lines = [line for line in err.strip().splitlines() if line and line != CTRL_C_ACK]  # the ack comes at the press
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


def all_finite(state_dict):
    return all(bool(torch.isfinite(v).all()) for v in state_dict.values() if v.is_floating_point())


@pytest.fixture(scope='module')
def orphan(tmp_path_factory):
    """What a kill -9 in the middle of a checkpoint write leaves: a process that dies inside atomic_write."""
    d = tmp_path_factory.mktemp('killed')
    code = ("import os, signal, sys; sys.path.insert(0, {here!r}); import attention as A\n"
            "def write(tmp):\n    open(tmp, 'wb').write(b'half a checkpoint')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "A.atomic_write({path!r}, write)").format(here=HERE, path=str(d / 'ckpt.pt'))
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    left = tmp_files(d)
    assert len(left) == 1 and not os.path.exists(d / 'ckpt.pt')
    return left[0]


@contextlib.contextmanager
def dying_torch_save(monkeypatch):
    """torch.save writes half a file and dies there, as a crash or Ctrl-C in the middle of a write would."""
    real = torch.save

    def dying_save(obj, f, *args, **kw):
        with open(f, 'wb') as fh:
            fh.write(b'half a checkpoint')
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, 'save', dying_save)
    try:
        yield
    finally:
        monkeypatch.setattr(torch, 'save', real)


def plant_orphan(orphan, folder, name):
    """A killed writer's tmp file for <folder>/<name>, with the dead writer's pid."""
    pid = orphan.rsplit('.tmp', 1)[1]
    shutil.copy(orphan, os.path.join(str(folder), f'{name}.tmp{pid}'))
    return os.path.join(str(folder), f'{name}.tmp{pid}')


# -----------------------------------------------------------------------------
# the shared building blocks (attention.py, last section)


def test_atomic_write_failure_leaves_old_file_and_no_tmp(tmp_path):
    path = tmp_path / 'f.json'
    A.write_json(str(path), {'a': 1})

    def fail(tmp):
        open(tmp, 'w').write('{"a": 2, "b"')
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        A.atomic_write(str(path), fail)
    assert path.read_text().replace(' ', '').replace('\n', '') == '{"a":1}' and not tmp_files(tmp_path)


def test_orphan_tmp_of_dead_writer_removed_live_kept(tmp_path, orphan):
    dead = plant_orphan(orphan, tmp_path, 'ckpt.pt')
    live = tmp_path / f'ckpt.pt.tmp{os.getpid()}'     # a writer that is still running: left alone
    live.write_bytes(b'x')
    (tmp_path / 'old.npz.tmp.npz').write_bytes(b'x')  # the older pid-less scheme
    A.remove_orphan_tmp(str(tmp_path))
    assert not os.path.exists(dead) and live.exists() and not (tmp_path / 'old.npz.tmp.npz').exists()


def test_save_checkpoint_refuses_nan_weights(tmp_path):
    path = tmp_path / 'ckpt.pt'
    with pytest.raises(A.Diverged, match='not finite at step 7'):
        A.save_checkpoint(str(path), dict(model={'w': torch.tensor([1.0, float('nan')])}, step=7))
    assert not os.path.exists(path) and not tmp_files(tmp_path)


@pytest.mark.parametrize('value', [float('nan'), float('inf'), -float('inf'), 1e25])
def test_check_loss_stops_on_nan_inf_and_runaway(value):
    with pytest.raises(A.Diverged, match='at step 4'):
        A.check_loss(torch.tensor(value, requires_grad=True), 4)
    assert A.check_loss(torch.tensor(2.5), 4) == 2.5


def test_given_flags_sees_flags_given_with_their_default_value():
    p = A.ArgParser()
    p.add_argument('--attn', default='standard')
    p.add_argument('--lr', type=float, default=1e-3)
    p.set_defaults(lr=3e-3)
    assert A.given_flags(p, ['--attn', 'standard']) == {'attn'}
    assert p.parse_args([]).lr == 3e-3                 # the parser is left as it was


def test_resume_settings_lists_every_conflict():
    import argparse
    args = argparse.Namespace(attn='standard', lr=0.1, n_embd=32, max_iters=9, resume=True)
    with pytest.raises(ValueError) as e:
        A.resume_settings(dict(attn='mlr', lr=0.01, n_embd=32, max_iters=3, resume=False), args,
                          {'attn', 'lr', 'n_embd', 'max_iters', 'resume'}, may_change={'max_iters'})
    assert "--attn: checkpoint 'mlr' vs given 'standard'" in str(e.value)
    assert '--lr: checkpoint 0.01 vs given 0.1' in str(e.value) and 'n_embd' not in str(e.value)


def test_check_ranges_and_one_line_parser_error(capsys):
    import argparse
    p = A.ArgParser(prog='x.py')
    with pytest.raises(SystemExit) as e:
        A.check_ranges(p, argparse.Namespace(steps=0), positive=['steps'])
    assert_one_line_error(e.value.code, capsys.readouterr().err, 2, ['--steps 0', '> 0'], 'x.py')


@pytest.mark.parametrize('argv,words', [(['--Ts', '0'], ['--Ts', "'0'"]), (['--Ts', '64,x'], ["'64,x'"])])
def test_attention_benchmark_cli_bad_lengths(argv, words, capsys):
    code, err = run_cli(A.benchmark_main, argv, capsys)
    assert_one_line_error(code, err, 2, words, 'attention.py')


def test_help_shows_defaults(capsys, monkeypatch):
    """Every script's --help shows the defaults (the four train scripts' parsers are checked at the end)."""
    monkeypatch.setenv('COLUMNS', '200')
    with pytest.raises(SystemExit) as e:
        A.benchmark_main(['--help'])
    text = capsys.readouterr().out
    assert e.value.code == 0 and text.count('(default:') == text.count('\n  --') >= 3, text
    out = subprocess.run([sys.executable, os.path.join(HERE, 'structured.py'), '--help'], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS='1', COLUMNS='200'))
    assert out.returncode == 0 and out.stdout.count('(default:') >= 7, out.stdout

# -----------------------------------------------------------------------------
# train_lm.py


def lm_args(lm_corpus, out, *extra):
    return lm_tiny_args(lm_corpus, out, '--max_iters', '2', '--eval_interval', '2', *extra)


def lm_run(lm_corpus, out, *extra):
    return train_lm.main(lm_args(lm_corpus, out, *extra))


def write_random(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
        f.write(torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
                .numpy().tobytes())


def truncate(path):
    raw = open(path, 'rb').read()
    open(path, 'wb').write(raw[:len(raw) // 3])


def write_foreign(path, script='train_lra.py'):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(script=script, model={}, optimizer={}, config={}, step=1), path)


def setup_case(how, out, ckpt, run, other_script):
    """The setups that the bad-input cases of all four scripts share: 'unwritable' (a file where the parent of
    --out_dir should be), 'random' bytes or 'foreign' (another script's checkpoint) at the checkpoint's path,
    or a finished 'run', maybe 'truncated' after."""
    if how == 'unwritable':
        (out.parent / 'a_file').write_text('x')
    elif how == 'random':
        write_random(ckpt)
    elif how == 'foreign':
        write_foreign(ckpt, other_script)
    elif how in ('run', 'truncated'):
        run()
        if how == 'truncated':
            truncate(ckpt)


def range_cases(**bad):
    """Flags given a value outside their range: exit code 2, and the one line names the flag and the value."""
    return [(f'{flag}={value}', [f'--{flag}', value], None, 2, [f'--{flag} {value}']) for flag, value in bad.items()]


def shared_cases(script, first_file, other_script):
    """The bad-input cases of every train script (setups: setup_case): --resume with --overwrite, a device that
    is not there, an --out_dir that cannot be written, a rerun over a finished run (first_file: the first of
    its files named), and --resume with no, a truncated, a random-bytes or another script's checkpoint."""
    no_device = ['--device', 'cuda'] if not torch.cuda.is_available() else ['--device', 'mps']
    return [
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


def lm_setup(lm_corpus, out, how):
    if how == 'binary_data':
        (out.parent / 'bin').mkdir(exist_ok=True)
        (out.parent / 'bin' / 'blob').write_bytes(b'\0\1\2\xff' * 100)
    setup_case(how, out, str(out / 'ckpt.pt'), lambda: lm_run(lm_corpus, out), 'train_lra.py')


LM_BAD = range_cases(warmup_iters='-5', threads='-1', temperature='-1', top_k='-3', lr='nan', beta2='1.5') + [
    # (case, extra flags, setup, exit code, words the one line must hold)
    ('batch_size', ['--batch_size', '0'], None, 2, ['--batch_size', '0']),      # argparse type: its own words
    ('max_iters', ['--max_iters', '-1'], None, 2, ['--max_iters', '-1']),
    ('lr_zero', ['--lr', '0'], None, 2, ['--lr 0']),
    ('attn', ['--attn', 'nope'], None, 2, ["'nope'"]),
    ('no_data', ['--data', '/nonexistent/corpus.txt'], None, 1, ['/nonexistent/corpus.txt']),
    ('binary_data', ['--data', 'BIN'], 'binary_data', 1, ['no non-empty UTF-8']),
    ('block_size', ['--block_size', '4096'], None, 1, ['--block_size 4096']),
    ('n_head', ['--n_embd', '30', '--n_head', '4'], None, 1, ['--n_embd 30', '--n_head 4']),
    ('ranks', ['--attn', 'mlr', '--ranks', '8|4'], None, 1, ['8|4']),
    ('resume_attn', ['--resume', '--attn', 'mlr'], 'run', 1, ["--attn: checkpoint 'standard' vs given 'mlr'"]),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.003 vs given 0.5']),
    ('resume_shape', ['--resume', '--n_layer', '3', '--window', '4'], 'run', 1,
     ['--n_layer: checkpoint 2 vs given 3', '--window: checkpoint 8 vs given 4']),
    ('sample_random', ['--sample'], 'random', 1, ['truncated or corrupt']),
] + shared_cases('train_lm.py', 'ckpt.pt', 'train_lra.py')


@pytest.mark.parametrize('case,extra,setup,code,words', LM_BAD, ids=[c[0] for c in LM_BAD])
def test_lm_bad_input_one_line(lm_corpus, tmp_path, capsys, case, extra, setup, code, words):
    out = tmp_path / 'run'
    lm_setup(lm_corpus, out, setup)
    extra = [{'BIN': str(tmp_path / 'bin'), 'UNWRITABLE': str(tmp_path / 'a_file' / 'out')}.get(a, a) for a in extra]
    got, err = run_cli(train_lm.main, lm_args(lm_corpus, out, *extra), capsys)
    assert_one_line_error(got, err, code, words, 'train_lm.py')


def test_lm_overwrite_replaces_the_run(lm_corpus, tmp_path):
    lm_run(lm_corpus, tmp_path)
    res = lm_run(lm_corpus, tmp_path, '--overwrite', '--attn', 'swa')
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['config']['attn'] == 'swa' and res['losses'][0][0] == 1


def test_lm_nan_stops_at_that_step_without_nan_checkpoint(lm_corpus, tmp_path, monkeypatch, capsys):
    LossTap(monkeypatch, 'cross_entropy', nan_at=3)
    code, err = run_cli(train_lm.main, lm_tiny_args(lm_corpus, tmp_path, '--max_iters', '6', '--eval_interval', '2'),
                        capsys)
    assert_one_line_error(code, err, 1, ['training loss is nan at step 3', '--lr'], 'train_lm.py')
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['step'] == 2 and all_finite(ckpt['model']) and not tmp_files(tmp_path)


def test_lm_ctrl_c_saves_and_resume_is_exact(lm_corpus, tmp_path, monkeypatch, capsys):
    argv = lambda out, *x: lm_tiny_args(lm_corpus, out, '--max_iters', '6', '--eval_interval', '4', *x)
    whole = LossTap(monkeypatch, 'cross_entropy')
    a = train_lm.main(argv(tmp_path / 'a'))
    first = LossTap(monkeypatch, 'cross_entropy', ctrl_c_at=3)
    code, err = run_cli(train_lm.main, argv(tmp_path / 'b'), capsys)
    assert_one_line_error(code, err, 130, ['interrupted: at step 3', 'ckpt.pt', '--resume'], 'train_lm.py')
    assert torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)['step'] == 3
    rest = LossTap(monkeypatch, 'cross_entropy')
    b = train_lm.main(argv(tmp_path / 'b', '--resume'))
    assert first.values + rest.values == whole.values
    strip = lambda h: [{k: v for k, v in r.items() if k != 'time'} for r in h]
    assert strip(a['history']) == strip(b['history']) and a['flops'] == b['flops']


def kill_mid_checkpoint(main, argv, loss, ckpt, orphan, monkeypatch, capsys):
    """Every script: Ctrl-C in step 3 (checkpoint eval_interval 2, so the Ctrl-C one at step 3), a tmp file that
    a kill -9 left, then a --resume that dies halfway through writing the step-4 checkpoint. The orphan is
    gone, no tmp file is left, the step-3 checkpoint is intact. -> what resuming once more returns."""
    LossTap(monkeypatch, loss, ctrl_c_at=3)
    assert run_cli(main, argv, capsys)[0] == 130
    dead = plant_orphan(orphan, ckpt.parent, ckpt.name)
    with dying_torch_save(monkeypatch), pytest.raises(KeyboardInterrupt):
        main(argv + ['--resume'])
    assert not os.path.exists(dead) and not tmp_files(ckpt.parent)
    assert torch.load(ckpt, weights_only=True)['step'] == 3
    return main(argv + ['--resume'])


def test_lm_kill_during_checkpoint_loses_nothing(lm_corpus, tmp_path, monkeypatch, capsys, orphan):
    argv = lm_tiny_args(lm_corpus, tmp_path, '--max_iters', '6', '--eval_interval', '2')
    res = kill_mid_checkpoint(train_lm.main, argv, 'cross_entropy', tmp_path / 'ckpt.pt', orphan, monkeypatch, capsys)
    assert [s for s, _ in res['losses']] == [4, 5, 6]


def test_lm_reports_skipped_files_and_outputs(lm_corpus, tmp_path, capsys):
    d = tmp_path / 'src'
    d.mkdir()
    (d / 'a.txt').write_text('hello world, some text here\n' * 80)
    (d / 'latin1.txt').write_bytes('caf\xe9\n'.encode('latin-1') * 50)
    lm_run(lm_corpus, tmp_path / 'out', '--data', str(d))
    text = capsys.readouterr().out
    assert 'skipped 1 file(s) that are not UTF-8 text (latin1.txt)' in text
    assert text.strip().splitlines()[-1] == (f"outputs: checkpoint {tmp_path / 'out' / 'ckpt.pt'} | "
                                             f"log {tmp_path / 'out' / 'log.json'}")

# -----------------------------------------------------------------------------
# train_icl.py

import train_icl as icl  # noqa: E402
from tests import icl_tiny_argv  # noqa: E402

ICL_RUN = 'icl_standard_H2_D16'


def icl_argv(out, *extra):
    return icl_tiny_argv('standard', out, *extra)


def icl_setup(out, how):
    setup_case(how, out, str(out / f'{ICL_RUN}.pt'), lambda: icl.main(icl_argv(out)), 'train_lm.py')


ICL_BAD = range_cases(steps='0', batch_size='-1', lr='nan', warmup='-1', threads='-2', log_interval='0',
                      eval_interval='-1') + [
    ('lr_zero', ['--lr', '0'], None, 2, ['--lr 0']),
    ('widths', ['--widths', '8,x'], None, 2, ["--widths '8,x'"]),
    ('depths', ['--depths', '0'], None, 2, ["--depths '0'"]),
    ('n_points_below_2d', ['--n_points', '5'], None, 1, ['--n_points 5', '--d 4', 'N >= 2d = 8']),
    ('attn', ['--attn', 'nope'], None, 1, ["'nope'"]),
    ('test_cov', ['--test_cov', '1,2'], None, 1, ["'1,2'"]),
    ('n_head', ['--n_head', '3'], None, 1, ['3']),
    ('unwritable_assets', ['--sweep', 'bottleneck', '--widths', '8', '--assets_dir', 'UNWRITABLE'], 'unwritable', 1,
     ['--assets_dir', 'cannot be written']),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.0001 vs given 0.5']),
    ('resume_shape', ['--resume', '--n_layer', '3'], 'run', 1, ['--n_layer: checkpoint 2 vs given 3']),
] + shared_cases('train_icl.py', f'{ICL_RUN}.pt', 'train_lm.py')


@pytest.mark.parametrize('case,extra,setup,code,words', ICL_BAD, ids=[c[0] for c in ICL_BAD])
def test_icl_bad_input_one_line(tmp_path, capsys, case, extra, setup, code, words):
    out = tmp_path / 'run'
    icl_setup(out, setup)
    extra = [{'UNWRITABLE': str(tmp_path / 'a_file' / 'x')}.get(a, a) for a in extra]
    got, err = run_cli(icl.main, icl_argv(out, *extra), capsys)
    assert_one_line_error(got, err, code, words, 'train_icl.py')


def test_icl_nan_stops_at_that_step_without_nan_checkpoint(tmp_path, monkeypatch, capsys):
    LossTap(monkeypatch, 'mse_loss', nan_at=3)
    code, err = run_cli(icl.main, icl_argv(tmp_path, '--steps', '6'), capsys)
    assert_one_line_error(code, err, 1, ['training loss is nan at step 3', '--lr'], 'train_icl.py')
    ckpt = torch.load(tmp_path / f'{ICL_RUN}.pt', weights_only=True)
    assert ckpt['step'] == 2 and all_finite(ckpt['model']) and not tmp_files(tmp_path)
    assert not os.path.exists(tmp_path / f'{ICL_RUN}.json')                # no results from a diverged run


def test_icl_ctrl_c_saves_and_resume_is_exact(tmp_path, monkeypatch, capsys):
    argv = lambda out, *x: icl_argv(out, '--steps', '6', '--eval_interval', '4', *x)
    whole = LossTap(monkeypatch, 'mse_loss')
    a = icl.main(argv(tmp_path / 'a'))
    first = LossTap(monkeypatch, 'mse_loss', ctrl_c_at=3)
    code, err = run_cli(icl.main, argv(tmp_path / 'b'), capsys)
    assert_one_line_error(code, err, 130, ['interrupted:', 'at step 3', f'{ICL_RUN}.pt', '--resume'], 'train_icl.py')
    rest = LossTap(monkeypatch, 'mse_loss')
    b = icl.main(argv(tmp_path / 'b', '--resume'))
    assert first.values + rest.values == whole.values and len(whole.values) == 6
    strip = lambda h: [{k: v for k, v in r.items() if k != 'time_s'} for r in h]
    assert strip(a['history']) == strip(b['history'])
    assert a['model'] == b['model'] and a['train_flops'] == b['train_flops']


def test_icl_kill_during_checkpoint_loses_nothing(tmp_path, monkeypatch, capsys, orphan):
    res = kill_mid_checkpoint(icl.main, icl_argv(tmp_path, '--steps', '6'), 'mse_loss', tmp_path / f'{ICL_RUN}.pt',
                              orphan, monkeypatch, capsys)
    assert [h['step'] for h in res['history']] == [0, 2, 4, 6]


def test_icl_sweep_writes_no_assets_by_default(tmp_path, capsys):
    argv = [a for a in icl_argv(tmp_path, '--sweep', 'bottleneck', '--widths', '8', '--steps', '2', '--workers', '1')]
    i = argv.index('--assets_dir')
    del argv[i:i + 2]
    assert icl.build_parser().parse_args(argv).assets_dir == ''
    icl.main(argv)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('outputs: results ')

# -----------------------------------------------------------------------------
# train_lra.py

import train_lra as lra  # noqa: E402
from tests import LRA_SMALL, write_cifar  # noqa: E402


@pytest.fixture(scope='module')
def lra_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp('lra_cache'))


def lra_argv(out, cache, *extra):
    return ['--task', 'listops', '--max_len', '64', '--min_len', '8', '--n_train', '48', '--n_val', '16',
            '--n_test', '16', '--cache_dir', cache, '--out_dir', str(out), *LRA_SMALL, *extra]


def write_listops_release(d, bad_line=None):
    """A release-layout ListOps folder (basic_{train,val,test}.tsv); bad_line replaces train line 3."""
    d.mkdir(parents=True, exist_ok=True)
    rows = [('( ( ( [MAX 2 ) 9 ) ] )', 9), ('( ( [SM 4 ) 7 ) ] )', 1), ('( ( ( [MED 1 ) 3 ) ] )', 2),
            ('( ( ( [MIN 5 ) 6 ) ] )', 5)]
    for split in ('train', 'val', 'test'):
        lra.write_tsv(str(d / f'basic_{split}.tsv'), ['Source', 'Target'], rows * 2)
    if bad_line is not None:
        lines = (d / 'basic_train.tsv').read_text().splitlines()
        lines[2] = bad_line
        (d / 'basic_train.tsv').write_text('\n'.join(lines) + '\n')
    return d


def lra_setup(out, cache, how, tmp_path):
    if how == 'no_tab':
        write_listops_release(tmp_path / 'rel', bad_line='( ( [MAX 2 ) ] ) 2')
    elif how == 'bad_label':
        write_listops_release(tmp_path / 'rel', bad_line='( ( [MAX 2 ) ] )\tseven')
    elif how == 'label_range':
        write_listops_release(tmp_path / 'rel', bad_line='( ( [MAX 2 ) ] )\t12')
    elif how == 'binary_tsv':
        write_listops_release(tmp_path / 'rel')
        (tmp_path / 'rel' / 'basic_val.tsv').write_bytes(b'\xff\xfe\x00\x01' * 50)
    elif how == 'wrong_folder':
        (tmp_path / 'rel').mkdir()
        (tmp_path / 'rel' / 'README.txt').write_text('not LRA')
    elif how == 'random_cifar':
        d = write_cifar(tmp_path)
        (d / 'data_batch_3').write_bytes(b'\x80\x02garbage' * 10)
        os.rename(d, tmp_path / 'rel')
    setup_case(how, out, str(out / 'ckpt.pt'), lambda: lra.main(lra_argv(out, cache)), 'train_ts.py')


LRA_BAD = range_cases(steps='0', batch_size='0', lr='-1', warmup='-1', threads='-1', window='0') + [
    ('bench_lens', ['--bench', '--bench_lens', '0'], None, 2, ["--bench_lens '0'"]),
    ('bench_reps', ['--bench', '--bench_reps', '0'], None, 2, ['--bench_reps 0']),
    ('attn', ['--attn', 'nope'], None, 2, ["'nope'"]),
    ('pathfinder_len', ['--task', 'pathfinder', '--max_len', '500'], None, 2, ['--max_len 500']),
    ('n_head', ['--n_head', '3'], None, 1, ['n_head', '3']),
    ('no_data_dir', ['--data_dir', '/nonexistent/lra'], None, 1, ["--data_dir '/nonexistent/lra'"]),
    ('tsv_no_tab', ['--data_dir', 'REL'], 'no_tab', 1, ['basic_train.tsv line 3', 'Source<TAB>Target']),
    ('tsv_bad_label', ['--data_dir', 'REL'], 'bad_label', 1, ['basic_train.tsv line 3', "'seven'"]),
    ('tsv_label_range', ['--data_dir', 'REL'], 'label_range', 1, ['basic_train.tsv line 3', "label '12'"]),
    ('tsv_binary', ['--data_dir', 'REL'], 'binary_tsv', 1, ['not a readable listops release folder', 'decode']),
    ('wrong_release_folder', ['--data_dir', 'REL'], 'wrong_folder', 1, ['not a readable listops release folder',
                                                                         '*_train.tsv']),
    ('cifar_random_bytes', ['--task', 'image', '--max_len', '1024', '--data_dir', 'REL'], 'random_cifar', 1,
     ['not a readable image release folder']),
    ('resume_attn', ['--resume', '--attn', 'swa'], 'run', 1, ["--attn: checkpoint 'standard' vs given 'swa'"]),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.001 vs given 0.5']),
    ('compare_missing', ['--compare', 'NOWHERE'], None, 1, ["--compare 'NOWHERE'", 'results.json']),
] + shared_cases('train_lra.py', 'ckpt.pt', 'train_ts.py')


@pytest.mark.parametrize('case,extra,setup,code,words', LRA_BAD, ids=[c[0] for c in LRA_BAD])
def test_lra_bad_input_one_line(lra_cache, tmp_path, capsys, case, extra, setup, code, words):
    out = tmp_path / 'run'
    lra_setup(out, lra_cache, setup, tmp_path)
    subst = {'REL': str(tmp_path / 'rel'), 'UNWRITABLE': str(tmp_path / 'a_file' / 'x'), 'NOWHERE': 'NOWHERE'}
    extra = [subst.get(a, a) for a in extra]
    cache = str(tmp_path / 'cache') if (tmp_path / 'rel').exists() else lra_cache
    got, err = run_cli(lra.main, lra_argv(out, cache, *extra), capsys)
    assert_one_line_error(got, err, code, words, 'train_lra.py')


def test_lra_release_cache_follows_file_content(tmp_path):
    """An edited release file is parsed again: the cache is keyed on the files' sizes and mtimes."""
    d = write_listops_release(tmp_path / 'rel')
    args = lra.parse_args(['--data_dir', str(d), '--max_len', '16', '--cache_dir', str(tmp_path / 'cache')])
    assert lra.load_task(args)[0]['train'][1].tolist()[:2] == [9, 1]
    (d / 'basic_train.tsv').write_text('Source\tTarget\n( ( [MAX 2 ) ] )\t2\n( ( [MIN 4 ) ] )\t4\n')
    assert lra.load_task(args)[0]['train'][1].tolist() == [2, 4]
    assert len(os.listdir(tmp_path / 'cache')) == 2 and not tmp_files(tmp_path / 'cache')


def test_lra_nan_stops_at_that_step_without_nan_checkpoint(lra_cache, tmp_path, monkeypatch, capsys):
    LossTap(monkeypatch, 'cross_entropy', nan_at=3)
    code, err = run_cli(lra.main, lra_argv(tmp_path, lra_cache, '--steps', '6', '--eval_interval', '2'), capsys)
    assert_one_line_error(code, err, 1, ['training loss is nan at step 3', '--lr'], 'train_lra.py')
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['step'] == 2 and all_finite(ckpt['model']) and not tmp_files(tmp_path)
    assert not os.path.exists(tmp_path / 'results.json')


def test_lra_ctrl_c_saves_and_resume_is_exact(lra_cache, tmp_path, monkeypatch, capsys):
    """Batches of 8 from 48 examples: the order is redrawn after 6 steps, so 9 steps cross an epoch."""
    argv = lambda out, *x: lra_argv(out, lra_cache, '--steps', '9', '--eval_interval', '4', '--log_interval', '3',
                                    *x)
    whole = LossTap(monkeypatch, 'cross_entropy')
    a = lra.main(argv(tmp_path / 'a'))
    first = LossTap(monkeypatch, 'cross_entropy', ctrl_c_at=5)
    code, err = run_cli(lra.main, argv(tmp_path / 'b'), capsys)
    assert_one_line_error(code, err, 130, ['interrupted: at step 5', 'ckpt.pt', '--resume'], 'train_lra.py')
    rest = LossTap(monkeypatch, 'cross_entropy')
    b = lra.main(argv(tmp_path / 'b', '--resume'))
    assert first.values + rest.values == whole.values and len(whole.values) == 9
    strip = lambda h: [{k: v for k, v in r.items() if k != 'train_seconds'} for r in h]
    assert strip(a['history']) == strip(b['history'])
    assert (a['final_test_acc'], a['best_val_acc'], a['best_step']) == (b['final_test_acc'], b['best_val_acc'],
                                                                        b['best_step'])


def test_lra_kill_during_checkpoint_loses_nothing(lra_cache, tmp_path, monkeypatch, capsys, orphan):
    argv = lra_argv(tmp_path, lra_cache, '--steps', '6', '--eval_interval', '2')
    res = kill_mid_checkpoint(lra.main, argv, 'cross_entropy', tmp_path / 'ckpt.pt', orphan, monkeypatch, capsys)
    assert [h['step'] for h in res['history']] == [2, 4, 6]


def test_lra_show_writes_to_out_dir_not_assets(tmp_path, capsys):
    lra.main(['--task', 'pathfinder', '--show', '--n_train', '16', '--n_val', '2', '--n_test', '2',
              '--cache_dir', str(tmp_path / 'cache'), '--out_dir', str(tmp_path / 'out')])
    assert (tmp_path / 'out' / 'lra_pathfinder_samples.png').exists()
    assert capsys.readouterr().out.strip().splitlines()[-1] == \
        f"outputs: samples {tmp_path / 'out' / 'lra_pathfinder_samples.png'}"
    assert lra.parse_args(['--task', 'pathfinder', '--show']).out_dir == os.path.join('out', 'lra_pathfinder_standard')

# -----------------------------------------------------------------------------
# train_ts.py

import train_ts as ts  # noqa: E402


@pytest.fixture(scope='module')
def ts_data(tmp_path_factory):
    """A KernelSynth cache shared by this module's runs, and a small ETT-format CSV."""
    root = tmp_path_factory.mktemp('ts')
    lines = ['date,a,b,OT'] + [f"2016-07-{1 + i // 24:02d} {i % 24:02d}:00:00,{np.sin(i / 4):.4f},{i % 24},"
                               f"{np.cos(i / 6):.4f}" for i in range(400)]
    (root / 'ett.csv').write_text('\n'.join(lines) + '\n')
    return root


def ts_argv(out, ts_data, *extra):
    return ['--out_dir', str(out), '--data_dir', str(ts_data / 'ks'), '--attn', 'standard', '--n_layer', '1',
            '--n_head', '2', '--n_embd', '16', '--max_steps', '4', '--eval_interval', '2', '--batch_size', '4',
            '--val_windows', '8', '--quiet', '--device', 'cpu', '--task', 'chronos', '--n_series', '6',
            '--val_series', '4', '--series_len', '64', '--context', '24', '--horizon', '8', '--vocab', '64',
            '--forecast_series', '1', '--num_samples', '2', '--zero_shot', '0', *extra]


def ett_argv(csv, *extra):
    return ['--task', 'longhorizon', '--data', str(csv), '--seq_len', '24', '--horizons', '8', '--dlinear_steps', '4',
            *extra]


def write_bad_csv(ts_data, tmp_path, how):
    """The fixture CSV with one defect."""
    lines = (ts_data / 'ett.csv').read_text().splitlines()
    if how == 'nan_cell':
        lines[5] = lines[5].rsplit(',', 1)[0] + ',nan'
    elif how == 'empty_cell':
        lines[5] = lines[5].rsplit(',', 1)[0] + ','
    elif how == 'bad_date':
        lines[7] = '2016-13-45 00:00:00' + lines[7][19:]
    elif how == 'ragged':
        lines[9] = lines[9] + ',7'
    path = tmp_path / 'bad.csv'
    if how == 'binary':
        path.write_bytes(b'\x89PNG\r\n\x1a\n\xff\xfe' * 40)
    else:
        path.write_text('\n'.join(lines) + '\n')


def ts_setup(out, ts_data, tmp_path, how):
    if how in ('nan_cell', 'empty_cell', 'bad_date', 'ragged', 'binary'):
        write_bad_csv(ts_data, tmp_path, how)
    setup_case(how, out, str(out / 'ckpt_chronos_standard.pt'), lambda: ts.main(ts_argv(out, ts_data)),
               'train_icl.py')


TS_BAD = range_cases(batch_size='0', max_steps='0', warmup='-1', threads='-1', lr='0', eval_interval='0',
                     num_samples='0', context='0', grad_clip='0') + [
    ('horizons', ett_argv('x', '--horizons', '0,8'), None, 2, ["--horizons '0,8'"]),
    ('attn', ['--attn', 'nope'], None, 2, ["'nope'"]),
    ('series_len', ['--series_len', '20'], None, 1, ['--series_len 20', '--context 24', '--horizon 8']),
    ('mlr_levels', ['--attn', 'mlr', '--ranks', '4|2|2', '--context', '26'], None, 1, ['divisible by 4', 'T = 34']),
    ('ett_missing', ett_argv('/nonexistent/ETTh1.csv'), None, 1, ["'/nonexistent/ETTh1.csv'"]),
    ('ett_nan_cell', ett_argv('BAD'), 'nan_cell', 1, ["row 6 column 'OT'", "'nan'", 'finite']),   # file lines
    ('ett_empty_cell', ett_argv('BAD'), 'empty_cell', 1, ["row 6 column 'OT'", "''"]),
    ('ett_bad_date', ett_argv('BAD'), 'bad_date', 1, ['row 8', "'2016-13-45 00:00:00' is not a date"]),
    ('ett_ragged_row', ett_argv('BAD'), 'ragged', 1, ['row 10', '4 values but 3 columns']),
    ('ett_binary', ett_argv('BAD'), 'binary', 1, ['bad.csv', 'not a text CSV']),
    ('ett_horizon_too_long', ett_argv('ETT', '--horizons', '8,96'), None, 1, ['--horizons 96', '--seq_len 24']),
    ('resume_shape', ['--resume', '--n_embd', '32'], 'run', 1, ['--n_embd: checkpoint 16 vs given 32']),
    ('resume_lr', ['--resume', '--lr', '0.5'], 'run', 1, ['--lr: checkpoint 0.003 vs given 0.5']),
] + shared_cases('train_ts.py', 'results_chronos.json', 'train_icl.py')


@pytest.mark.parametrize('case,extra,setup,code,words', TS_BAD, ids=[c[0] for c in TS_BAD])
def test_ts_bad_input_one_line(ts_data, tmp_path, capsys, case, extra, setup, code, words):
    out = tmp_path / 'run'
    ts_setup(out, ts_data, tmp_path, setup)
    subst = {'BAD': str(tmp_path / 'bad.csv'), 'ETT': str(ts_data / 'ett.csv'),
             'UNWRITABLE': str(tmp_path / 'a_file' / 'x')}
    extra = [subst.get(a, a) for a in extra]
    got, err = run_cli(ts.main, ts_argv(out, ts_data, *extra), capsys)
    assert_one_line_error(got, err, code, words, 'train_ts.py')


def test_ts_nan_stops_at_that_step_without_nan_checkpoint(ts_data, tmp_path, monkeypatch, capsys):
    LossTap(monkeypatch, 'cross_entropy', nan_at=3)
    code, err = run_cli(ts.main, ts_argv(tmp_path, ts_data, '--max_steps', '6'), capsys)
    assert_one_line_error(code, err, 1, ['training loss is nan at step 3', '--lr'], 'train_ts.py')
    ckpt = torch.load(tmp_path / 'ckpt_chronos_standard.pt', weights_only=True)
    assert ckpt['step'] == 2 and all_finite(ckpt['model']) and not tmp_files(tmp_path)
    assert not os.path.exists(tmp_path / 'results_chronos.json')         # no scores of an untrained model


def test_ts_ctrl_c_saves_and_resume_is_exact(ts_data, tmp_path, monkeypatch, capsys):
    """Long-horizon: DLinear (4 steps), then standard attention (6 steps) with the best weights restored at
    the end; Ctrl-C in the third step of the second model."""
    argv = lambda out, *x: ts_argv(out, ts_data, *ett_argv(ts_data / 'ett.csv'), '--max_steps', '6', *x)
    whole = LossTap(monkeypatch, 'mse_loss')
    a = ts.main(argv(tmp_path / 'a'))
    first = LossTap(monkeypatch, 'mse_loss', ctrl_c_at=7)
    code, err = run_cli(ts.main, argv(tmp_path / 'b'), capsys)
    assert_one_line_error(code, err, 130, ['interrupted:', 'standard-H8', 'at step 3', '--resume'], 'train_ts.py')
    rest = LossTap(monkeypatch, 'mse_loss')
    b = ts.main(argv(tmp_path / 'b', '--resume'))
    assert first.values + rest.values == whole.values and len(whole.values) == 10
    for model in ('dlinear', 'standard'):
        ra, rb = a['runs']['8'][model], b['runs']['8'][model]
        assert (ra['mse'], ra['mae'], ra['best_val_mse']) == (rb['mse'], rb['mae'], rb['best_val_mse'])
        strip = lambda h: [{k: v for k, v in r.items() if k != 'ms_per_step'} for r in h]
        assert strip(ra['history']) == strip(rb['history'])


def test_ts_kill_during_checkpoint_loses_nothing(ts_data, tmp_path, monkeypatch, capsys, orphan):
    res = kill_mid_checkpoint(ts.main, ts_argv(tmp_path, ts_data, '--max_steps', '6'), 'cross_entropy',
                              tmp_path / 'ckpt_chronos_standard.pt', orphan, monkeypatch, capsys)
    assert [h['step'] for h in res['runs']['standard']['history']] == [0, 2, 4, 6]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"outputs: results {tmp_path}")

# -----------------------------------------------------------------------------
# all four


@pytest.mark.parametrize('build', [train_lm.build_parser, icl.build_parser, lra.get_parser, ts.get_parser])
def test_train_script_help_shows_defaults(build, monkeypatch):
    monkeypatch.setenv('COLUMNS', '200')
    text = build().format_help()
    flags = text.count('\n  --')
    assert text.count('(default:') >= 0.9 * flags, f"{flags} flags, {text.count('(default:')} defaults shown"
