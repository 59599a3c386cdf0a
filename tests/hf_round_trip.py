"""What an HF checkpoint must satisfy, for every family that converts: its
parameter count and logits, a MoE's training loss with its aux term, greedy
tokens equal to transformers' generate; on export the tensors transformers
wrote, export -> import -> export bit-identical file by file (shards and
index), and transformers reading the export back to the same logits. Shared
by tests/test_hf_*.py."""

import filecmp
import os

import jax
import jax.numpy as jnp
import numpy as np

from triax.convert import hf_checkpoint, safetensors_files
from triax.model import generation
from triax.training import workdir as workdir_lib


def random_model(cls, cfg, sharpened=()):
  """transformers' `cls` of `cfg` with seeded random weights, fp32, in eval
  mode; norms (which start at ones) and biases (at zeros) moved so that they
  matter, and the weights named ending in one of `sharpened` (routers, gates)
  times 20, so that their choices are not near-uniform."""
  import torch

  torch.manual_seed(0)
  model = cls(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name or name.endswith('bias'):
        p.add_(0.1 * torch.randn_like(p))
      if name.endswith(tuple(sharpened)):
        p.mul_(20.0)
  return model


def import_sharded(model, base):
  """(hf_dir, workdir, import result): `model` saved by transformers in shards
  of at most 100 kB (the index path, as large checkpoints are stored) under
  `base`, then imported."""
  hf_dir = str(base / 'hf')
  model.save_pretrained(hf_dir, max_shard_size='100KB')
  assert os.path.isfile(os.path.join(hf_dir, safetensors_files.INDEX_FILE))
  workdir = str(base / 'w')
  return hf_dir, workdir, hf_checkpoint.import_hf(hf_dir, workdir)


def imported(model, tmp_path_factory):
  """A module fixture's (model, hf_dir, workdir, import result): `model`
  saved sharded by transformers and imported by triax."""
  hf_dir, workdir, result = import_sharded(model, tmp_path_factory.mktemp('hf'))
  return model, hf_dir, workdir, result


def tokens(length: int, batch: int = 2, seed: int = 0) -> np.ndarray:
  """Random token ids [batch, length] below 256, which every test vocabulary holds."""
  return np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)


def check_logits(model, workdir, result, tokens):
  """The import (`result`) holds the model's parameters and gives its logits to 1e-4."""
  import torch

  # Persistent buffers are weights too (DeepSeek-V3's expert biases are our parameters).
  state = model.state_dict()
  buffers = sum(b.numel() for name, b in model.named_buffers() if name in state)
  assert result['params'] == sum(p.numel() for p in model.parameters()) + buffers
  _, params = workdir_lib.restore_params(workdir, result['config'])
  ours = generation.sampling_model(result['config']).logits(params, jnp.asarray(tokens))
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  err = np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs))
  assert err <= 1e-4, err


def _restored(workdir, tokens, data, tensor, pipe=1, overrides=None):
  """(trainer, its state restored from the import at `workdir`, the batch of
  `tokens` [4, s + 1] on its devices, inputs, targets) on that layout, m = 4 / data,
  with `overrides` ({dotted key: value}: a schedule) set."""
  import harness

  from triax import config as config_lib
  from triax.training import checkpoint as ckpt_lib

  cfg = config_lib.load_json(os.path.join(workdir, 'config.json'))
  cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe = data, tensor, pipe
  if pipe > 1:
    cfg.pipeline.microbatches = 4 // data
  cfg.train.global_batch_size = 4
  for key, value in (overrides or {}).items():
    config_lib.set_dotted(cfg, key, value)
  trainer = harness.make_trainer(config_lib.validate(cfg, 8))
  state = ckpt_lib.Checkpointer(workdir, trainer.cfg).restore(trainer)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  batch = jax.device_put({'inputs': inputs, 'targets': targets}, trainer.batch_sharding)
  return trainer, state, batch, inputs, targets


def _cross_entropy(logits, targets) -> float:
  import torch

  vocab = logits.shape[-1]
  return torch.nn.functional.cross_entropy(
    logits.reshape(-1, vocab), torch.from_numpy(targets).long().ravel()
  )


def check_eval_loss(model, workdir, tokens, data, tensor, pipe):
  """The import's loss on (data, tensor, pipe) is transformers' cross-entropy
  (to 1e-5); `tokens` [4, s + 1]."""
  import torch

  trainer, state, batch, inputs, targets = _restored(workdir, tokens, data, tensor, pipe)
  with jax.set_mesh(trainer.mesh):
    ours = float(trainer.eval_loss(state.params, batch))
  with torch.no_grad():
    theirs = float(_cross_entropy(model(torch.from_numpy(inputs).long()).logits, targets))
  assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)


