// Attention kernels for head_dim 256.
#include "cuda/attention_launch.cuh"

namespace tq::cuda::kernels {

bool launch_attention_d256(int group_size, MainKind kind, const AttentionKernelParams& p, int n_items, bool overlap, void* stream) {
  if (kind == MainKind::dense_f16) return launch_attention_instance<256, 256, MainKind::dense_f16>(p, n_items, overlap, stream);
  if (kind == MainKind::dense_bf16) return launch_attention_instance<256, 256, MainKind::dense_bf16>(p, n_items, overlap, stream);
  switch (group_size) {
    case 32:
      return p.means.runs > 0 ? launch_attention_instance<256, 32, MainKind::tq, true>(p, n_items, overlap, stream)
                              : launch_attention_instance<256, 32, MainKind::tq, false>(p, n_items, overlap, stream);
    case 64:
      return p.means.runs > 0 ? launch_attention_instance<256, 64, MainKind::tq, true>(p, n_items, overlap, stream)
                              : launch_attention_instance<256, 64, MainKind::tq, false>(p, n_items, overlap, stream);
    case 128:
      return p.means.runs > 0 ? launch_attention_instance<256, 128, MainKind::tq, true>(p, n_items, overlap, stream)
                              : launch_attention_instance<256, 128, MainKind::tq, false>(p, n_items, overlap, stream);
    default: return false;
  }
}

int attention_blocks_per_sm_d256(int group_size, MainKind kind, int tile_bytes) {
  if (kind == MainKind::dense_f16) return attention_instance_blocks_per_sm<256, 256, MainKind::dense_f16>(tile_bytes);
  if (kind == MainKind::dense_bf16) return attention_instance_blocks_per_sm<256, 256, MainKind::dense_bf16>(tile_bytes);
  switch (group_size) {
    case 32: return attention_instance_blocks_per_sm<256, 32, MainKind::tq>(tile_bytes);
    case 64: return attention_instance_blocks_per_sm<256, 64, MainKind::tq>(tile_bytes);
    case 128: return attention_instance_blocks_per_sm<256, 128, MainKind::tq>(tile_bytes);
    default: return 0;
  }
}

}  // namespace tq::cuda::kernels
