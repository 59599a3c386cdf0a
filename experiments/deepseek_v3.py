"""A DeepSeek-V3-shaped model (671B parameters, 37B active), for the planner and for compiles.

DeepSeek-V3's shape: 61 blocks of d_model 7168, the first 3 dense (SwiGLU 18432),
the other 58 DeepSeekMoE (256 routed experts of width 2048, 8 a token, from at
most 4 of 8 groups, and 1 shared expert), multi-head latent attention with 128
heads (queries through a 1536-wide latent; keys and values from a 512-wide one,
a 64-wide rope key shared by the heads; qk head dim 192, v head dim 128), one
multi-token prediction module, vocabulary 129280, 4096 tokens a sequence. Trained
on the byte corpus as llama_8b is (the ids past 256 are padding, masked out of the
loss), bf16 compute with fp32 parameters and Adam state (10.7 TB: a model for a
cluster), 256 sequences (1M tokens) a step.

  python -m triax plan --config=experiments/deepseek_v3.py:dispatch=capacity \\
      --cluster=experiments/clusters/dgx_h100.yaml --gpus=256 --profile=analytic

(capacity dispatch on GPUs: XLA:GPU computes dropless's grouped matmuls densely
over every local expert, 256x the experts' work, which fits no GPU at this size.)

`lite` is DeepSeek-V2-Lite's 16B-A3B shape with V3's routing (sigmoid affinities,
group-limited top-k, routed scaling, loss-free balancing) and no MTP: 27 blocks of
d_model 2048, the first dense (10944), 64 experts of width 1408, 6 a token from 4
of 8 groups, 2 shared; 16 heads, queries projected directly, vocabulary 102400.
It is what `triax plan --verify` compiles for an 8-GPU host or a v5p slice:

  python -m triax plan --config=experiments/deepseek_v3.py:lite,batch=8,attention=xla \\
      --cluster=experiments/clusters/tpu_v5p.yaml --gpus=8 --profile=analytic \\
      --evaluate --layout=d8,e8,zero1 --verify=v5p:2x2x2

ARG is `key=value,...`: `lite`; `layers=N` blocks (first_k_dense of them dense); `mtp=N`
MTP modules; `seq=N` tokens a sequence; `batch=N` sequences a step (default 256);
`remat=none|attention|dots|full` (default full); `attention=xla|cudnn|splash` (default
cudnn; a topology compile takes xla); `dispatch=dropless|capacity` (default dropless).
"""

import os

from triax import config

# The benchmark's training settings: bf16 compute, fp32 state, its steps and cadences.
GPT_1B = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt_1b.py')


def get_config(arg=None):
  args = config.parse_arg(
    arg,
    lite=False,
    layers=0,
    mtp=None,
    seq=4096,
    batch=256,
    remat='full',
    attention='cudnn',
    dispatch='dropless',
  )
  base = f'batch={args["batch"]},remat={args["remat"]},attention={args["attention"]}'
  c = config.from_file(GPT_1B, base)
  # Every device a data-parallel replica until the planner (or --config.mesh.*) lays them out.
  c.mesh.data = -1
  m = c.model
  m.family = 'deepseek'
  # Blocks, the first `first_k_dense` of them dense (run by the embedding).
  m.num_layers = 61
  m.first_k_dense = 3
  # The residual stream's width.
  m.d_model = 7168
  # Attention heads (MLA: each with its own queries, keys and values from the shared latent).
  m.num_heads = 128
  # The queries' latent width (DeepSeek-V2-Lite: 0, queries projected from the stream).
  m.q_lora_rank = 1536
  # The K/V latent's width: what a token's keys and values are made from, and what decoding caches.
  m.kv_lora_rank = 512
  # A query's and a key's dimensions without position, and those RoPE rotates (one rope key).
  m.qk_nope_head_dim = 128
  m.qk_rope_head_dim = 64
  # A value's width (qk's is 192).
  m.v_head_dim = 128
  # The dense blocks' SwiGLU width.
  m.d_ff = 18432
  # Each routed and shared expert's SwiGLU width.
  m.moe_d_ff = 2048
  # Routed experts per MoE block, those a token runs, and the always-on shared ones.
  m.num_experts = 256
  m.experts_per_token = 8
  m.shared_experts = 1
  # Group-limited routing: the experts in 8 groups, a token's from the best 4.
  m.n_group = 8
  m.topk_group = 4
  # The chosen experts' normalised affinities scaled by this (V3's 2.5).
  m.routed_scaling_factor = 2.5
  # Loss-free balancing's bias step, and V3's small sequence-wise balance loss (alpha); no
  # batch-wise balance loss, no z-loss.
  m.bias_update_rate = 0.001
  m.router_seq_aux_loss_coef = 0.0001
  m.router_aux_loss_coef, m.router_z_loss_coef = 0.0, 0.0
  # Balanced per micro-batch, as a pipeline stage sees it (the executor's condition).
  m.router_aux_loss_scope = 'microbatch'
  # Dropless: no token dropped (TPU's grouped matmuls); capacity: fixed buffers (GPU's choice).
  m.moe_dispatch = args['dispatch']
  # One MTP module, its loss weighted 0.3 (V3's first 10T tokens).
  m.mtp_depth = 1
  m.mtp_loss_weight = 0.3
  # The vocabulary, of which the byte corpus uses 256 ids (the rest masked out of the loss).
  m.vocab_size = 129280
  m.vocab_used = 256
  # V3's RoPE base and RMSNorm epsilon.
  m.rope_theta = 10000.0
  m.norm_eps = 1e-6
  # Tokens a sequence.
  m.seq_len = args['seq']
  # The cross-entropy 256 positions at a time: all of them at once would be 2 GB of fp32 logits.
  m.loss_chunk = 256
  if args['lite']:
    m.num_layers, m.first_k_dense, m.d_model, m.num_heads = 27, 1, 2048, 16
    m.q_lora_rank, m.d_ff, m.moe_d_ff = 0, 10944, 1408
    m.num_experts, m.experts_per_token, m.shared_experts = 64, 6, 2
    m.routed_scaling_factor, m.mtp_depth, m.vocab_size = 1.0, 0, 102400
  if args['layers']:
    m.num_layers = args['layers']
  if args['mtp'] is not None:
    m.mtp_depth = args['mtp']
  return c
