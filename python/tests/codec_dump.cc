// The C++ codec's output for vectors Python wrote, for test_codec.py's byte-for-byte comparison of the
// bindings with the library they wrap.
//
//   tq_codec_dump tq IN.f32 DIM BITS GROUP SEED GRID FIT ROTATION CODEBOOK LAYOUT OUT
//       OUT.codes (uint8 [rows][code_bytes]), OUT.scales (binary16 [rows][groups]), OUT.deq (float32 [rows][dim])
//   tq_codec_dump rotation IN.f32 DIM SEED BLOCK OUT    OUT.fwd, OUT.inv (float32 [rows][dim])
//   tq_codec_dump q8_0|q4_0 IN.f32 OUT                  OUT.blocks, OUT.deq
// IN.f32: float32 [rows][dim], little-endian, as NumPy's tofile writes it.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "codec/absmax.h"
#include "codec/group_quantizer.h"
#include "codec/rotation.h"
#include "core/error.h"

namespace {

std::vector<float> read_floats(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  TQ_CHECK(f.good(), "cannot open ", path);
  const auto n = static_cast<size_t>(f.tellg()) / sizeof(float);
  std::vector<float> x(n);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(x.data()), static_cast<std::streamsize>(n * sizeof(float)));
  return x;
}

void write(const std::string& path, const void* p, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(p), static_cast<std::streamsize>(bytes));
  TQ_CHECK(f.good(), "cannot write ", path);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> a(argv + 1, argv + argc);
    TQ_CHECK(!a.empty(), "usage: tq_codec_dump tq|rotation|q8_0|q4_0 ...");
    if (a[0] == "tq") {
      TQ_CHECK(a.size() == 12, "tq: IN DIM BITS GROUP SEED GRID FIT ROTATION CODEBOOK LAYOUT OUT");
      const std::vector<float> x = read_floats(a[1]);
      const int dim = std::stoi(a[2]);
      tq::QuantizerOptions o = tq::QuantizerOptions::defaults(std::stoi(a[3]));
      o.group_size = std::stoi(a[4]);
      o.seed = std::stoull(a[5]);
      o.grid = tq::parse_grid(a[6]);
      o.scale_fit = tq::parse_scale_fit(a[7]);
      o.rotation_block = tq::parse_rotation_block(a[8]);
      o.codebook = tq::parse_distribution(a[9]);
      o.layout = a[10] == "planes" ? tq::PackLayout::planes : tq::PackLayout::stream;
      const tq::GroupQuantizer q(dim, o);
      const size_t rows = x.size() / static_cast<size_t>(dim);
      std::vector<uint8_t> codes(rows * q.code_bytes());
      std::vector<tq::f16> scales(rows * static_cast<size_t>(q.groups()));
      std::vector<float> back(x.size());
      q.quantize(x.data(), rows, codes.data(), scales.data());
      q.dequantize(codes.data(), scales.data(), rows, back.data());
      write(a[11] + ".codes", codes.data(), codes.size());
      write(a[11] + ".scales", scales.data(), scales.size() * sizeof(tq::f16));
      write(a[11] + ".deq", back.data(), back.size() * sizeof(float));
    } else if (a[0] == "rotation") {
      TQ_CHECK(a.size() == 6, "rotation: IN DIM SEED BLOCK OUT");
      std::vector<float> x = read_floats(a[1]);
      const int dim = std::stoi(a[2]);
      const tq::Rotation r(dim, std::stoi(a[4]), std::stoull(a[3]));
      const size_t rows = x.size() / static_cast<size_t>(dim);
      std::vector<float> y = x;
      r.forward(y.data(), rows);
      write(a[5] + ".fwd", y.data(), y.size() * sizeof(float));
      r.inverse(x.data(), rows);
      write(a[5] + ".inv", x.data(), x.size() * sizeof(float));
    } else if (a[0] == "q8_0" || a[0] == "q4_0") {
      TQ_CHECK(a.size() == 3, a[0], ": IN OUT");
      const std::vector<float> x = read_floats(a[1]);
      std::vector<float> back(x.size());
      if (a[0] == "q8_0") {
        std::vector<tq::BlockQ8_0> b(x.size() / 32);
        tq::quantize_q8_0(x.data(), x.size(), b.data());
        tq::dequantize_q8_0(b.data(), x.size(), back.data());
        write(a[2] + ".blocks", b.data(), b.size() * sizeof(b[0]));
      } else {
        std::vector<tq::BlockQ4_0> b(x.size() / 32);
        tq::quantize_q4_0(x.data(), x.size(), b.data());
        tq::dequantize_q4_0(b.data(), x.size(), back.data());
        write(a[2] + ".blocks", b.data(), b.size() * sizeof(b[0]));
      }
      write(a[2] + ".deq", back.data(), back.size() * sizeof(float));
    } else {
      tq::fail("unknown mode '", a[0], "' (tq, rotation, q8_0, q4_0)");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tq_codec_dump: error: %s\n", e.what());
    return 1;
  }
}