def check_loss_and_grad(model, workdir, tokens, layout, skip=(), overrides=None):
  """The import's training loss and gradients on layout (data, tensor, pipe)
  are transformers' cross-entropy and its gradients (to 1e-5 of the loss and
  of each tensor's largest gradient), compared in HF's names (the converter's
  params_to_hf of our gradients); names ending in one of `skip` are not
  compared. `tokens` [4, s + 1]; the model's objective must be the
  cross-entropy alone. `overrides`: `_restored`'s."""
  import torch

  from triax.convert import hf_checkpoint

  trainer, state, batch, inputs, targets = _restored(workdir, tokens, *layout, overrides)
  with jax.set_mesh(trainer.mesh):
    ours, grads, _ = trainer.loss_and_grad(state.params, batch)
  model.zero_grad()
  loss = _cross_entropy(model(torch.from_numpy(inputs).long()).logits, targets)
  loss.backward()
  theirs = float(loss.detach())
  assert abs(float(ours) - theirs) <= 1e-5 * theirs, (float(ours), theirs)
  m = trainer.cfg.model
  converter = hf_checkpoint._for_family(m.family, workdir)
  hf = converter.hf_config(m, _hf_config(workdir))
  grads = trainer.layout.tree_to_model_order(jax.device_get(grads))
  ours = converter.params_to_hf(jax.tree.map(np.asarray, grads), m, hf)
  # In the names transformers writes (its experts are fused in memory, per expert on disk).
  from transformers.core_model_loading import revert_weight_conversion

  grads = revert_weight_conversion(model, {n: p.grad for n, p in model.named_parameters()})
  compared = [name for name in grads if not name.endswith(tuple(skip))]
  assert compared and set(compared) <= set(ours)
  for name in compared:
    g = grads[name].numpy()
    err = np.max(np.abs(ours[name] - g)) / np.max(np.abs(g))
    assert err <= 1e-5, (name, err)


def _hf_config(workdir):
  import json

  with open(workdir_lib.path(workdir, workdir_lib.HF_CONFIG)) as f:
    return json.load(f)


def check_moe_objective(model, workdir, tokens, coef):
  """A MoE import's training loss on data x tensor = 2 x 4 is transformers'
  with output_router_logits: cross-entropy + coef x its aux loss over all
  layers (to 1e-5); `tokens` [4, s + 1]."""
  import torch

  trainer, state, batch, inputs, targets = _restored(workdir, tokens, 2, 4)
  with jax.set_mesh(trainer.mesh):
    ours, _, _ = trainer.loss_and_grad(state.params, batch)
  with torch.no_grad():
    out = model(torch.from_numpy(inputs).long(), output_router_logits=True)
    theirs = float(_cross_entropy(out.logits, targets) + coef * out.aux_loss)
  assert float(out.aux_loss) > 2.0  # sharpened routers: unbalanced, the term is not constant
  assert abs(float(ours) - theirs) <= 1e-5 * abs(theirs), (float(ours), theirs)


def check_greedy(model, workdir, cfg):
  """triax's greedy tokens from the imported checkpoint equal transformers'."""
  import torch

  _, params = workdir_lib.restore_params(workdir, cfg)
  prompt = [5, 17, 200, 33]
  ours = generation.generate(
    generation.sampling_model(cfg),
    params,
    prompt,
    generation.Sampling(max_new_tokens=12, temperature=0.0),
  )
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
    )[0, len(prompt) :].numpy()
  assert ours.tolist() == theirs.tolist()


def check_export(imported, tmp_path, reader, tokens, holds):
  """`imported` (model, hf_dir, workdir, import result) exported as `reader`'s
  architecture, holding what transformers wrote to hf_dir (among it the
  tensor `holds`), as `check` asks."""
  model, hf_dir, workdir, _ = imported
  first = str(tmp_path / 'first')
  exported = hf_checkpoint.export_hf(workdir, first, max_shard_bytes=100_000)
  assert exported['architecture'] == reader.__name__
  reference = safetensors_files.read_tensors(hf_dir)
  assert holds in reference
  check(first, reference, tmp_path, model, reader, tokens)


def check(first, reference, tmp_path, model, reader, tokens):
  """`first`: an export; `reference`: {name: array} it must hold; `model`:
  the transformers model; `reader`: its class (from_pretrained)."""
  import torch

  tensors = safetensors_files.read_tensors(first)
  assert set(tensors) == set(reference)
  for name, array in reference.items():
    np.testing.assert_array_equal(tensors[name], array, err_msg=name)
  again = str(tmp_path / 'w2')
  hf_checkpoint.import_hf(first, again)
  second = str(tmp_path / 'second')
  hf_checkpoint.export_hf(again, second, max_shard_bytes=100_000)
  names = sorted(os.listdir(first))
  assert names == sorted(os.listdir(second)) and len(names) > 2  # shards and the index
  _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
  assert (mismatch, errors) == ([], []), (mismatch, errors)
  back = reader.from_pretrained(first).eval()  # transformers reads the export back
  with torch.no_grad():
    x = torch.from_numpy(tokens).long()
    np.testing.assert_array_equal(back(x).logits.numpy(), model(x).logits.numpy())
