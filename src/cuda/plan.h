// Work planning for the CUDA attention kernel (host code, no CUDA headers): which thread block reads
// which tiles of which sequence and KV head, and how the partial results are merged.
//
// One thread block runs one work item: up to 8 query rows (row = query i * group + head in group) of one
// request and one KV head, over a run of 16-token tiles of one tier (the FP16/BF16 sink tier or the
// main tier). The rows of a request that share a KV head and a run of 8 form an output group; when a
// group's context is split across several items (flash-decoding), each writes a partial softmax state
// and the last one to finish merges them (a counter per group), so one launch does everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tq::cuda {

inline constexpr int kRowsPerItem = 8;  // the N dimension of the MMA
inline constexpr int kMaxPartsPerGroup = 256;  // the merging block keeps one weight per part and row

// Plain structs copied to the device as they are.
struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t row0;        // first row of the group
  int32_t tier;        // 0 = main tier, 1 = sink tier, 2 = the FP16 filling run of a centred cache
  int32_t tile_begin;  // tiles of the tier, [begin, end)
  int32_t tile_end;
  int32_t group;       // output group
  int32_t part;        // slot of this item's partial state, or -1 when the item is its group's only part
};
static_assert(sizeof(WorkItem) == 32);

struct OutputGroup {
  int32_t request;
  int32_t kv_head;
  int32_t row0;
  int32_t n_parts;     // items of the group
  int32_t first_part;  // their partial slots are [first_part, first_part + n_parts)
  int32_t n_sink_parts;  // the first n_sink_parts of them are sink-tier and filling-run items (original domain)
  int32_t pad0, pad1;
};
static_assert(sizeof(OutputGroup) == 32);

struct PlanRequest {
  int length = 0;  // positions held by the sequence
  int n_q = 1;     // queries at positions pos0 .. pos0 + n_q - 1
  int pos0 = 0;
  int tail_pos = -1;  // centring: the first position of the run still filling (its own tier), -1 when none
  bool operator==(const PlanRequest&) const = default;
};

struct PlanShape {
  int n_heads = 0, n_kv = 0;  // query heads, KV heads
  int min_tokens = 0;         // sink tier size
  int window = 0;             // sliding window (0 = none)
  int target_blocks = 1;      // thread blocks that fill the GPU once (SMs x blocks per SM)
  int min_tiles_per_item = 16;
  bool operator==(const PlanShape&) const = default;
};

struct WorkPlan {
  std::vector<WorkItem> items;
  std::vector<OutputGroup> groups;
  int n_parts = 0;          // partial-state slots needed
  int64_t tiles = 0;        // tiles read in all
  int tiles_per_item = 0;   // the split size chosen
};

// Plans one attention call. Throws tq::Error on requests the cache cannot serve.
WorkPlan plan_attention(const PlanShape& shape, const std::vector<PlanRequest>& requests);

// The plans of the last few calls by shape and requests. The layers of a model attend with the same
// requests in one step, and planning a batch costs the host ~0.5 us a sequence (64 sequences, 8 KV heads:
// 512 output groups): only the first layer plans, the others take its plan.
class PlanMemo {
 public:
  const WorkPlan& plan(const PlanShape& shape, const std::vector<PlanRequest>& requests);

 private:
  struct Entry {
    PlanShape shape;
    std::vector<PlanRequest> requests;
    WorkPlan plan;
  };
  static constexpr size_t kEntries = 4;
  std::vector<Entry> entries_;  // the most recent last
};

// Tiles of a tier that rows with queries at positions [q_first, q_last] can see, as [begin, end);
// the tier holds positions [first_pos, first_pos + count). Empty when begin == end.
void visible_tiles(int first_pos, int count, int q_first, int q_last, int window, int* begin, int* end);

}  // namespace tq::cuda
