// libFuzzer target: a TurboQuant weight folder (docs/FORMATS.md "TurboQuant weights"), loaded by
// open_model: config.json with its "quantization" block (parse_tq_quantization: every field, the tensor
// list, seeds), model.safetensors with the '<P>.tq_codes' / '<P>.tq_scales' planes, attach_tq_weights (plane
// dtypes and shapes against bits and group size, finite scales, rotation blocks, planes the config does not
// list), then validate_weights over the tq views.
// Input: config.json, the separator line of fuzz_util.h, model.safetensors. Seeds: small folders that
// turboquant-convert's code wrote (fuzz/make_seeds.cc).
#include "fuzz/fuzz_util.h"
#include "model/loader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string_view> parts = tq::fuzz::split_parts(data, size, 2);
  tq::fuzz::write_scratch("config.json", parts[0]);
  tq::fuzz::write_scratch("model.safetensors", parts[1]);
  tq::fuzz::refused([&] { (void)tq::open_model(tq::fuzz::scratch_dir()); });
  return 0;
}
