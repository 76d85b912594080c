"""
The run plumbing the four train scripts share, so that each of them holds only its experiment.

    start-up     imported first by every train script: OpenMP's wait policy before torch loads, and a Ctrl-C
                 while it loads is one line and exit 130
    flags        every attention.ModelConfig field but the task's (TASK_FIELDS) is a flag of every train script
                 (add_model_args); a flag the run would not read (no layer reads it, its mode is off, its sweep
                 sets it) is refused, not ignored
    errors       run_main: bad input is one line on stderr, never a traceback. Exit 2: a bad flag value, or a
                 flag of a mode that is off. Exit 1: a bad file or device, a model setting that does not fit or
                 that no layer reads, a conflict (a refused --resume, a folder in use or holding another run) or
                 an I/O failure. Exit 130: Ctrl-C, after the current step and a checkpoint
    run folders  prepare_out_dir: writable, owned by one process at a time, no earlier run replaced by accident
    checkpoints  one dict, written atomically, never with non-finite weights, stamped with FORMAT
    divergence   check_loss / guarded_update stop at the first non-finite loss, before any update
    data caches  keyed on the bytes of the data (content_digest), never on file times
    sweeps       sweep(): seeded runs in their own processes, one thread each, finished ones reused, cut-off ones
                 resumed, longest first; mean ± std over seeds, paired t-tests, seed-band plots
"""

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, fields

# Before torch loads OpenMP (each train script imports this module first): a thread out of work spins ~0.1 ms,
# then sleeps. libgomp's default (spin for milliseconds) made a step 10x slower and more while another process
# kept a core busy (README, "Quick start").
if 'OMP_WAIT_POLICY' not in os.environ:               # set it yourself to override both
    os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'         # any OpenMP runtime: sleep when out of work...
    os.environ.setdefault('GOMP_SPINCOUNT', '10000')  # ...libgomp (Linux wheels): after a short spin

TRAIN_SCRIPTS = ('train_lm.py', 'train_icl.py', 'train_lra.py', 'train_ts.py')


def interrupted_while_starting(*_):
    print(f"{os.path.basename(sys.argv[0])}: interrupted: Ctrl-C while starting; nothing written", file=sys.stderr)
    os._exit(130)


# A Ctrl-C while a train script loads torch: one line and exit 130, as run_main does once main runs.
if os.path.basename(getattr(sys.modules['__main__'], '__file__', None) or '') in TRAIN_SCRIPTS:
    signal.signal(signal.SIGINT, interrupted_while_starting)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from attention import READ_BY, ModelConfig, check_config, unread  # noqa: E402

FORMAT = 3  # the layout of checkpoints and run configs; a run written under another FORMAT is refused, not guessed at


class Diverged(RuntimeError):
    """The training loss or the weights stopped being finite; the run stopped without saving them."""


class Interrupted(Exception):
    """Ctrl-C: the run saved a checkpoint after its current step and stopped."""


# -----------------------------------------------------------------------------
# flags: one-line errors, the model flags of every script, ranges, --resume

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors: 'prog: error: message (see --help)', exit 2."""

    def __init__(self, *args, **kw):
        kw.setdefault('formatter_class', HelpFormatter)
        kw.setdefault('allow_abbrev', False)   # --quic is an error, not --quick (sweeps pass flags on by name)
        super().__init__(*args, **kw)
        self._negative_number_matcher = re.compile(r'^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$', re.I)  # -1e-3 too

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


TASK_FIELDS = ('block_size', 'causal')   # ModelConfig fields that each task sets from its data: not flags


def add_model_args(parser, **task_defaults):
    """The 'model' group: --<field> for each ModelConfig field but TASK_FIELDS, with the field's help, defaulting
    to ModelConfig's value or, where the script's task has its own, to task_defaults[field]."""
    flags = [f for f in fields(ModelConfig) if f.name not in TASK_FIELDS]
    unknown = sorted(set(task_defaults) - {f.name for f in flags})
    if unknown:
        raise TypeError(f"add_model_args: not model flags: {unknown}")
    g = parser.add_argument_group('model (attention.ModelConfig: the same flags in every train script)')
    for f in flags:
        kind = getattr(f.type, '__name__', f.type)
        how = (dict(action=argparse.BooleanOptionalAction) if kind == 'bool'
               else dict(type={'int': int, 'float': float, 'str': str}[kind]))
        g.add_argument(f'--{f.name}', default=task_defaults.get(f.name, f.default), help=f.metadata['help'], **how)
    return g


def model_config(args, block_size, causal, **task):
    """ModelConfig from the model flags, the task's fields (**task) winning; a bad value is one ValueError line."""
    task.update(block_size=block_size, causal=causal)
    cfg = ModelConfig(**{**{f.name: getattr(args, f.name) for f in fields(ModelConfig) if f.name not in task}, **task})
    check_config(cfg)
    return cfg


