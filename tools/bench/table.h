// Markdown tables and JSON rows for benchmark reports.
#pragma once

#include <cstdio>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

namespace tq::bench {

class MarkdownTable {
 public:
  explicit MarkdownTable(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string str() const {
    std::vector<size_t> width(header_.size());
    for (size_t c = 0; c < header_.size(); ++c) {
      width[c] = header_[c].size();
      for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
    }
    std::ostringstream os;
    auto line = [&](const std::vector<std::string>& cells) {
      os << "|";
      for (size_t c = 0; c < cells.size(); ++c) os << " " << std::setw(static_cast<int>(width[c])) << cells[c] << " |";
      os << "\n";
    };
    line(header_);
    os << "|";
    for (size_t c = 0; c < header_.size(); ++c) os << std::string(width[c] + 1, '-') << ":|";
    os << "\n";
    for (const auto& r : rows_) line(r);
    return os.str();
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

inline std::string fmt(double v, int precision = 3) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
}
inline std::string fixed(double v, int decimals = 2) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(decimals) << v;
  return os.str();
}

}  // namespace tq::bench
