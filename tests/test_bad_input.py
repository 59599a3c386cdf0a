"""The catalogue of bad input: every case ends with exit status 2, one `error:` line
naming the key, flag or file (and what to do), and a workdir exactly as it was.

Cases run as processes of their own, a few at a time (a module fixture
starts the selected ones together): forked from warm servers that have
imported JAX and triax's libraries once (tests/forkserver.py), since a cold
start of each would cost most of the catalogue's time.
"""

import concurrent.futures
import json
import os
import queue
import shutil
import socket

import forkserver
import harness
import pytest

from triax.training import workdir as workdir_lib

SMOKE = 'experiments/gpt_tiny.py:smoke'
TRAIN_FLAGS = ['--cpu_devices=8', '--progress=false']
HOST = socket.gethostname()


def train(*flags, config=f'--config={SMOKE}', workdir='{d}/w', trained=False, setup=None):
  """A `python -m triax train` case; `{d}` in flags is the case's own directory."""

  def build(d, trained_dir):
    if trained:
      shutil.copytree(trained_dir, os.path.join(d, 'w'))
    if setup:
      setup(d)
    args = ([config] if config else []) + ([f'--workdir={workdir}'] if workdir else [])
    return 'triax.cli.train', [a.format(d=d) for a in args + TRAIN_FLAGS + list(flags)]

  return build


def command(module, *args, setup=None):
  def build(d, _):
    if setup:
      setup(d)
    return module, [a.format(d=d) for a in args]

  return build


def tpu(*flags, compile_only=True):
  """A `triax train --topology` case (no --cpu_devices: the slice gives the devices)."""
  extra = ('--compile_only',) if compile_only else ()
  return command('triax.cli.train', f'--config={SMOKE}', '--workdir={d}/w', *extra, *flags)


def _softcapped_gemma3(d):
  """An HF Gemma 3 directory whose config.json sets Gemma 2's final logit soft-capping."""
  os.makedirs(os.path.join(d, 'hf'))
  hf = {
    'model_type': 'gemma3_text',
    'hidden_size': 64,
    'num_attention_heads': 4,
    'num_hidden_layers': 2,
    'intermediate_size': 96,
    'vocab_size': 256,
    'final_logit_softcapping': 30.0,
  }
  with open(os.path.join(d, 'hf', 'config.json'), 'w') as f:
    json.dump(hf, f)


H100 = 'experiments/clusters/h100_8x_nvlink.yaml'


def plan_evaluate(*flags):
  """A `triax plan --evaluate` case: gpt_tiny priced on eight H100s."""
  return command(
    'triax.cli.plan',
    '--config=experiments/gpt_tiny.py',
    f'--cluster={H100}',
    '--profile=analytic',
    '--evaluate',
    *flags,
  )