def unread_flags(args, names, causal, attn=None):
    """The model flags among `names` that no layer of args' model (its --attn, or `attn`) reads."""
    cfg = ModelConfig(attn=attn or args.attn, layer_pattern=args.layer_pattern, global_layers=args.global_layers,
                      n_layer=args.n_layer, causal=causal)
    return unread(cfg, names)


def check_flags_read(args, given, causal, attns=None, what=''):
    """ValueError at a model flag on the command line that no layer of the model reads (of any model, for a sweep
    or ts's --attn list: attns, named by `what`), so that a setting that cannot take effect is not taken for one
    that did."""
    attns = attns or [args.attn]
    idle = set(given).intersection(*(unread_flags(args, given, causal, a) for a in attns))
    if idle:
        n = min(idle)
        causal_only = n in ('brl_block', 'brl_history') and not causal
        readers = 'causal brl' if causal_only else ', '.join(READ_BY[n])
        model = f'--layer_pattern {args.layer_pattern}' if args.layer_pattern else what or f'--attn {args.attn}'
        raise ValueError(f"--{n} is read only by {readers} attention, which {model} does not have"
                         f"{' (bidirectional here)' if causal_only else ''}: leave --{n} out")


def without_flags(argv, dests, parser):
    """argv less the flags of these dests (parser's actions) and their values: --f v, --f=v; a switch's --f, --no-f."""
    strip = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for a in parser._actions:
        if a.dest in dests and a.option_strings:
            strip.add_argument(*a.option_strings, **({'action': 'store_true'} if a.nargs == 0 else {}))
    return strip.parse_known_args(argv)[1]


CPUS, INT64 = os.cpu_count() or 1, 2 ** 63 - 1
# Every script holds these flags to these intervals: a number the code can use. --lr 1e300 overflows AdamW's
# update, a seed must fit torch's 64-bit generator, and 100000 OpenMP threads crash the process.
RANGES = dict(lr='(0, 10]', weight_decay='[0, 10]', seed=f'[0, {INT64}]', threads=f'[0, {4 * CPUS}]',
              workers=f'[0, {4 * CPUS}]')


