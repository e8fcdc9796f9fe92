// A whole file as bytes (text files: configs, templates, prompts), with an error that names the path.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"

namespace tq {

inline std::string read_whole_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TQ_CHECK(f.good(), path, ": cannot open the file");
  std::ostringstream os;
  os << f.rdbuf();
  TQ_CHECK(!f.bad(), path, ": read error");
  return os.str();
}

}  // namespace tq
