"""A small byte-level DeepSeek-V3 on the Python standard library's source, 8 devices.

DeepSeek-V3's architecture at llama_tiny's scale: multi-head latent attention
(queries and keys/values through low-rank latents, a rotated key shared by the
heads), a dense first block, then DeepSeekMoE blocks of 16 fine-grained
experts (a quarter of the dense MLP wide) in 4 groups, 4 per token from the 2
best groups, beside one shared expert, balanced without an auxiliary loss
(each expert's routing bias moves towards balance after every step), and one
multi-token prediction module. data=2 x tensor=2 x pipe=2 under DualPipeV
with its overlapped pairs fused into one tick, the experts split over the 2
data-parallel devices (mesh.expert=2):

  python -m triax train --config=experiments/deepseek_tiny.py --workdir=runs/deepseek_tiny --cpu_devices=8

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/deepseek_tiny.py:smoke
"""

import os

from triax import config

# The run this one repeats with DeepSeek's blocks: training, data, smoke lengths.
LLAMA_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama_tiny.py')


def get_config(arg=None):
  smoke = config.parse_arg(arg, smoke=False, steps=300)['smoke']
  c = config.from_file(LLAMA_TINY, arg)
  c.model.family = 'deepseek'
  c.model.num_kv_heads = 0  # MLA: every head has its own keys and values, from one latent
  c.mesh.data, c.mesh.tensor, c.mesh.pipe, c.mesh.expert = 2, 2, 2, 2
  c.pipeline.schedule = 'dualpipe_v'
  c.pipeline.virtual_stages = 2
  c.pipeline.microbatches = 4
  c.pipeline.fuse_overlaps = True
  m = c.model
  # A dense block, then 4 MoE blocks: one per chunk of DualPipeV's 2 stages x 2.
  m.num_layers, m.first_k_dense = 5, 1
  m.num_heads = 4
  # Latents of half and a quarter of d_model; q/k heads 48 wide (32 + 16 rotated), v 32.
  m.q_lora_rank, m.kv_lora_rank = m.d_model // 2, m.d_model // 4
  m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 32, 16, 32
  if smoke:
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 8, 4, 8
  # Fine-grained experts a quarter of the dense MLP wide: 4 routed + 1 shared = its width.
  m.moe_d_ff = m.d_ff // 4
  m.num_experts, m.experts_per_token, m.shared_experts = 16, 4, 1
  m.n_group, m.topk_group = 4, 2
  m.routed_scaling_factor = 2.5
  # Loss-free balancing alone (DeepSeek-V3 adds a tiny sequence-wise loss); the rate is
  # V3's 0.001 x 10, as this run has ~1/1000 of V3's steps to move the bias in.
  m.router_aux_loss_coef, m.router_z_loss_coef = 0.0, 0.0
  m.router_aux_loss_scope = 'microbatch'  # what the pipeline computes
  m.bias_update_rate = 0.01
  m.mtp_depth, m.mtp_loss_weight = 1, 0.3
  return c