def check_numbers(parser, args, ranges=None):
    """parser.error (exit 2) at the first numeric flag that is not a finite number in its interval, written as
    '(0, 10]' ('inf': no bound): the script's ranges, then RANGES, else it must fit in 64 bits."""
    ranges = {**RANGES, **(ranges or {})}
    for a in parser._actions:
        v = getattr(args, a.dest, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            interval = ranges.get(a.dest, f'[-{INT64}, {INT64}]')
            lo, hi = (int(s) if s.lstrip('-').isdigit() else float(s) for s in interval[1:-1].split(', '))
            if not ((isinstance(v, int) or math.isfinite(v)) and (lo < v if interval[0] == '(' else lo <= v)
                    and (v < hi if interval[-1] == ')' else v <= hi)):   # an int too large for a float is finite
                parser.error(f"--{a.dest} {v}: must be a finite number in {interval}")


def check_ranges(parser, args, positive=(), non_negative=()):
    """check_numbers with the flags `positive` in (0, inf) and `non_negative` in [0, inf)."""
    check_numbers(parser, args, {**dict.fromkeys(positive, '(0, inf)'), **dict.fromkeys(non_negative, '[0, inf)')})


def no_repeats(parser, name, items):
    twice = [v for i, v in enumerate(items) if v in items[:i]]
    if twice:
        parser.error(f"--{name} names {twice[0]!r} twice: give each once")


def physical_memory():
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def brl_bytes(a, T, causal):
    """A lower bound of what BRL's compressed tokens hold for a training step's backward, 4 bytes a float: per
    layer, batch row and chunk, the m compressed tokens and one m x history score map per head (the history:
    causal, a chunk of nc and, 'global', ct_{b-1}; bidirectional, all T). 0 for the other variants."""
    if a.attn != 'brl':
        return 0
    m, nc = a.n_compressed, (a.brl_block or a.window) if causal else T
    hist = nc + (m if causal and a.brl_history == 'global' else 0)
    return 4 * a.n_layer * a.batch_size * -(-T // nc) * m * (a.n_embd + a.n_head * hist)


def given_flags(parser, argv=None):
    """The dests of the flags written on the command line, a flag given with its default value too."""
    actions, defaults = [(a, a.default) for a in parser._actions], parser._defaults
    try:
        parser._defaults = {}
        for a, _ in actions:
            a.default = argparse.SUPPRESS                 # so that only the given flags reach the namespace
        ns, _ = parser.parse_known_args(argv)
    finally:
        parser._defaults = defaults
        for a, d in actions:
            a.default = d
    return set(vars(ns))


def check_model_settings(saved, what, set_by_task=TASK_FIELDS):
    """ValueError unless the run config `saved` holds every model flag (all ModelConfig fields but set_by_task)."""
    saved = saved if isinstance(saved, dict) else {}
    lost = [f.name for f in fields(ModelConfig) if f.name not in saved and f.name not in set_by_task]
    if lost:
        raise ValueError(f"{what} lacks the model settings {lost[:3]}...: not a run of this script")


def check_run_length(step, schedule, old, new, flag, show=lambda lr: f'lr {lr:.4g}'):
    """--resume with another run length, `old` -> `new` steps: refused unless every step already taken (0 .. step - 1)
    trained as step s of a `new`-step run would (schedule(s, n): its lr, and whatever else scales with the run's
    length), so that the run continued is the one trained that long from scratch. A constant lr does that; a cosine
    schedule does not once past its warmup. show: a schedule value as the error line names it."""
    if new < step:
        raise ValueError(f"{flag}: {new} steps is below the checkpoint's step {step}; give at least {step}")
    bad = next((s for s in range(step) if schedule(s, old) != schedule(s, new)), None)
    if bad is not None:
        raise ValueError(f"{flag}: a {new}-step run cannot continue this {old}-step run: its step {bad} trained at "
                         f"{show(schedule(bad, old))}, a {new}-step run's at {show(schedule(bad, new))} (the schedule "
                         f"scales with the run's length); resume with its length, or train a new run in another "
                         f"--out_dir")


def resume_settings(saved, args, given, may_change=()):
    """--resume: the checkpoint's settings (saved) win, copied into args. A given flag must equal the saved value
    unless it is in may_change (run length, logging, ...), else one ValueError naming every conflict."""
    keep = {'resume', 'overwrite', 'out_dir', 'device'}
    check_model_settings(saved, '--resume: the checkpoint')
    conflicts = [f"--{k}: checkpoint {saved[k]!r} vs given {getattr(args, k)!r}" for k in sorted(given)
                 if k in saved and k not in keep and k not in may_change and saved[k] != getattr(args, k)]
    if conflicts:
        raise ValueError(f"--resume conflicts with the checkpoint: {'; '.join(conflicts)}. Drop those flags to "
                         f"continue the run as it was, or start a new run in another --out_dir")
    for k, v in saved.items():
        if k not in keep and not (k in may_change and k in given):
            setattr(args, k, v)


def pick_device(name):
    """--device: 'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'; ValueError otherwise."""
    if name == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    if not re.fullmatch(r'cpu|cuda(:\d+)?', name):
        raise ValueError(f"--device {name!r}: valid are auto, cpu, cuda, cuda:N")
    if name.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r} but CUDA is not available here; use --device cpu")
    return name


# -----------------------------------------------------------------------------
# files: atomic writes, run folders owned by one process, checkpoints, content digests

def atomic_write(path, write):
    """write(tmp), then rename tmp over path: a failed write (disk full, Ctrl-C) leaves path as it was and no tmp
    file, and re-raises (torch.save's RuntimeError of a full disk as an OSError naming path). A kill -9 leaves
    <path>.tmp<pid>: remove_orphan_tmp's to delete."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, RuntimeError) and not isinstance(e, Diverged):   # torch.save's writer on a full disk
            raise OSError(f"cannot write {path}: {' '.join(str(e).split())[:160]}") from None
        raise


@contextlib.contextmanager
def io_errors(flag, path):
    """An OS failure inside (disk full, a file in the way, no permission) becomes one OSError naming flag and path."""
    try:
        yield
    except OSError as e:
        if str(e).startswith('--'):                      # named already, by an inner io_errors
            raise
        what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else e.strerror or str(e)
        raise OSError(f"{flag} {path!r}: {what}") from None


def check_writable(path, flag):
    """The folder of the output file `path` can be created and written: checked before the work, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    with io_errors(flag, path):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass


def write_json(path, obj, **kw):
    def write(tmp):
        with open(tmp, 'w') as f:
            json.dump(obj, f, indent=1, **kw)
    atomic_write(path, write)


def read_json(path, flag, keys=()):
    """The JSON object in path; a file that is not JSON, not an object, or lacks one of keys is one ValueError line
    naming flag and path (an OS failure: io_errors' OSError)."""
    with io_errors(flag, path), open(path) as f:
        try:
            obj = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {path!r} is not a JSON file ({e})") from None
    return require_keys(obj, keys, flag, path)


def require_keys(obj, keys, flag, path):
    """obj, a JSON object holding every key; else one ValueError line naming flag and the file it came from."""
    missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
    if not isinstance(obj, dict) or missing:
        raise ValueError(f"{flag} {path!r} is not a file this script wrote (a JSON object"
                         f"{' with ' + ', '.join(map(repr, missing)) if missing else ''} expected)")
    return obj


def require_numbers(rows, fields, flag, path):
    """rows: a list of JSON objects, each with a number in every one of fields; else one ValueError line naming
    flag and the file they came from."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if not (isinstance(rows, list) and all(isinstance(r, dict) and all(number(r.get(f)) for f in fields)
                                           for r in rows)):
        raise ValueError(f"{flag} {path!r} is not a file this script wrote (the numbers {', '.join(fields)} "
                         f"expected)")
    return rows


def remove_orphan_tmp(folder):
    """Delete the tmp files '<name>.tmp<pid>' that a writer killed mid-write left in folder (a live writer's stay)."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = re.fullmatch(r'.+\.tmp(\d+)(\.npy|\.npz)?', name)
        if m:
            try:
                os.kill(int(m.group(1)), 0)                # signal 0: is the writer alive?
            except (ProcessLookupError, OverflowError):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
            except PermissionError:                        # alive, another user's
                pass


_LOCKS = {}   # folder's lock file -> the open file that holds its flock


def lock_folder(folder, flag='--out_dir'):
    """Own `folder`: an exclusive flock on <folder>/.lock, which the kernel drops when this process ends, however
    it ends (kill -9 too: no stale lock), or when the script's main returns (owns_run_folders). A second process
    is refused in one line naming the holder's pid."""
    path = os.path.join(os.path.realpath(folder), '.lock')
    if path in _LOCKS:
        return
    f = open(path, 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or 'unknown'
        f.close()
        raise ValueError(f"{flag} {folder!r} is in use by another run (pid {holder}): wait for it to end, "
                         f"or use another {flag}") from None
    f.truncate(0)                                        # 'a+': the write goes to the end, now 0
    f.write(f"{os.getpid()}\n")
    f.flush()
    _LOCKS[path] = f


def owns_run_folders(main):
    """Decorates a script's main: the folders it locked are released when it returns or raises, so that a sweep
    or a test may call main again in the same process."""
    @functools.wraps(main)
    def wrapper(*args, **kw):
        held = set(_LOCKS)
        try:
            return main(*args, **kw)
        finally:
            for path in set(_LOCKS) - held:
                _LOCKS.pop(path).close()
    return wrapper


def prepare_out_dir(out_dir, run_files=(), resume=False, overwrite=False, flag='--out_dir', lock=True):
    """Start-up checks of a run's folder, before any work: it can be written, this process owns it (lock_folder),
    a killed writer's tmp files go, and it holds no earlier run's files (run_files) unless --resume continues
    that run or --overwrite replaces it. -> the earlier run's files that --overwrite replaces: clear_earlier_run
    deletes them once the new run has written its first file over theirs, so that a run that fails before that
    (a refused start, a full disk, a NaN in its first steps) leaves the earlier run whole."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {out_dir!r} cannot be written: {e.strerror or e}") from None
    if lock:
        lock_folder(out_dir, flag)
    remove_orphan_tmp(out_dir)
    existing = [p for p in run_files if os.path.exists(p)]
    if existing and not resume and not overwrite:
        raise ValueError(f"{existing[0]} exists: {flag} {out_dir!r} holds an earlier run. Use --resume to "
                         f"continue it, another {flag}, or --overwrite to replace it")
    return existing if overwrite and not resume else []


def clear_earlier_run(paths, written):
    """Deletes prepare_out_dir's list of the earlier run's files but those the new run has just written over
    (`written`), emptying the list: a later call does nothing."""
    while paths:
        path = paths.pop()
        if path not in written:
            with contextlib.suppress(FileNotFoundError):   # another DDP rank may have removed it
                os.remove(path)


def save_checkpoint(path, ckpt):
    """torch.save the checkpoint dict, stamped with FORMAT, atomically; non-finite 'model' weights are Diverged
    instead: a diverged model never replaces the last good checkpoint."""
    bad = [k for k, v in ckpt['model'].items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise Diverged(f"weights {', '.join(bad[:3])} are not finite at step {ckpt.get('step')}: not writing "
                       f"{path}; the last checkpoint on disk is untouched. Try a lower --lr")
    atomic_write(path, lambda tmp: torch.save({**ckpt, 'format': FORMAT}, tmp))


def check_format(saved, where):
    """ValueError unless `saved` (a checkpoint or a saved run config) was written under this FORMAT."""
    if not isinstance(saved, dict) or saved.get('format') != FORMAT:
        raise ValueError(f"{where} was written by another version of this code (format "
                         f"{saved.get('format') if isinstance(saved, dict) else None}, this is {FORMAT}): "
                         f"train it again in another --out_dir, or with --overwrite")


def load_checkpoint(path, script, required=('model', 'optimizer', 'config', 'step')):
    """torch.load(weights_only=True) with one ValueError line for a missing, truncated, random-bytes or foreign
    file (its 'script' is the train script that wrote it), or one of another FORMAT."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path!r} (train first, or point --out_dir at a run folder)")
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path!r} is unreadable (truncated or corrupt, or not a checkpoint): "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:160]}. Delete it or train again") from None
    missing = sorted(set(required) - set(ckpt if isinstance(ckpt, dict) else ()))
    writer = ckpt.get('script', script) if isinstance(ckpt, dict) else None
    if missing or writer != script:
        why = f"it was written by {writer}" if writer and writer != script else f"it lacks {missing}"
        raise ValueError(f"{path!r} is not a {script} checkpoint: {why}")
    check_format(ckpt, f"checkpoint {path!r}")
    return ckpt


