"""model.vocab_used: the ids past the tokenizer's (Megatron's vocabulary padding) get no
probability in the loss, no gradient into the padded rows, and are never sampled; the
data check asks for the key whenever a tokenizer has fewer ids than model.vocab_size."""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_data_sources import write_megatron

from triax import config
from triax.data import sources
from triax.data import tokenizer as tokenizer_lib
from triax.errors import ConfigError
from triax.model import generation
from triax.model import loss as loss_lib

V, USED = 256, 200


def _model(family, used, chunk=0):
  extra = {'tie_embeddings': True} if family == 'llama' else {}
  return harness.model_of(
    family=family, num_layers=1, d_model=16, num_heads=2, d_ff=32, vocab_size=V,
    vocab_used=used, seq_len=8, loss_chunk=chunk, **extra,
  )  # fmt: skip


def _params(model, seed):
  """Random parameters of the model's shapes (compiling its random init takes seconds)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype), shapes)


def _padded_rows(*trees):
  """The padded ids' gradient rows: the output layer's columns, the table's rows."""
  leaves = {k: v for tree in trees for k, v in tree.items()}
  return [
    leaves[k][:, USED:] if k == 'out' else leaves[k][USED:]
    for k in ('out', 'tokens')
    if k in leaves
  ]


@pytest.mark.parametrize('family', ['gpt', 'llama'])  # llama: tied embeddings
def test_loss_is_the_unpadded_vocabulary_loss_and_padded_rows_get_no_gradient(family):
  whole = _model(family, USED)
  head = whole.edge_params(_params(whole, 0))[1]  # the tied table is the head's too
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, USED, (4, 8)), jnp.int32)

  def reference(head):  # the cross-entropy of logits[..., :USED], written plainly
    logits = whole.head_logits(head, x)[..., :USED]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)

  grad = lambda f: jax.jit(jax.value_and_grad(f))(head)  # noqa: E731
  ref, ref_grads = grad(reference)
  for chunk in (0, 4):
    model = _model(family, USED, chunk)
    got, got_grads = grad(lambda h: model.head_loss(h, x, targets))  # noqa: B023
    assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref)), (chunk, got, ref)
    assert harness.max_rel_err(ref_grads, got_grads) <= 1e-5
    for rows in _padded_rows(got_grads):
      assert not np.any(np.asarray(rows)), f'a padded row has a gradient (chunk {chunk})'
  # Unmasked, the same rows do get one: the check above can fail.
  unmasked = _model(family, 0)
  _, plain = grad(lambda h: unmasked.head_loss(h, x, targets))
  assert all(np.any(np.asarray(rows)) for rows in _padded_rows(plain))


def test_tensor_parallel_pipeline_matches_one_device_with_no_gradient_on_padding():
  # (data, tensor, pipe) = (1, 2, 2), 1F1B over 4 micro-batches, the chunked loss in the
  # pipeline's last stage (the spec's head_loss): the vocabulary split over tensor.
  tiny = {'model.num_layers': 2, 'model.vocab_used': USED, 'model.loss_chunk': 4, 'mesh.data': 1}
  ref_loss, ref_grads = harness.loss_and_grads(harness.tiny_config(**tiny))
  layout = {'mesh.tensor': 2, 'mesh.pipe': 2, 'pipeline.schedule': '1f1b'}
  loss, grads = harness.loss_and_grads(
    harness.tiny_config(**tiny, **layout, **{'pipeline.microbatches': 4})
  )
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
  for g in (ref_grads, grads):
    for rows in _padded_rows(g['embed'], g['head']):
      assert not np.any(rows)


