// turboquant-bench subcommands.
#pragma once

#include <string>
#include <vector>

#include "codec/group_quantizer.h"

namespace tq::bench {

struct CodecArgs {
  std::vector<int> bits = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int> dims = {64, 128, 256};
  std::vector<std::string> data = {"gaussian", "outliers"};
  int group_size = 64;
  ScaleFit scale_fit = ScaleFit::plain;
  RotationBlock rotation_block = RotationBlock::dim;
  Distribution codebook = Distribution::gaussian;
  size_t floats = size_t{1} << 21;
  bool json = false;
};
int run_codec(const CodecArgs& args);

}  // namespace tq::bench
