// --device and the CUDA backend's options, the same in every tool.
//
//   --device cpu|cuda           where the forward pass runs (cuda: the whole pass on the GPU)
//   --no-cuda-graph             launch decode steps kernel by kernel instead of replaying CUDA graphs
//   --no-attn-overlap           start each layer's attention after its append has finished
//   --attn-min-tiles N          the GPU attention planner's fewest 16-token tiles per work item
//   --cuda-timeline POS         diagnostics builds (-DTQ_ATTN_TIMELINE): the decode step at POS prints its timeline
//   --cuda-op-profile           the GPU time of every operation of the decode steps, printed at the end
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "core/error.h"
#include "device/cpu_device.h"
#ifdef TQ_HAVE_CUDA_MODEL
#include "cuda/cuda_device.h"
#endif

namespace tq::cli {

struct DeviceFlags {
  std::string device = "cpu";
  bool no_cuda_graph = false;
  bool no_attn_overlap = false;
  int attn_min_tiles = 0;
  int timeline_position = -1;
  bool op_profile = false;
};

inline void add_device_flags(CLI::App& app, DeviceFlags& f) {
  app.add_option("--device", f.device, "cpu, or cuda (the whole forward pass on the GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--no-cuda-graph", f.no_cuda_graph, "--device cuda: launch decode steps kernel by kernel (no CUDA graphs)");
  app.add_flag("--no-attn-overlap", f.no_attn_overlap, "--device cuda: start attention only after its layer's append has finished");
  app.add_option("--attn-min-tiles", f.attn_min_tiles, "--device cuda: fewest 16-token tiles per attention work item (0: the planner's)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--cuda-timeline", f.timeline_position,
                 "--device cuda, diagnostics builds (-DTQ_ATTN_TIMELINE): print the timeline of the decode step at this position")
      ->check(CLI::Range(-1, 1 << 30));
  app.add_flag("--cuda-op-profile", f.op_profile,
               "--device cuda: time every operation of the decode steps (kernel by kernel) and print the table at the end");
}

// The device the flags ask for; `threads` for the CPU. `tool` names the program in messages.
inline std::unique_ptr<Device> make_device(const DeviceFlags& f, int threads, const char* tool) {
  if (f.device == "cpu") {
    TQ_CHECK(!f.no_cuda_graph && !f.no_attn_overlap && f.attn_min_tiles == 0 && f.timeline_position < 0 && !f.op_profile,
             "--no-cuda-graph, --no-attn-overlap, --attn-min-tiles, --cuda-timeline and --cuda-op-profile are options of --device cuda");
    return std::make_unique<CpuDevice>(threads);
  }
#ifdef TQ_HAVE_CUDA_MODEL
  cuda::CudaDeviceOptions o;
  o.graphs = !f.no_cuda_graph;
  o.overlap_append = !f.no_attn_overlap;
  o.attention_min_tiles = f.attn_min_tiles;
  o.timeline_position = f.timeline_position;
  o.op_profile = f.op_profile;
  return cuda::make_cuda_device(o);
#else
  fail("--device cuda: this ", tool, " was built without the CUDA backend (configure with -DTQ_CUDA=ON where nvcc is found)");
#endif
}

}  // namespace tq::cli