def write(relpath, text):
  def setup(d):
    path = os.path.join(d, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
      f.write(text)

  return setup


def fake_checkpoint(d):
  # A step directory whose manifest is right but whose contents are not orbax's.
  step = os.path.join(d, 'w', 'checkpoints', '4')
  os.makedirs(os.path.join(step, 'state'))
  with open(os.path.join(step, 'state', 'data'), 'w') as f:
    f.write('not an array')
  with open(os.path.join(step, workdir_lib.MANIFEST), 'w') as f:
    json.dump({'step': 4, 'files': {'state/data': 12}}, f)


def prepared_tokens(relpath, tokenizer='bytes', bpe='', damage=False):
  """A directory python -m triax prepare wrote from 40 small text files, at `relpath`.

  tokenizer='bpe' prepares with a BPE trained here (its file: tok.json); `bpe` names a
  BPE tokenizer file to train beside a bytes preparation; `damage` truncates a shard.
  """

  def setup(d):
    from triax.data import prepare
    from triax.data import tokenizer as tokenizer_lib

    text = os.path.join(d, 'text')
    os.makedirs(text)
    docs = [f'document {i}: ' + 'words and more words. ' * (i % 7 + 3) for i in range(40)]
    for i, doc in enumerate(docs):
      with open(os.path.join(text, f'{i:02d}.txt'), 'w') as f:
        f.write(doc)
    tok = 'bytes'
    if tokenizer == 'bpe' or bpe:
      trained = tokenizer_lib.train_bpe(docs, 300, os.path.join(d, bpe or 'tok.json'))
      tok = trained.name if tokenizer == 'bpe' else 'bytes'
    out = os.path.join(d, relpath)
    prepare.prepare([text], out, tok, val_fraction=0.2, progress=False)
    if damage:
      with open(os.path.join(out, 'train-00000.tokens'), 'r+b') as f:
        f.truncate(99)

  return setup


CASES = [
  # id, how to run it, what the error line must name
  # -- config values
  (
    'mesh-product',
    train('--config.mesh.data=3', '--config.mesh.tensor=1', '--config.mesh.pipe=1'),
    'mesh',
  ),
  (
    'heads-vs-tensor',
    train(
      '--config.mesh.data=1',
      '--config.mesh.tensor=8',
      '--config.mesh.pipe=1',
      '--config.model.num_heads=4',
    ),
    'model.num_heads',
  ),
  ('d_ff-vs-tensor', train('--config.model.d_ff=65'), 'model.d_ff'),
  ('batch-vs-data', train('--config.train.global_batch_size=12'), 'train.global_batch_size'),
  # 8 rows over data 2 x pipe 2: 2 a device, which 3 micro-batches do not divide.
  ('eval-microbatches', train('--config.train.eval_microbatches=3'), 'train.eval_microbatches'),
  ('non-positive-layers', train('--config.model.num_layers=0'), 'model.num_layers'),
  ('non-positive-steps', train('--config.train.steps=-1'), 'train.steps'),
  ('layers-vs-chunks', train('--config.model.num_layers=6'), 'model.num_layers'),
  # m = 5 at p = 2 makes 2 rounds of 2.5 micro-batches: torch refuses it too.
  (
    'interleaved-microbatches',
    train('--config.pipeline.microbatches=5', '--config.train.global_batch_size=20'),
    'pipeline.microbatches',
  ),
  ('unknown-schedule', train('--config.pipeline.schedule=zigzag'), 'pipeline.schedule'),
  ('unknown-edge-grads', train('--config.pipeline.edge_grads=later'), 'pipeline.edge_grads'),
  # BPipe's moves balance the residual sets offloading takes off the devices.
  (
    'offload-stash-with-bpipe',
    train(
      '--config.pipeline.schedule=bpipe',
      '--config.pipeline.virtual_stages=1',
      '--config.pipeline.offload_stash=true',
    ),
    'pipeline.offload_stash',
  ),
  (
    'offload-stash-without-a-pipeline',
    train(
      '--config.mesh.pipe=1',
      '--config.mesh.data=4',
      '--config.pipeline.virtual_stages=1',
      '--config.pipeline.microbatches=1',
      '--config.pipeline.offload_stash=true',
    ),
    'pipeline.offload_stash',
  ),
  ('unknown-wandb-mode', train('--config.train.wandb_mode=cloud'), 'train.wandb_mode'),
  (
    'schedule-file-bad-cell',
    train('--config.pipeline.schedule_file={d}/bad.csv', setup=write('bad.csv', '0F0,0X1\r\n')),
    'pipeline.schedule_file',
  ),
  ('unknown-dtype', train('--config.model.dtype=float8'), 'model.dtype'),
  # A renamed policy is named with what replaced it, not just refused.
  ('renamed-remat', train('--config.model.remat=selective'), 'model.remat'),
  ('float16-without-loss-scaling', train('--config.model.dtype=float16'), 'model.dtype'),
  ('cudnn-in-float32', train('--config.model.attention=cudnn'), 'model.attention'),
  ('unknown-fp8-recipe', train('--config.model.fp8=blockwise'), 'model.fp8'),
  (
    'fp8-amax-history-zero',
    train('--config.model.fp8=delayed', '--config.model.fp8_amax_history=0'),
    'model.fp8_amax_history',
  ),
  (
    'fp8-amax-history-not-an-integer',
    train('--config.model.fp8=delayed', '--config.model.fp8_amax_history=2.5'),
    'model.fp8_amax_history',
  ),
  (
    'unknown-fp8-grad-format',
    train('--config.model.fp8=tensorwise', '--config.model.fp8_grad=e3m4'),
    'model.fp8_grad',
  ),
  # Read only under FP8: beside model.fp8=none it would be silently ignored.
  ('fp8-grad-without-fp8', train('--config.model.fp8_grad=e4m3'), 'model.fp8_grad'),
  # Read only by delayed: set beside another recipe it would be silently ignored.
  (
    'fp8-amax-history-without-delayed',
    train('--config.model.fp8=tensorwise', '--config.model.fp8_amax_history=16'),
    'model.fp8_amax_history',
  ),
  # DeepSeek's dense first blocks run outside the layer stack, which alone keeps histories.
  (
    'delayed-fp8-outside-the-layer-stack',
    train(
      '--config.model.fp8=delayed',
      '--config.mesh.pipe=1',
      '--config.pipeline.microbatches=1',
      '--config.pipeline.virtual_stages=1',
      '--config.pipeline.schedule=gpipe',
      '--config.pipeline.fuse_overlaps=false',
      '--config.mesh.data=4',
      config='--config=experiments/deepseek_tiny.py:smoke',
    ),
    'model.fp8',
  ),
  # dots's policy cannot see an FP8 matmul (a custom_vjp) to keep its output.
  (
    'fp8-under-dots-remat',
    train('--config.model.fp8=tensorwise', '--config.model.remat=dots'),
    'model.fp8',
  ),
  (
    'rowwise-fp8-under-dots-remat',
    train('--config.model.fp8=rowwise', '--config.model.remat=dots'),
    'model.fp8',
  ),
  # Nothing to report: no matmul is FP8.
  ('fp8-metrics-without-fp8', train('--config.model.fp8_metrics=true'), 'model.fp8_metrics'),
  # The smoke config pipelines, and the pipeline executor does not carry the figures.
  (
    'fp8-metrics-under-a-pipeline',
    train('--config.model.fp8=rowwise', '--config.model.fp8_metrics=true'),
    'model.fp8_metrics',
  ),
  ('unknown-family', train('--config.model.family=mamba'), 'model.family'),
  ('loss-chunk-not-dividing', train('--config.model.loss_chunk=5'), 'model.loss_chunk'),
  ('vocab-used-beyond-vocab', train('--config.model.vocab_used=300'), 'model.vocab_used'),
  # Padding past the bytes' 256 ids must be said (model.vocab_used=256), never silent.
  ('bytes-padding-unsaid', train('--config.model.vocab_size=512'), 'model.vocab_used'),
  # A key the family does not read would be silently ignored.
  ('gpt-with-kv-heads', train('--config.model.num_kv_heads=2'), 'model.num_kv_heads'),
  ('gpt-with-rope-scaling', train('--config.model.rope_scaling.factor=8.0'), 'model.rope_scaling'),
  (
    'kv-heads-not-dividing-heads',
    train('--config.model.family=llama', '--config.model.num_kv_heads=3'),
    'model.num_kv_heads',
  ),
  ('gpt-with-experts', train('--config.model.num_experts=4'), 'model.num_experts'),
  # A window reaching over the whole sequence is a global layer, said so.
  (
    'window-as-long-as-the-sequence',
    train('--config.model.family=llama', '--config.model.sliding_window=1000000'),
    'model.sliding_window',
  ),
  (
    'window-pattern-past-the-layers',
    train(
      '--config.model.family=llama',
      '--config.model.sliding_window=8',
      '--config.model.sliding_window_pattern=64',
    ),
    'model.sliding_window_pattern',
  ),
  (
    'window-on-a-mixtral',
    train('--config.model.sliding_window=8', config='--config=experiments/mixtral_tiny.py:smoke'),
    'model.sliding_window',
  ),
  # Gemma 3's local layers need a window; its fixed parts are no keys of its own.
  (
    'gemma3-without-a-window',
    train('--config.model.sliding_window=0', config='--config=experiments/gemma3_tiny.py:smoke'),
    'model.sliding_window',
  ),
  (
    'gemma3-with-untied-embeddings-key',
    train('--config.model.tie_embeddings=true', config='--config=experiments/gemma3_tiny.py:smoke'),
    'model.tie_embeddings',
  ),
  (
    'gemma3-checkpoint-with-logit-softcapping',
    command('triax.cli.convert', '--hf_dir={d}/hf', '--workdir={d}/w', setup=_softcapped_gemma3),
    '--hf_dir',
  ),
  (
    'convert-dtype-on-an-import',
    command('triax.cli.convert', '--hf_dir={d}/hf', '--workdir={d}/w', '--dtype=bfloat16'),
    '--dtype',
  ),
  (
    'convert-export-to-an-unknown-dtype',
    command('triax.cli.convert', '--workdir={d}/w', '--hf_dir={d}/out', '--export', '--dtype=fp8'),
    '--dtype',
  ),
  (
    'experts-per-token-beyond-experts',
    train(
      '--config.model.experts_per_token=9', config='--config=experiments/mixtral_tiny.py:smoke'
    ),
    'model.experts_per_token',
  ),
  (
    'mixtral-batch-wide-aux-loss-under-the-pipeline-executor',
    train(
      '--config.mesh.data=2',
      '--config.mesh.pipe=2',
      config='--config=experiments/mixtral_tiny.py:smoke',
    ),
    'mesh.pipe',
  ),
  (
    'shared-expert-gate-without-shared-experts',
    train(
      '--config.model.shared_expert_gate=true',
      config='--config=experiments/mixtral_tiny.py:smoke',
    ),
    'model.shared_expert_gate',
  ),
  ('qkv-bias-on-a-gpt', train('--config.model.qkv_bias=true'), 'model.qkv_bias'),
  (
    'unknown-aux-loss-scope',
    train(
      '--config.model.router_aux_loss_scope=layer',
      config='--config=experiments/mixtral_tiny.py:smoke',
    ),
    'model.router_aux_loss_scope',
  ),
  (
    'rope-scaling-frequency-factors',
    train(
      '--config.model.family=llama',
      '--config.model.rope_scaling.factor=8.0',
      '--config.model.rope_scaling.high_freq_factor=0.5',
    ),
    'model.rope_scaling.high_freq_factor',
  ),
  (
    'rope-scaling-key-of-the-other-kind',
    train(
      '--config.model.family=llama',
      '--config.model.rope_scaling.rope_type=yarn',
      '--config.model.rope_scaling.factor=4.0',
      '--config.model.rope_scaling.low_freq_factor=2.0',
    ),
    'model.rope_scaling.low_freq_factor',
  ),
  ('negative-learning-rate', train('--config.train.learning_rate=-1'), 'train.learning_rate'),
  ('keep-no-checkpoints', train('--config.checkpoint.keep=0'), 'checkpoint.keep'),
  (
    'every-seconds-negative',
    train('--config.checkpoint.every_seconds=-1'),
    'checkpoint.every_seconds',
  ),
  (
    'keep-every-steps-negative',
    train('--config.checkpoint.keep_every_steps=-2'),
    'checkpoint.keep_every_steps',
  ),
  ('dcn-not-a-divisor', train('--config.mesh.dcn_pipe=3'), 'mesh.dcn_pipe'),
  ('dcn-without-processes', train('--config.mesh.dcn_pipe=2'), 'mesh'),
  ('two-free-mesh-axes', train('--config.mesh.data=-1', '--config.mesh.tensor=-1'), 'mesh.tensor'),
  (
    'negative-skip-nonfinite',
    train('--config.train.skip_nonfinite_steps=-1'),
    'train.skip_nonfinite_steps',
  ),
  (
    'layers-per-stage-sum',
    train('--config.pipeline.layers_per_stage=(1,1,1,2)'),
    'pipeline.layers_per_stage',
  ),
  (
    'device-order-not-a-permutation',
    train('--config.mesh.device_order=(0,1,2,3,4,5,6,6)'),
    'mesh.device_order',
  ),
  # -- unknown keys, flags, values of the wrong type
  ('unknown-key', train('--config.model.num_layer=4'), '--config.model.num_layer'),
  ('unknown-group', train('--config.optimizer.lr=1'), '--config.optimizer.lr'),
  ('not-an-integer', train('--config.train.steps=abc'), '--config.train.steps'),
  (
    'not-a-boolean',
    train('--config.train.record_sample_ids=maybe'),
    '--config.train.record_sample_ids',
  ),
  ('unknown-flag', train('--nosuchflag'), 'nosuchflag'),
  ('positional-argument', train('extra'), 'flags'),
  ('no-config', train(config=None), '--config'),
  ('no-workdir', train(workdir=None), '--workdir'),
  ('profile-steps-malformed', train('--profile_steps=abc'), '--profile_steps'),
  ('profile-steps-out-of-range', train('--profile_steps=0:99'), '--profile_steps'),
  ('no-cpu-devices', train('--cpu_devices=0'), '--cpu_devices'),
  # -- config files
  ('config-file-missing', train(config='--config={d}/no_such_config.py'), '--config'),
  (
    'config-file-syntax',
    train(
      config='--config={d}/broken.py',
      setup=write('broken.py', 'def get_config(arg=None:\n  pass\n'),
    ),
    '--config',
  ),
  ('config-argument-unknown', train(config='--config=experiments/gpt_tiny.py:fast=1'), '--config'),
  # -- data
  (
    'data-path-missing',
    train('--config.data.source=text', '--config.data.path=/no/such/file'),
    'data.path',
  ),
  (
    'data-too-little-text',
    train(
      '--config.data.source=text',
      '--config.data.path={d}/tiny.txt',
      setup=write('tiny.txt', 'hello world\n'),
    ),
    'data.path',
  ),
  ('data-source-unknown', train('--config.data.source=web'), 'data.source'),
  ('data-text-without-path', train('--config.data.source=text'), 'data.path'),
  # A key the source does not read is an error, not ignored.
  (
    'data-path-ignored',
    train('--config.data.path={d}/notes.txt', setup=write('notes.txt', 'my text')),
    'data.path',
  ),
  (
    'data-mixture-ignored',
    train("--config.data.mixture=(('{d}/tokens', 1.0),)"),
    'data.mixture',
  ),
  # Never a silent prefix of the user's text.
  (
    'data-text-over-max-bytes',
    train(
      '--config.data.source=text',
      '--config.data.path={d}/big.txt',
      '--config.data.max_text_bytes=1000',
      setup=write('big.txt', 'some words\n' * 200),
    ),
    'data.max_text_bytes',
  ),
  (
    'data-text-empty-file',
    train(
      '--config.data.source=text',
      '--config.data.path={d}/empty.txt',
      setup=write('empty.txt', ''),
    ),
    'data.path',
  ),
  (
    'data-tokenizer-with-text',
    train(
      '--config.data.source=text',
      '--config.data.path={d}/a.txt',
      '--config.data.tokenizer={d}/tok.json',
      setup=write('a.txt', 'hello'),
    ),
    'data.tokenizer',
  ),
  (
    'data-mask-documents-without-documents',
    train('--config.data.mask_documents=true'),
    'data.mask_documents',
  ),
  (
    'data-tokens-unfinished',
    train(
      '--config.data.source=tokens',
      '--config.data.path={d}/tokens',
      setup=write('tokens/train-00000.tokens', 'ab'),
    ),
    'data.path',
  ),
  (
    'data-tokens-damaged',
    train(
      '--config.data.source=tokens',
      '--config.data.path={d}/tokens',
      setup=prepared_tokens('tokens', damage=True),
    ),
    'data.path',
  ),
  (
    'data-tokens-other-tokenizer',
    train(
      '--config.data.source=tokens',
      '--config.data.path={d}/tokens',
      '--config.data.tokenizer={d}/other.json',
      setup=prepared_tokens('tokens', bpe='other.json'),
    ),
    'data.tokenizer',
  ),
  (
    'data-tokenizer-beyond-vocab',
    train(
      '--config.data.source=tokens',
      '--config.data.path={d}/tokens',
      '--config.data.tokenizer={d}/tok.json',
      setup=prepared_tokens('tokens', tokenizer='bpe'),
    ),
    'model.vocab_size',
  ),
  (
    'data-tokenizer-padding-unsaid',
    train(
      '--config.data.source=tokens',
      '--config.data.path={d}/tokens',
      '--config.data.tokenizer={d}/tok.json',
      '--config.model.vocab_size=512',
      setup=prepared_tokens('tokens', tokenizer='bpe'),
    ),
    'model.vocab_used',
  ),
  (
    'data-megatron-missing',
    train('--config.data.source=megatron', '--config.data.path={d}/corpus_text_document'),
    'data.path',
  ),
  # -- workdirs and checkpoint directories
  ('workdir-is-a-file', train(setup=write('w', 'a file')), '--workdir'),
  ('workdir-under-a-file', train(workdir='{d}/afile/w', setup=write('afile', 'x')), '--workdir'),
  # Held by a live process of this host (pid 1 always runs): checked before anything is read.
  (
    'workdir-in-use',
    train(setup=write('w/triax.lock', json.dumps({'pid': 1, 'host': HOST, 'started': 'x'}))),
    'workdir',
  ),
  ('checkpoints-is-a-file', train(setup=write('w/checkpoints', 'a file')), '--workdir'),
  ('checkpoints-hold-junk', train(setup=write('w/checkpoints/notes.txt', 'mine')), '--workdir'),
  ('checkpoint-foreign-step', train(setup=write('w/checkpoints/5/data', 'junk')), '--workdir'),
  ('checkpoint-unreadable', train(setup=fake_checkpoint), '--workdir'),
  ('checkpoint-other-model', train('--config.model.d_model=64', trained=True), 'model.d_model'),
  (
    'checkpoint-other-family',
    train('--config.model.family=llama', trained=True),
    'model.family',
  ),
  (
    'checkpoint-other-optimizer',
    train('--config.train.grad_clip_norm=0', trained=True),
    'train.grad_clip_norm',
  ),
  (
    'checkpoint-other-optimizer-kind',
    train('--config.train.optimizer=lion', trained=True),
    'train.optimizer',
  ),
  ('optimizer-unknown', train('--config.train.optimizer=sgd'), 'train.optimizer'),
  ('optimizer-key-for-another', train('--config.train.muon_ns_steps=3'), 'train.muon_ns_steps'),
  (
    'muon-no-matrix',
    train(
      '--config.train.optimizer=muon',
      "--config.train.muon_exclude=('w1','w2','wq','wk','wv','wo')",
    ),
    'train.muon_exclude',
  ),
  # -- the tokenizer trainer and prepare
  (
    'tokenizer-vocab-too-small',
    command(
      'triax.cli.tokenizer',
      'train',
      '--input={d}/a.txt',
      '--vocab_size=100',
      '--out={d}/tok.json',
      setup=write('a.txt', 'some text'),
    ),
    '--vocab_size',
  ),
  (
    'prepare-input-missing',
    command('triax.cli.prepare', '--input={d}/no_such_dir', '--out={d}/tokens'),
    '--input',
  ),
  (
    'prepare-out-holds-other-files',
    command(
      'triax.cli.prepare',
      '--input={d}/a.txt',
      '--out={d}/tokens',
      setup=lambda d: (write('a.txt', 'text')(d), write('tokens/mine.txt', 'keep')(d)),
    ),
    '--out',
  ),
  # -- the planner and the schedule tool
  (
    'plan-cluster-missing',
    command('triax.cli.plan', '--config=experiments/gpt_tiny.py', '--cluster={d}/no_such.yaml'),
    '--cluster',
  ),
  (
    'plan-cluster-malformed-yaml',
    command(
      'triax.cli.plan',
      '--config=experiments/gpt_tiny.py',
      '--cluster={d}/bad.yaml',
      setup=write('bad.yaml', 'name: x\ngroups: [a, b\n'),
    ),
    '--cluster',
  ),
  (
    'plan-cluster-without-groups',
    command(
      'triax.cli.plan',
      '--config=experiments/gpt_tiny.py',
      '--cluster={d}/nogroups.yaml',
      setup=write('nogroups.yaml', 'name: x\n'),
    ),
    '--cluster',
  ),
  (
    'plan-offload-without-host-link',
    command(
      'triax.cli.plan',
      '--config=experiments/gpt_tiny.py',
      '--config.train.offload_optimizer=true',
      '--cluster=experiments/clusters/tpu_v5p.yaml',
      '--gpus=4',
      '--profile=analytic',
    ),
    'train.offload_optimizer',
  ),
  ('plan-evaluate-with-top', plan_evaluate('--top=3'), '--top'),
  ('plan-evaluate-with-search', plan_evaluate('--search=learned'), '--search'),
  ('plan-evaluate-layout-token', plan_evaluate('--layout=d8,q2'), '--layout'),
  (
    'plan-layout-without-evaluate',
    command(
      'triax.cli.plan', '--config=experiments/gpt_tiny.py', f'--cluster={H100}', '--layout=d8'
    ),
    '--layout',
  ),
  # -- compiling for a TPU slice that is not here
  ('topology-unknown', tpu('--topology=v9p:2x2'), '--topology'),
  ('topology-without-compile-only', tpu('--topology=v5p:2x2x1', compile_only=False), '--topology'),
  ('topology-device-count', tpu('--topology=v5p:2x2x1'), 'mesh'),
  ('topology-with-cpu-devices', tpu('--topology=v5p:2x2x2', '--cpu_devices=8'), '--cpu_devices'),
  ('topology-slices-without-dcn', tpu('--topology=v5p:2x2x1', '--topology_slices=2'), 'mesh'),
  (
    'splash-off-tpu',
    train('--config.model.attention=splash', '--config.model.seq_len=128'),
    'model.attention',
  ),
  ('splash-sequence', train('--config.model.attention=splash'), 'model.attention'),
  (
    'splash-interpret-alone',
    train('--config.model.splash_interpret=true'),
    'model.splash_interpret',
  ),
  # -- sequence and context parallelism
  (
    'context-vs-seq',
    train('--config.mesh.data=1', '--config.mesh.context=2', '--config.model.seq_len=30'),
    'mesh.context',
  ),
  (
    'context-with-cudnn',
    train(
      '--config.mesh.data=1',
      '--config.mesh.context=2',
      '--config.model.context_attention=ring',
      '--config.model.attention=cudnn',
    ),
    'model.attention',
  ),
  (
    'context-attention-unknown',
    train('--config.model.context_attention=zigzag'),
    'model.context_attention',
  ),
  (
    'sequence-parallel-without-tensor',
    train(
      '--config.mesh.sequence_parallel=true', '--config.mesh.tensor=1', '--config.mesh.context=2'
    ),
    'mesh.sequence_parallel',
  ),
  (
    'sequence-parallel-seq',
    train(
      '--config.mesh.sequence_parallel=true',
      '--config.mesh.data=1',
      '--config.mesh.tensor=4',
      '--config.model.seq_len=30',
    ),
    'mesh.sequence_parallel',
  ),
  ('schedule-no-stages', command('triax.cli.schedule', '--stages=0'), '--stages'),
  ('schedule-unknown', command('triax.cli.schedule', '--schedule=zigzag'), 'schedule'),
  (
    'schedule-file-missing',
    command('triax.cli.schedule', '--schedule_file={d}/none.csv'),
    '--schedule_file',
  ),
]
IDS = [c[0] for c in CASES]
assert len(set(IDS)) == len(IDS) >= 25


def snapshot(root):
  """Every path under `root` with its kind, size and modification time."""
  found = {}
  for path, dirs, files in os.walk(root):
    for name in dirs + files:
      full = os.path.join(path, name)
      st = os.lstat(full)
      found[os.path.relpath(full, root)] = (name in dirs, st.st_size, st.st_mtime_ns)
  return found


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A workdir with a 2-step checkpoint of the smoke config."""
  workdir = str(tmp_path_factory.mktemp('trained') / 'w')
  result = harness.run_cli(
    'triax.cli.train',
    f'--config={SMOKE}',
    f'--workdir={workdir}',
    *TRAIN_FLAGS,
    '--config.train.steps=2',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


@pytest.fixture(scope='module')
def outcomes(request, tmp_path_factory):
  """Runs the selected cases, three at a time, each in a child forked from
  one of three warm servers; case id -> (result, before, after)."""
  selected = {
    item.callspec.params['case']
    for item in request.session.items
    if item.module is request.module and hasattr(item, 'callspec')
  }
  cases = [c for c in CASES if c[0] in selected]
  trained_dir = (
    request.getfixturevalue('trained')
    if any(c[0].startswith('checkpoint-other') for c in cases)
    else None
  )

  servers = queue.Queue()
  for _ in range(3):
    servers.put(forkserver.ForkServer())

  def run(case):
    case_id, build, _ = case
    d = str(tmp_path_factory.mktemp(case_id))
    module, args = build(d, trained_dir)
    before = snapshot(d)
    server = servers.get()
    try:
      result = server.run(module, args, timeout=300)
    finally:
      servers.put(server)
    return case_id, (result, before, snapshot(d))

  try:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      return dict(pool.map(run, cases))
  finally:
    while not servers.empty():
      servers.get().close()


@pytest.mark.parametrize('case', IDS)
def test_bad_input_exits_2_with_one_line_and_touches_nothing(case, outcomes):
  result, before, after = outcomes[case]
  key = dict((c[0], c[2]) for c in CASES)[case]
  assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
  errors = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1, result.stderr[-3000:]
  assert key in errors[0], errors[0]
  assert len(errors[0]) > len(f'error: {key}: ') + 15, errors[
    0
  ]  # says what is wrong and what to do
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert after == before, sorted(set(after.items()) ^ set(before.items()))