def content_digest(paths, chunk=1 << 20):
    """sha256 over the names and bytes of the files, a chunk at a time: what a data cache is keyed on, so that an
    edit is noticed whatever the file's size and mtime say (cp -p, tar and rsync -t restore mtimes)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode() + b'\0')
        with open(path, 'rb') as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def rng_state():
    """The global torch (CPU and CUDA), numpy and python RNG states, as a checkpoint can hold them."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return dict(torch=torch.get_rng_state(), python=random.getstate(),
                numpy=[kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    """Restore what rng_state() returned: a resumed run draws what the uninterrupted one would have."""
    torch.set_rng_state(state['torch'])
    kind, keys, pos, has_gauss, gauss = state['numpy']
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state['python'])
    if state['cuda'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


# -----------------------------------------------------------------------------
# the training loop's guards: divergence, Ctrl-C; the last line; __main__

LOSS_LIMIT = 1e12  # a larger training loss is divergence: the scripts' losses are cross-entropies (ln(vocab) at
                   # init) and MSEs of normalized or unit-variance targets, nowhere near it in a sound run


def check_loss(loss, step, hint='try a lower --lr'):
    """The training loss as a float, or Diverged at the first NaN, inf or loss above LOSS_LIMIT, before the
    optimizer step and any checkpoint (one device sync per step, the price of stopping at once)."""
    value = float(loss.detach() if torch.is_tensor(loss) else loss)
    if not math.isfinite(value) or abs(value) > LOSS_LIMIT:
        raise Diverged(f"training loss is {value} at step {step}: stopped before updating the weights; the last "
                       f"checkpoint on disk is untouched. {hint}")
    return value


def guarded_update(loss, step, model, opt, grad_clip, lr, warmup):
    """check_loss (lr, warmup: for its hint), then backward, gradient-norm clip (grad_clip > 0) and step."""
    value = check_loss(loss, step, f"Try a lower --lr than {lr:g}, or a longer --warmup_iters than {warmup}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return value


@contextlib.contextmanager
def ctrl_c_finishes_step():
    """While active, a first Ctrl-C only sets flag.stop: the loop ends its step, saves a checkpoint and raises
    Interrupted. A second Ctrl-C stops at once (KeyboardInterrupt). No-op outside the main thread."""
    flag = argparse.Namespace(stop=False)
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag.stop = True
        signal.signal(signal.SIGINT, previous)
        print("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again to quit at once)", file=sys.stderr)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def report_outputs(**where):
    """The last line of every run: where its checkpoint, JSON and plots went (None entries are left out)."""
    print('outputs: ' + ' | '.join(f"{k.replace('_', ' ')} {v}" for k, v in where.items() if v), flush=True)


def run_main(main, argv=None):
    """A train script's __main__: main(argv), with one line on stderr instead of a traceback, and the exit code
    of the module docstring's rule."""
    prog = os.path.basename(sys.modules[main.__module__].__file__)
    signal.signal(signal.SIGINT, signal.default_int_handler)     # interrupted_while_starting ends here
    try:
        return main(argv)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        what, message, code = 'error', e.code, 1
    except (ValueError, OSError, Diverged) as e:
        what, message, code = 'error', str(e), 1
    except Interrupted as e:
        what, message, code = 'interrupted', str(e), 130
    except KeyboardInterrupt:
        what, message, code = 'interrupted', ('Ctrl-C outside a training loop: no checkpoint written now (those '
                                              'already on disk are kept)'), 130
    message = ' '.join(message.split()).removeprefix('error: ')
    print(f"{prog}: {what}: {message}", file=sys.stderr)
    raise SystemExit(code)


# -----------------------------------------------------------------------------
# sweeps: one engine. A script's sweep is its list of Runs and its table; each Run is `python script argv` in
# its own folder, one thread, so runs are reused, resumed and timed alike in every script.

def positive_int(s):
    if int(s) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return int(s)


def add_sweep_args(p, name, variants, sweep_dir, title, about, dir_help='run folders, sweep.json, table.md, plot'):
    """The flags of a seeded sweep, the same in every script. -> the group, for a script's own sweep flags."""
    g = p.add_argument_group(title)
    g.add_argument('--sweep', choices=[name] if isinstance(name, str) else list(name), help=about)
    g.add_argument('--variants', default=','.join(variants), help='--sweep: comma list of variants')
    g.add_argument('--seeds', type=positive_int, default=3, help='--sweep: seeds per variant (--seed, --seed + 1, ...)')
    g.add_argument('--workers', type=int, default=2, help='--sweep: parallel runs, 1 thread each (0: in this process)')
    g.add_argument('--reuse', action=argparse.BooleanOptionalAction, default=True,
                   help='--sweep: keep finished runs and resume cut-off ones')
    g.add_argument('--sweep_dir', default=sweep_dir, help=f'--sweep: {dir_help}')
    g.add_argument('--estimate', action='store_true', help="--sweep: print the sweep's wall-time estimate and stop")
    return g


def group_flags(parser, title):
    """The dests of the flags in the --help group whose title starts with `title`."""
    return next({a.dest for a in g._group_actions} for g in parser._action_groups if g.title.startswith(title))


def check_mode_flags(parser, given, modes):
    """parser.error at a flag given for a mode that is off (--temperature without --sample, --widths without
    --sweep): the run does not read it. modes: (on, the flag that turns it on, the dests of its flags) each."""
    for on, flag, dests in modes:
        stray = sorted(set(dests) & set(given) - {flag.split()[0][2:]})
        if stray and not on:
            parser.error(f"--{stray[0]} is read only with {flag}, not given here: leave --{stray[0]} out")


def check_mode_reads(parser, given, mode, reads, why):
    """parser.error at a flag given with --mode that the mode does not read (besides --device, --threads,
    --progress); why: what it reads instead, for the error line."""
    stray = sorted(set(given) - set(reads) - {mode, 'device', 'threads', 'progress'})
    if stray:
        parser.error(f"--{stray[0]} does not go with --{mode}, which {why}")


@dataclass
class Run:
    """One run of a sweep: `python <script> <argv>`, writing into out_dir (argv names it)."""
    name: str              # e.g. 'mlr_seed0'
    group: str             # what the seeds average over: a variant, a model at a width, ...
    seed: int
    argv: list
    out_dir: str
    seconds: float = 0.0   # estimated training time: the printed estimate, and runs start longest first


def run_state(saved, want, free, where, finished, redo='another --sweep_dir, or --no-reuse to train every run again'):
    """Whether a sweep reuses a run folder: 'new' (saved is None), 'done' (finished) or 'partial' (--resume it).
    saved: the folder's run config; want: the sweep's settings; free: keys that may differ. A folder holding a
    run of other settings or another FORMAT is refused (ValueError; redo: the script's way out)."""
    if saved is None:
        return 'new'
    check_format(saved, where)
    diff = [k for k in sorted(want) if k in saved and k not in free and saved[k] != want[k]]
    if diff:
        k = diff[0]
        raise ValueError(f"{where} holds a run with --{k} {saved[k]!r}, this sweep asks {want[k]!r}: use {redo}")
    return 'done' if finished else 'partial'


def one_thread_seconds(step, repeats=2):
    """Wall seconds of step() on 1 thread, the best of `repeats` after a warm-up call: what a sweep run pays per
    step on this machine now (a busy machine reads slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return min(times[1:])


def longest_first_wall(seconds, workers):
    """Wall time of jobs of these seconds on `workers` processes, each taking the next job, the longest first."""
    free = [0.0] * max(1, workers)
    for s in sorted(seconds, reverse=True):
        free[free.index(min(free))] += s
    return max(free)


def sweep(runs, states, script, main, workers, tag='sweep'):
    """Train the runs whose state ({name: run_state(...)}) is not 'done', longest first: 'partial' ones with
    --resume, the others with --overwrite, `workers` processes `python script argv` at a time, one thread each,
    logging to <out_dir>/train.log (0: main(argv) one after another in this process). On Ctrl-C or SIGTERM the
    running ones get SIGINT: they save a checkpoint after their step, and a rerun resumes them. -> {name: exit code}"""
    todo = sorted((r for r in runs if states[r.name] != 'done'), key=lambda r: -r.seconds)
    blocked = [r.out_dir for r in todo if os.path.exists(r.out_dir) and not os.path.isdir(r.out_dir)]
    if blocked:                                                      # refused before any run starts
        raise ValueError(f"{blocked[0]} is a file where a run's folder goes: move it, or give the sweep another folder")
    wall = longest_first_wall([r.seconds for r in todo], workers)
    print(f"{tag}: {len(runs) - len(todo)} finished run(s) reused, {len(todo)} to train: "
          f"{sum(r.seconds for r in todo) / 60:.1f} min of 1-thread training, about {wall / 60:.1f} min wall with "
          f"{max(1, workers)} worker(s) on an idle machine", flush=True)
    pending = [(r, r.argv + ['--resume' if states[r.name] == 'partial' else '--overwrite']) for r in todo]
    codes, running = {}, {}
    if workers == 0:
        for r, argv in pending:
            try:
                main(argv)
                codes[r.name] = 0
            except (ValueError, SystemExit, Diverged) as e:
                print(f"{tag}: {r.name} failed: {e}")
                codes[r.name] = 1
        return codes
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM -> KeyboardInterrupt here
    try:
        while pending or running:
            while pending and len(running) < workers:
                r, argv = pending.pop(0)
                os.makedirs(r.out_dir, exist_ok=True)
                log = open(os.path.join(r.out_dir, 'train.log'), 'a')
                # a session of its own: a Ctrl-C at the terminal reaches only this process, which passes one
                # SIGINT on (a second one, straight from the terminal, would stop a run mid-step without saving)
                running[r.name] = (subprocess.Popen([sys.executable, os.path.abspath(script), *argv], stdout=log,
                                                    stderr=subprocess.STDOUT, env=env, start_new_session=True), log)
                print(f"{tag}: started {r.name} (pid {running[r.name][0].pid}, log {log.name})", flush=True)
            time.sleep(0.1)
            for name, (proc, log) in list(running.items()):
                if proc.poll() is not None:
                    log.close()
                    codes[name] = proc.returncode
                    del running[name]
                    failed = f"FAILED (exit {proc.returncode}), see {log.name}"
                    print(f"{tag}: {name} {'finished' if proc.returncode == 0 else failed}", flush=True)
    except KeyboardInterrupt:        # the runs save their checkpoints in `finally`, before this reaches run_main
        raise Interrupted(f"{tag}: stopped; the runs in progress ({', '.join(running) or 'none'}) save a checkpoint "
                          f"after their current step: the same command resumes the sweep") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc, _ in running.values():
            proc.send_signal(signal.SIGINT)
        for proc, log in running.values():
            proc.wait()
            log.close()
    return codes


# -----------------------------------------------------------------------------
# statistics over seeds, and the seed-band plot

T_CRIT_95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)  # Student t, two-sided 5 %, df 1..9


def t_critical(df):
    """Student t's two-sided 5 % critical value for df degrees of freedom: the table up to 9, then the
    Cornish-Fisher expansion around the normal's 1.96 (within 1e-3 of the exact value from df = 10); NaN below 1."""
    if df < 1:
        return float('nan')
    if df <= len(T_CRIT_95):
        return T_CRIT_95[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def mean_std(xs):
    """(mean, sample standard deviation); the std is NaN for a single value."""
    xs = np.asarray(xs, dtype=np.float64)
    return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else float('nan')


def paired_difference(diffs):
    """Mean and std of per-seed differences, with a paired t-test at 5 % (exceeds_spread: |t| > critical)."""
    m, sd = mean_std(diffs)
    t = m / (sd / math.sqrt(len(diffs))) if len(diffs) > 1 and sd > 0 else float('nan')
    crit = t_critical(len(diffs) - 1)
    return dict(diffs=list(diffs), mean=m, std=sd, t=t, t_crit=crit,
                exceeds_spread=bool(abs(t) > crit) if math.isfinite(t) else None)


def pm(ms, digits=4, scale=1.0):
    """'mean ± std' of a (mean, std) pair, times scale; the mean alone when the std is NaN (one seed)."""
    m, s = ms
    return f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}" if math.isfinite(s) else f"{scale * m:.{digits}f}"


def paired_rows(paired, a, header, digits=4, scale=1.0):
    """Markdown rows of paired differences {b: paired_difference(...)}: 'a − b', per seed, mean ± std, paired t."""
    if not paired:
        return []
    rows = [f'| {header} | per seed | mean ± std | paired t (5 % critical) | exceeds the seed spread |',
            '| --- | --- | --- | --- | --- |']
    for b, p in paired.items():
        verdict = 'n/a (1 seed)' if p['exceeds_spread'] is None else ('yes' if p['exceeds_spread'] else 'no')
        t = f"{p['t']:.2f} ({p['t_crit']:.2f})" if math.isfinite(p['t']) else 'n/a'
        rows.append(f"| {a} − {b} | {', '.join(f'{scale * d:+.{digits}f}' for d in p['diffs'])} | "
                    f"{pm((p['mean'], p['std']), digits, scale)} | {t} | {verdict} |")
    return rows


def plot_seed_bands(path, histories, xkeys, xlabels, ykey, ylabel, title, scale=1.0, hline=None):
    """Two panels, y against xkeys[0] and xkeys[1]: per variant (histories: {variant: [one history per seed, a
    list of dicts]}) the mean over seeds with a ± 1 std band; hline = (y, label) draws a reference."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for v, hs in histories.items():
        n = min(len(h) for h in hs)                                             # seeds of a variant share steps
        y = scale * np.array([[p[ykey] for p in h[:n]] for h in hs])            # (seeds, evals)
        m, s = y.mean(0), y.std(0, ddof=1) if len(hs) > 1 else np.zeros(n)
        for ax, key in zip(axes, xkeys):
            x = np.array([[p[key] for p in h[:n]] for h in hs]).mean(0)
            line, = ax.plot(x, m, '-', lw=1.5, label=f"{v} ({len(hs)} seed{'s' if len(hs) > 1 else ''})")
            ax.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.2)
    for ax, xlabel in zip(axes, xlabels):
        if hline:
            ax.axhline(hline[0], color='gray', ls=':', lw=1, label=hline[1])
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
