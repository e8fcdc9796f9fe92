// Attention kernels for head_dim 128.
#include "cuda/attention_launch.cuh"

namespace tq::cuda::kernels {

bool launch_attention_d128(int group_size, MainKind kind, const AttentionKernelParams& p, int n_items, bool overlap, void* stream) {
  if (kind == MainKind::dense_f16) return launch_attention_instance<128, 128, MainKind::dense_f16>(p, n_items, overlap, stream);
  if (kind == MainKind::dense_bf16) return launch_attention_instance<128, 128, MainKind::dense_bf16>(p, n_items, overlap, stream);
  switch (group_size) {
    case 32:
      return p.means.runs > 0 ? launch_attention_instance<128, 32, MainKind::tq, true>(p, n_items, overlap, stream)
                              : launch_attention_instance<128, 32, MainKind::tq, false>(p, n_items, overlap, stream);
    case 64:
      return p.means.runs > 0 ? launch_attention_instance<128, 64, MainKind::tq, true>(p, n_items, overlap, stream)
                              : launch_attention_instance<128, 64, MainKind::tq, false>(p, n_items, overlap, stream);
    case 128:
      return p.means.runs > 0 ? launch_attention_instance<128, 128, MainKind::tq, true>(p, n_items, overlap, stream)
                              : launch_attention_instance<128, 128, MainKind::tq, false>(p, n_items, overlap, stream);
    default: return false;
  }
}

int attention_blocks_per_sm_d128(int group_size, MainKind kind, int tile_bytes) {
  if (kind == MainKind::dense_f16) return attention_instance_blocks_per_sm<128, 128, MainKind::dense_f16>(tile_bytes);
  if (kind == MainKind::dense_bf16) return attention_instance_blocks_per_sm<128, 128, MainKind::dense_bf16>(tile_bytes);
  switch (group_size) {
    case 32: return attention_instance_blocks_per_sm<128, 32, MainKind::tq>(tile_bytes);
    case 64: return attention_instance_blocks_per_sm<128, 64, MainKind::tq>(tile_bytes);
    case 128: return attention_instance_blocks_per_sm<128, 128, MainKind::tq>(tile_bytes);
    default: return 0;
  }
}

#ifdef TQ_ATTN_TIMELINE
// The stamps of the last head_dim-128 launch (diagnostics build only): [kTimelineBlocks][kTimelineMarks].
void read_attention_timeline_d128(unsigned long long* host) {
  TQ_CUDA_CHECK(cudaMemcpyFromSymbol(host, g_attn_timeline, sizeof(g_attn_timeline)));
}
void clear_attention_timeline_d128() {
  static const unsigned long long zeros[kTimelineBlocks][kTimelineMarks] = {};
  TQ_CUDA_CHECK(cudaMemcpyToSymbol(g_attn_timeline, zeros, sizeof(zeros)));
}
#endif

}  // namespace tq::cuda::kernels
