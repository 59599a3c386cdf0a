"""Checkpoints that move between parallel layouts and survive crashes.

The train state is written in model layer order ([L, ...] stacks) with
orbax, next to a small JSON record of the model shape, so a checkpoint
written under one (data, tensor, pipe, v, schedule) restores under any
other valid one for the same model. The data stream needs nothing beyond
the step: batches are a pure function of it.

What makes a step directory a checkpoint:
* orbax writes a step into a temporary directory and renames it when every
  process has finished; just before the rename, process 0 adds
  `triax_manifest.json`, the size and CRC-32 of every file. A checkpoint is
  *intact* when each file of its manifest is there with that size, so an
  unfinished save, a truncated file or a deleted one is detected without
  reading data (retention and `latest_step` ask only this); restore also
  checks the checksums of the step it reads, so flipped bytes are caught.
  `restore_params` (what `triax sample` and `convert --export` read, through
  workdir.restore_params) chooses and checks its step the same way.
* A step directory without a manifest is a save that never finished (the
  manifest commits with orbax's rename): restore passes over it by itself.
  A step whose files do not match its manifest, or that does not read back,
  is damage: restore stops with one error naming the file and the step,
  unless `restore_fallback` (`triax train --restore_fallback`) lets it take
  the newest intact step instead. Steps passed over are named in one warning
  and moved to DIR/checkpoints_damaged/ before training writes again (orbax
  refuses to save over a step).
* A bad-step rollback (training/bad_steps.py) moves the steps from its first
  bad one on to DIR/checkpoints_rolled_back/ and restores the one before.
* Retention is ours, not orbax's `max_to_keep` (which picks what to delete
  counting the save in flight as kept, deletes even when that save's final
  error check failed, and would count a damaged step as kept): older
  checkpoints are deleted only once `keep` newer ones are complete and
  intact, so the last good checkpoint always survives. Intact checkpoints of
  steps that are multiples of `checkpoint.keep_every_steps` are milestones:
  retention never deletes them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from triax.errors import ConfigError
from triax.model import registry
from triax.training import blockwise
from triax.training import optimizer as optimizer_lib
from triax.training import workdir as workdir_lib
from triax.training.step import Trainer, TrainState

# orbax's name for a step being written (`8.orbax-checkpoint-tmp-<time>`).
_UNFINISHED = re.compile(r'^(\d+)\.orbax-checkpoint-tmp')


def model_record(cfg) -> dict:
  """What must match between a checkpoint and the run restoring it (besides the state's tree):
  the model family and the keys its parameter shapes depend on."""
  return registry.shape_record(cfg.model)


def fp8_history(cfg) -> int:
  """The length of the model.fp8=delayed histories a run's state holds (0: none).
  A checkpoint records it; one of another length restores with fresh histories."""
  return cfg.model.fp8_amax_history if cfg.model.fp8 == 'delayed' else 0


def state_paths(trainer: Trainer) -> list[str]:
  """The key paths of the canonical train state, but for model.fp8=delayed's histories
  (`fp8_history` decides those): optimizer settings (clipping, say) change them."""
  leaves = jax.tree_util.tree_flatten_with_path(trainer.abstract_canonical_state())[0]
  paths = [jax.tree_util.keystr(path) for path, _ in leaves]
  return [p for p in paths if not p.startswith('.fp8')]


def _step_of(name: str) -> int | None:
  return int(name) if name.isdigit() else None


def crc32(path: str) -> int:
  """The CRC-32 of a file, read in 4 MiB blocks (zlib's: about a GB/s per core)."""
  value = 0
  with open(path, 'rb') as f:
    while block := f.read(1 << 22):
      value = zlib.crc32(block, value)
  return value


# The item of a step that holds the train state (orbax's Composite names it).
_STATE = 'state'


class ParamsReader(NamedTuple):
  """A checkpoint's params, read in parts (Checkpointer.params_reader chose and checked its step).

  `read(target)` restores any part of them: `target` a tree like a sub-tree
  of theirs (the keys down to the leaves wanted) of `jax.ShapeDtypeStruct`s,
  restored into their shardings, or, for one without a sharding, as numpy
  on the host (no device holds it). `blocks(path, block_ndim)` yields leaf
  `path`'s (index, block) over its first `block_ndim` axes, read a stored
  chunk's slab at a time (blockwise.read_blocks: one layer of an imported
  checkpoint's stacked leaf, the whole leaf where it is stored whole).
  """

  step: int
  read: Callable[[Any], Any]
  blocks: Callable[[tuple[str, ...], int], Iterator[tuple[tuple[int, ...], Any]]]


def _restore_args(target):
  """How orbax restores a leaf: into its sharding, or as numpy on the host without one."""
  if getattr(target, 'sharding', None) is None:
    return ocp.RestoreArgs(restore_type=np.ndarray)
  return ocp.ArrayRestoreArgs(sharding=target.sharding)


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return f'{type(error).__name__}: {text.splitlines()[0][:200] if text else ""}'.rstrip(': ')


class Checkpointer:
  """Saves and restores the train state of one workdir.

  Construction and `restore` only read; the first `save` (or `prepare_to_write`)
  starts writing. Call `restore` first: it decides which newer, damaged
  steps must be moved aside.
  """

  def __init__(
    self, workdir: str, cfg, *, restore_fallback: bool = False, reset_optimizer: bool = False
  ):
    """Checks that DIR/checkpoints, if present, holds only triax checkpoints.

    `restore_fallback`: restore passes over damaged steps to the newest intact
    one instead of raising. `reset_optimizer`: the first restore reads the
    step, parameters and data position only, and the optimizer's state starts
    afresh (train.optimizer may then differ from the checkpoint's).

    Raises:
      ConfigError: the path is a file or holds something else.
    """
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, workdir_lib.CHECKPOINTS)
    self.cfg = cfg
    self.keep = cfg.checkpoint.keep
    self.keep_every = cfg.checkpoint.keep_every_steps
    self.restore_fallback = restore_fallback
    self.reset_optimizer = reset_optimizer
    self.restored_step: int | None = None
    self.restored_progress: dict = {}
    self.damaged: list[tuple[int, str]] = []  # newer than the restored step
    self._manager = None
    self._deferred = False  # whether the manager saves Deferred leaves (save_canonical)
    self._saving_step: int | None = None
    self._state_paths: list[str] | None = None
    self._check_directory()

  @property
  def _main(self) -> bool:
    return jax.process_index() == 0

  def _check_directory(self) -> None:
    if not os.path.exists(self.directory):
      return
    fix = 'choose another --workdir, or move it away to start afresh'
    if not os.path.isdir(self.directory):
      raise ConfigError('--workdir', f'{self.directory} exists and is not a directory; {fix}')
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name)
      if (_step_of(name) is not None or _UNFINISHED.match(name)) and os.path.isdir(path):
        continue
      raise ConfigError(
        '--workdir', f'{path} is not a triax checkpoint, so this is not a triax workdir; {fix}'
      )

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def steps(self) -> list[int]:
    """Step directories on disk, intact or not, ascending."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(
      s
      for s in map(_step_of, os.listdir(self.directory))
      if s is not None and os.path.isdir(self._step_dir(s))
    )

  def verify(self, step: int, *, checksums: bool = False) -> str | None:
    """None if checkpoint `step` is intact, else what is wrong with it.

    Sizes only (no data read) unless `checksums`, which reads every file.
    """
    path = self._step_dir(step)
    try:
      with open(os.path.join(path, workdir_lib.MANIFEST)) as f:
        files = json.load(f)['files']
    except FileNotFoundError:
      return f'{workdir_lib.MANIFEST} is missing (an unfinished save, or not a triax checkpoint)'
    except (OSError, ValueError, KeyError, TypeError) as e:
      return f'{workdir_lib.MANIFEST} is unreadable ({_first_line(e)})'
    for rel, entry in sorted(files.items()):
      # A manifest written before checksums holds the size alone.
      size, crc = (entry, None) if isinstance(entry, int) else (entry['bytes'], entry['crc32'])
      try:
        actual = os.path.getsize(os.path.join(path, rel))
      except OSError:
        return f'{rel} is missing'
      if actual != size:
        return f'{rel} has {actual} bytes, the manifest says {size}'
      if checksums and crc is not None and crc32(os.path.join(path, rel)) != crc:
        return f'{rel} does not match its checksum (its bytes changed after the save)'
    return None

  def _unfinished(self, step: int) -> bool:
    return not os.path.exists(os.path.join(self._step_dir(step), workdir_lib.MANIFEST))

  def latest_step(self) -> int | None:
    """The newest intact checkpoint's step (None if there is none)."""
    intact = [s for s in self.steps() if self.verify(s) is None]
    return intact[-1] if intact else None

  def finished_step(self, trainer: Trainer, steps: int) -> int | None:
    """The newest intact checkpoint's step if it is at `steps` or past it (its
    model checked, no array read or converted), else None.

    Raises:
      ConfigError: that checkpoint is of another model.
    """
    step = self.latest_step()
    if step is None or step < steps:
      return None
    try:
      record = self._read(step, model=ocp.args.JsonRestore())['model']
    except Exception:  # pylint: disable=broad-except  # restore() reports what is damaged
      return None
    self._check_model(step, record, trainer)
    return step

  def restore(self, trainer: Trainer, *, before: int | None = None) -> TrainState | None:
    """The newest intact checkpoint's state (of a step below `before`, when given), or
    None when there is none yet.

    Its files are checked against their checksums first. A newer step that
    never finished saving is passed over; a newer damaged one too with
    restore_fallback. Steps passed over are named in one warning and moved
    aside by the first save.

    Raises:
      ConfigError: a damaged step (without restore_fallback), no intact step,
        a checkpoint of another model, or of another train.optimizer (without
        reset_optimizer).
    """
    reset, self.reset_optimizer = self.reset_optimizer, False  # a rollback restores whole
    read = self._read_params_afresh if reset else self._read_state
    found = self._restore_newest(
      lambda step: read(step, trainer),
      before=before,
      fix='rerun with --restore_fallback to resume from the newest intact step before it',
    )
    if found is None:
      return None
    self._warn_passed(found[0])
    return trainer.from_canonical(found[1])

  def restore_params(self, target) -> tuple[int, object] | None:
    """The newest intact checkpoint's step and params, or None when there is none yet.

    `target` is the params' tree of `jax.ShapeDtypeStruct`s with shardings:
    where each array goes. The step is chosen and checked by `params_reader`.

    Raises:
      ConfigError: a damaged newest step, no intact step, or a checkpoint of
        another model.
    """
    found = self.params_reader()
    return None if found is None else (found.step, found.read(target))

  def params_reader(self) -> ParamsReader | None:
    """The newest intact checkpoint's `ParamsReader`, or None when there is none yet.

    The step is chosen and checked as `restore` chooses and checks it: every
    file of the step against its checksum, then the model record (not the
    optimizer state's structure, which the params do not depend on). The
    checksums cover the optimizer state's files too, although only params
    are read: orbax's OCDBT store packs the params' chunks and the moments'
    into the same data files, and which chunk is where is known only from
    their index, itself kept in those files, so no subset of the files is
    known to hold the params alone. The price is reading the moments' bytes
    once more, at crc32's speed.

    Raises:
      ConfigError: a damaged newest step, no intact step, or a checkpoint of
        another model (and, from `read`, a step that does not read back).
    """
    damaged = os.path.join(self.workdir, workdir_lib.DAMAGED)
    fix = f'move that step to {damaged}/ to read the newest intact one before it'
    found = self._restore_newest(self._read_record, fix=fix)
    if found is None:
      return None
    step = found[0]

    def read(target):
      value, reason = self._read_params(step, target)
      if reason is not None:
        raise ConfigError(
          '--workdir', f'checkpoint {step} is damaged: {self._step_dir(step)}/{reason}; {fix}'
        )
      return value

    def blocks(path, block_ndim):
      item = os.path.join(self._step_dir(step), _STATE)
      return blockwise.read_blocks(item, ('params', *path), block_ndim)

    return ParamsReader(step, read, blocks)

  def _restore_newest(self, read, *, before: int | None = None, fix: str):
    """(step, what `read(step)` gives) of the newest intact step below `before`, or
    None when there is no step; `fix` is what a damaged step's error advises.

    `read(step)` gives (value, None), or (None, why) when the step does not read.
    """
    steps = [s for s in self.steps() if before is None or s < before]
    if not steps:
      return None
    passed = []
    for step in reversed(steps):
      reason = self.verify(step, checksums=True)
      if reason is None:
        value, reason = read(step)
      if reason is None:
        self.restored_step, self.damaged = step, passed
        logging.info('restored step %d from %s', step, self.directory)
        return step, value
      if not (self.restore_fallback or self._unfinished(step)):
        raise ConfigError(
          '--workdir', f'checkpoint {step} is damaged: {self._step_dir(step)}/{reason}; {fix}'
        )
      passed.append((step, reason))
    found = '; '.join(f'{s}: {r}' for s, r in passed)
    raise ConfigError(
      '--workdir',
      f'{self.directory} holds no intact checkpoint ({found}); '
      'move it away to start afresh, or choose another --workdir',
    )

  def _read_state(self, step: int, trainer: Trainer) -> tuple[object, str | None]:
    """Checkpoint `step`'s canonical state and progress (None and why when it does not read)."""
    try:
      items = self._read(step, model=ocp.args.JsonRestore(), progress=ocp.args.JsonRestore())
    except Exception as e:  # pylint: disable=broad-except  # anything unreadable is damage
      return None, f'unreadable ({_first_line(e)})'
    self._check_model(step, items['model'], trainer)
    saved = items['model'].get('fp8_history', 0)
    if saved != fp8_history(self.cfg):
      return self._read_without_histories(step, trainer, saved, items['progress'])
    try:
      state = self._read(step, state=ocp.args.StandardRestore(trainer.abstract_canonical_state()))
    except Exception as e:  # pylint: disable=broad-except
      return None, f'unreadable ({_first_line(e)})'
    self.restored_progress = items['progress']
    return state['state'], None

  def _read_without_histories(self, step: int, trainer: Trainer, saved: int, progress: dict):
    """Checkpoint `step`'s canonical state, its model.fp8=delayed histories
    (`saved` long; 0: none) left on disk: the run's own start empty, as
    before a first step (its scales current), or there are none (another
    recipe). A fine-tune of an import, or a switch of recipe, so resumes."""
    abstract = trainer.abstract_canonical_state()
    target = {'step': abstract.step, 'params': abstract.params, 'opt_state': abstract.opt_state}
    read, error = self._read_part(step, target)
    if error:
      return None, error
    self.restored_progress = progress
    return TrainState(**read, fp8=self._fresh_histories(step, abstract, saved)), None

  def _read_part(self, step: int, target: dict) -> tuple[dict | None, str | None]:
    """(checkpoint `step`'s state leaves that `target` (abstract arrays, laid
    out as wanted) names, None), or (None, why it is unreadable)."""
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
    restore = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    try:
      return self._read(step, state=restore)['state'], None
    except Exception as e:  # pylint: disable=broad-except  # anything unreadable is damage
      return None, f'unreadable ({_first_line(e)})'

  def _fresh_histories(self, step: int, abstract: TrainState, saved: int):
    """Empty model.fp8=delayed histories in the checkpoint's layout (None
    without delayed), said in a warning: checkpoint `step` holds none of
    this run's length (`saved`)."""
    if abstract.fp8 is None:
      return None
    if self._main:
      logging.warning(
        'checkpoint %d holds %s; model.fp8=delayed starts its amax histories empty',
        step,
        f'histories {saved} steps long' if saved else 'no amax histories',
      )
    shardings = jax.tree.map(lambda s: s.sharding, abstract.fp8)
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract.fp8)  # noqa: E731
    return jax.jit(zeros, out_shardings=shardings)()

  def _read_params_afresh(self, step: int, trainer: Trainer) -> tuple[object, str | None]:
    """Checkpoint `step`'s canonical state with its step, params and progress
    read and the optimizer state made afresh (--reset_optimizer): new
    moments, the learning-rate schedule where the run is."""
    try:
      items = self._read(step, model=ocp.args.JsonRestore(), progress=ocp.args.JsonRestore())
    except Exception as e:  # pylint: disable=broad-except  # anything unreadable is damage
      return None, f'unreadable ({_first_line(e)})'
    self._check_model(step, items['model'])
    abstract = trainer.abstract_canonical_state()
    target = {'step': abstract.step, 'params': abstract.params}
    # model.fp8=delayed's histories are no optimizer state: read as they are, where they are.
    saved = items['model'].get('fp8_history', 0)
    same_histories = abstract.fp8 is not None and saved == fp8_history(self.cfg)
    if same_histories:
      target['fp8'] = abstract.fp8
    read, error = self._read_part(step, target)
    if error:
      return None, error
    fresh = jax.jit(
      lambda params, at: optimizer_lib.at_step(trainer.optimizer.init(params), at),
      out_shardings=trainer.canonical_shardings.opt_state,
    )
    opt_state = fresh(read['params'], read['step'])
    self.restored_progress = items['progress']
    fp8 = read['fp8'] if same_histories else self._fresh_histories(step, abstract, saved)
    return TrainState(step=read['step'], params=read['params'], opt_state=opt_state, fp8=fp8), None

  def _read_record(self, step: int) -> tuple[None, str | None]:
    """(None, None) when checkpoint `step`'s model record reads and is this
    config's model; (None, why) when it does not read.

    Raises:
      ConfigError: a record of another model.
    """
    try:
      record = self._read(step, model=ocp.args.JsonRestore())['model']
    except Exception as e:  # pylint: disable=broad-except  # anything unreadable is damage
      return None, f'unreadable ({_first_line(e)})'
    self._check_model(step, record)
    return None, None

  def _read_params(self, step: int, target) -> tuple[object, str | None]:
    """Checkpoint `step`'s params (the part `target` names), placed as `target`
    says (None and why when they do not read)."""
    restore_args = jax.tree.map(_restore_args, target)
    try:
      # The state's other items (step, optimizer state) stay on disk.
      items = self._read(
        step,
        state=ocp.args.PyTreeRestore(
          item={'params': target}, restore_args={'params': restore_args}, partial_restore=True
        ),
      )
    except Exception as e:  # pylint: disable=broad-except
      return None, f'unreadable ({_first_line(e)})'
    return items['state']['params'], None

  def _warn_passed(self, step: int) -> None:
    if self.damaged and self._main:
      named = '; '.join(f'{self._step_dir(s)} ({r})' for s, r in self.damaged)
      logging.warning(
        'damaged checkpoint %s: resuming from %s instead (the damaged one moves to %s)',
        named,
        self._step_dir(step),
        os.path.join(self.workdir, workdir_lib.DAMAGED),
      )

  def _read(self, step: int, **items) -> dict:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
      return reader.restore(self._step_dir(step), args=ocp.args.Composite(**items))

  def _check_model(self, step: int, record: dict, trainer: Trainer | None = None) -> None:
    """Raises a ConfigError unless `record` is of this config's model (and, given
    `trainer`, of its optimizer state's structure)."""
    record = {**registry.RECORD_DEFAULTS, **record}  # a record older than some of its keys
    for key, value in model_record(self.cfg).items():
      if record.get(key) != value:
        raise ConfigError(
          f'model.{key}',
          f'checkpoint {self._step_dir(step)} has {key}={record.get(key)!r} '
          f'but the config says {value!r}; use the same model or a new --workdir',
        )
    if trainer is None:
      return
    self._check_optimizer(step, record.get('optimizer', 'adamw'))
    saved, wanted = record.get('state_paths'), self._paths(trainer)
    if saved is not None and saved != wanted:
      odd = sorted(set(saved) ^ set(wanted))
      raise ConfigError(
        'train.grad_clip_norm',
        f'checkpoint {self._step_dir(step)} holds an optimizer state of another '
        f'structure (e.g. {odd[0] if odd else "leaf order"}); clipping on or off '
        'changes it: use the setting it was written with, or a new --workdir',
      )

  def _check_optimizer(self, step: int, saved: str) -> None:
    """Raises a ConfigError unless checkpoint `step`'s optimizer (`saved`;
    adamw before the record named it) is train.optimizer."""
    wanted = self.cfg.train.optimizer
    if saved != wanted:
      raise ConfigError(
        'train.optimizer',
        f'checkpoint {self._step_dir(step)} holds the state of {saved}, not {wanted}; '
        f'resume with train.optimizer={saved}, or add --reset_optimizer to keep its '
        f'parameters and start {wanted} afresh',
      )

  def _paths(self, trainer: Trainer) -> list[str]:
    if self._state_paths is None:
      self._state_paths = state_paths(trainer)
    return self._state_paths

  def prepare_to_write(self, *, deferred: bool = False) -> None:
    """Moves damaged newer steps aside and opens orbax (which removes unfinished
    saves); `deferred`: for `save_canonical` (its state's leaves may be `blockwise.Deferred`)."""
    if self._manager is not None:
      return
    self._sync('triax_checkpoint_restored')  # every process has read what it needs
    if self._main:
      os.makedirs(self.directory, exist_ok=True)
      self._move_aside([step for step, _ in self.damaged], workdir_lib.DAMAGED)
    self._sync('triax_checkpoint_prepare')
    options = ocp.CheckpointManagerOptions(
      max_to_keep=None,
      create=True,
      enable_async_checkpointing=True,
      cleanup_tmp_directories=True,
      async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
    )
    handlers = None
    if deferred:
      state = ocp.PyTreeCheckpointHandler(type_handler_registry=blockwise.handler_registry())
      json_handler = ocp.JsonCheckpointHandler
      handlers = {'state': state, 'model': json_handler(), 'progress': json_handler()}
    self._deferred = deferred
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def _move_aside(self, steps: list[int], folder: str) -> None:
    """Moves step directories to DIR/folder/STEP (STEP-1, ... when that exists)."""
    for step in steps:
      target = os.path.join(self.workdir, folder, str(step))
      suffix = 0
      while os.path.exists(target + (f'-{suffix}' if suffix else '')):
        suffix += 1
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.replace(self._step_dir(step), target + (f'-{suffix}' if suffix else ''))

  def roll_back(self, trainer: Trainer, first_bad: int) -> TrainState | None:
    """The newest intact state before step `first_bad` (None: none, start afresh).

    Waits for a save in flight, then moves the steps from `first_bad` on to
    DIR/checkpoints_rolled_back/ (their states hold the bad steps, and the run
    will save those steps again).
    """
    self.close()
    self._sync('triax_checkpoint_roll_back')
    if self._main:
      self._move_aside([s for s in self.steps() if s >= first_bad], workdir_lib.ROLLED_BACK)
    self._sync('triax_checkpoint_rolled_back')
    self.restored_progress, self.damaged = {}, []  # those were moved by the first save
    state = self.restore(trainer, before=first_bad)
    self.prepare_to_write()
    return state

  def save(self, trainer: Trainer, state: TrainState, *, progress: dict | None = None) -> None:
    """Starts an asynchronous save of `state` (after the previous one has finished).

    `progress` is a small JSON record restored with the state (`restored_progress`).
    """
    self._before_save(deferred=False)
    step = int(jax.device_get(state.step))
    canonical = trainer.to_canonical(state)
    self._save(step, ocp.args.StandardSave(canonical), trainer, progress)

  def save_canonical(
    self, trainer: Trainer, step: int, canonical, *, progress: dict | None = None
  ) -> None:
    """Starts saving `canonical`, a train state in the checkpoint's layout (the
    tree of `trainer.abstract_canonical_state()`), as checkpoint `step`. Its
    leaves may be `blockwise.Deferred`s, made block by block as they are
    written, so that the state is never whole in memory (how `triax convert`
    imports). A Checkpointer saves either this way or by `save`, not both
    (orbax's handler of the state differs).
    """
    self._before_save(deferred=True)
    self._save(step, ocp.args.PyTreeSave(canonical), trainer, progress)

  def _before_save(self, *, deferred: bool) -> None:
    """Opens orbax (for `deferred` leaves or not), waits for the save in flight, applies retention."""
    if self._manager is not None and self._deferred != deferred:
      raise RuntimeError('a Checkpointer saves with save() or with save_canonical(), not both')
    self.prepare_to_write(deferred=deferred)
    self._manager.wait_until_finished()
    self._prune()

  def _save(self, step: int, state_args, trainer: Trainer, progress: dict | None) -> None:
    self._saving_step = step
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=state_args,
        model=ocp.args.JsonSave(
          {
            **model_record(self.cfg),
            'fp8_history': fp8_history(self.cfg),
            'optimizer': self.cfg.train.optimizer,
            'state_paths': self._paths(trainer),
          }
        ),
        progress=ocp.args.JsonSave(progress or {}),
      ),
      force=True,
    )

  def _write_manifest(self) -> None:
    # orbax calls this on process 0 once every process has written its part,
    # just before the directory gets its final name: the manifest commits with it.
    step = self._saving_step
    unfinished = [
      os.path.join(self.directory, n)
      for n in os.listdir(self.directory)
      if (m := _UNFINISHED.match(n)) and int(m.group(1)) == step
    ]
    path = max(unfinished, key=os.path.getmtime) if unfinished else self._step_dir(step)
    files = {}
    for root, _, names in os.walk(path):
      for name in names:
        rel = os.path.relpath(os.path.join(root, name), path)
        if os.sep in rel:  # items' files; orbax rewrites its top-level files after this
          full = os.path.join(root, name)
          files[rel] = {'bytes': os.path.getsize(full), 'crc32': crc32(full)}
    if not files:
      raise RuntimeError(f'checkpoint step {step}: found no files to list under {path}')
    with open(os.path.join(path, workdir_lib.MANIFEST), 'w') as f:
      json.dump({'step': step, 'files': files}, f, indent=1, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())

  def is_milestone(self, step: int) -> bool:
    """Whether `step` is a multiple of checkpoint.keep_every_steps (kept forever once intact)."""
    return bool(self.keep_every) and step > 0 and step % self.keep_every == 0

  def _prune(self) -> None:
    """Deletes steps older than the newest `keep` intact ones, but not milestones.

    No save is in flight when this runs.
    """
    if self._main:
      steps = self.steps()
      intact = [s for s in steps if self.verify(s) is None]
      if len(intact) > self.keep:
        for step in steps:
          if step < intact[-self.keep] and not (self.is_milestone(step) and step in intact):
            shutil.rmtree(self._step_dir(step), ignore_errors=True)
    self._sync('triax_checkpoint_prune')

  def _sync(self, name: str) -> None:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(name)

  def wait(self) -> None:
    """Blocks until the last save is complete; then applies retention."""
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._prune()

  def close(self) -> None:
    if self._manager is not None:
      self.wait()
      self._manager.close()
      self._manager = None