def test_sampling_never_returns_a_padded_id_even_where_the_padding_dominates():
  used = 224  # 32 padded ids: +-100 along each of d_model = 16 directions
  shape = dict(num_layers=1, d_model=16, num_heads=2, d_ff=32, seq_len=8, vocab_size=V)
  masked = harness.model_of(**shape, vocab_used=used)
  params = _params(masked, 3)
  directions = np.concatenate([np.eye(16), -np.eye(16)], axis=1) * 100.0
  params['head']['out'] = params['head']['out'].at[:, used:].set(directions)
  params['head']['norm'] = jnp.ones(16)
  # Without the mask every position's largest logit is a padded id: the normed state
  # (rms 1) has a component of magnitude >= 1, so one padded logit is >= 100, and
  # the used ids' are at most |h| |w| ~ 4 x 1.2.
  tokens = jnp.asarray([[100, 101, 32, 7, 7, 7, 7, 7]], jnp.int32)
  assert np.all(np.argmax(harness.model_of(**shape).logits(params, tokens), axis=-1) >= used)
  assert np.all(masked.logits(params, tokens)[..., used:] <= loss_lib.PADDING_LOGIT / 2)
  # 3 + 12 > seq_len: the K/V cache (decode), then the cache-less sliding window (logits);
  # top_k past the used ids, so the cut keeps some padded logits, still never drawn.
  sampling = generation.Sampling(max_new_tokens=12, temperature=2.0, top_k=240)
  out = generation.generate(masked, params, [100, 101, 32], sampling)
  assert np.all(out < used), out


def test_bad_vocab_used_values_name_the_key():
  for bad in (300, -1, True):
    c = config.defaults()
    c.model.vocab_used = bad
    with pytest.raises(ConfigError) as info:
      config.validate(c, 1)
    assert info.value.key == 'model.vocab_used'
  c = config.defaults()
  c.model.vocab_size, c.model.vocab_used = 512, 256
  assert config.validate(c, 1).model.vocab_used == 256


def test_a_tokenizer_smaller_than_the_vocabulary_needs_vocab_used():
  byte = tokenizer_lib.BytesTokenizer()
  tokenizer_lib.check_vocab(byte, 256, 1)  # 256 ids, no padding: 0 is right
  tokenizer_lib.check_vocab(byte, 256, 1, 256)
  tokenizer_lib.check_vocab(byte, 512, 2, 256)
  with pytest.raises(ConfigError) as info:
    tokenizer_lib.check_vocab(byte, 512, 2)
  assert info.value.key == 'model.vocab_used'
  assert info.value.message.startswith('set model.vocab_used=256 (')
  assert 'the other 256 ids of model.vocab_size=512 are padding' in info.value.message
  for wrong, want in ((300, 'set model.vocab_used=256'), (100, 'set model.vocab_used=256')):
    with pytest.raises(ConfigError) as info:
      tokenizer_lib.check_vocab(byte, 512, 2, wrong)
    assert want in info.value.message
  with pytest.raises(ConfigError) as info:  # would mask ids the tokenizer makes
    tokenizer_lib.check_vocab(byte, 256, 1, 200)
  assert 'set model.vocab_used=0' in info.value.message


def test_megatron_ids_past_vocab_used_are_refused(tmp_path):
  docs = [[1, 2, 3, 150, 0], [4, 5, 0], [6, 7, 8, 0]]
  prefix = write_megatron(str(tmp_path / 'c'), docs)
  assert sources.open_megatron(prefix, 'bytes', 256, 1, 151).train.size > 0
  with pytest.raises(ConfigError) as info:
    sources.open_megatron(prefix, 'bytes', 256, 1, 150)
  assert info.value.key == 'model.vocab_used' and 'id 150' in info.value.message


def test_a_vocabulary_too_small_names_vocab_used_only_when_it_pads():
  byte = tokenizer_lib.BytesTokenizer()
  with pytest.raises(ConfigError) as info:  # 256 is a multiple of 128: no padding to mask
    tokenizer_lib.check_vocab(byte, 200, 1)
  assert info.value.key == 'model.vocab_size'
  assert info.value.message.endswith('set model.vocab_size=256')
  with pytest.raises(ConfigError) as info:  # 256 ids over tensor=3: 384, the rest masked
    tokenizer_lib.check_vocab(byte, 200, 3)
  assert 'set model.vocab_size=384' in info.value.message
  assert info.value.message.endswith('and model.vocab_used=256')
