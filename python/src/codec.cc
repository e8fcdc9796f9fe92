// turboquant.codec: the C++ codec (src/codec) on NumPy arrays. Nothing is computed here: the arrays are
// checked, viewed (a C-contiguous float32 array is read in place) or converted once (float16, strided
// layouts), and handed to GroupQuantizer, Rotation and the absmax blocks with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "codec/absmax.h"
#include "codec/codebook.h"
#include "codec/group_quantizer.h"
#include "codec/kernels.h"
#include "codec/rotation.h"
#include "core/error.h"
#include "core/half.h"

namespace py = pybind11;

namespace tq::python {
namespace {

static_assert(sizeof(f16) == 2, "f16 must have NumPy float16's size (the scales are written in place)");

std::string dtype_name(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

std::string shape_text(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

py::array require_array(const py::handle& h, const char* name) {
  if (!py::isinstance<py::array>(h))
    throw py::value_error(std::string(name) + " must be a NumPy array, got " + py::str(py::type::of(h)).cast<std::string>());
  py::array a = py::reinterpret_borrow<py::array>(h);
  if (a.ndim() < 1) throw py::value_error(std::string(name) + " must have at least one dimension (the vectors' last axis), got a 0-d array");
  return a;
}

py::array contiguous(const py::array& a) {
  if (a.flags() & py::array::c_style) return a;
  return py::module_::import("numpy").attr("ascontiguousarray")(a).cast<py::array>();
}

// Float vectors along the last axis: float32 read in place when C-contiguous, float16 widened once.
struct FloatRows {
  py::array keep;                  // the array the pointer reads (the input, or its contiguous copy)
  const float* data = nullptr;     // [rows][dim]
  std::vector<float> widened;      // [rows][dim] when the input was float16
  const uint16_t* half = nullptr;  // the float16 input, widened by widen() with the GIL released
  size_t rows = 0;
  int64_t dim = 0;
  std::vector<py::ssize_t> lead;   // the leading shape
  void widen() {
    if (!half) return;
    widened.resize(rows * static_cast<size_t>(dim));
    for (size_t i = 0; i < widened.size(); ++i) widened[i] = f16_bits_to_f32(half[i]);
    data = widened.data();
  }
};

FloatRows float_rows(const py::handle& h, const char* name) {
  py::array a = require_array(h, name);
  const bool f32 = a.dtype().is(py::dtype::of<float>());
  const bool f16 = a.dtype().is(py::dtype("float16"));
  if (!f32 && !f16) throw py::value_error(std::string(name) + " must be float32 or float16, got " + dtype_name(a));
  FloatRows r;
  r.keep = contiguous(a);
  r.dim = r.keep.shape(r.keep.ndim() - 1);
  if (r.dim == 0) throw py::value_error(std::string(name) + " has an empty last axis, shape " + shape_text(a));
  r.rows = static_cast<size_t>(r.keep.size()) / static_cast<size_t>(r.dim);
  for (py::ssize_t i = 0; i + 1 < r.keep.ndim(); ++i) r.lead.push_back(r.keep.shape(i));
  if (f32)
    r.data = static_cast<const float*>(r.keep.data());
  else
    r.half = static_cast<const uint16_t*>(r.keep.data());
  return r;
}

std::vector<py::ssize_t> with_last(std::vector<py::ssize_t> lead, py::ssize_t last) {
  lead.push_back(last);
  return lead;
}

// An array of `dtype` with C layout, checked against the shape the caller expects on its last axis.
py::array typed(const py::handle& h, const char* name, const py::dtype& dtype, const char* dtype_text) {
  py::array a = require_array(h, name);
  if (!a.dtype().is(dtype)) throw py::value_error(std::string(name) + " must be " + dtype_text + ", got " + dtype_name(a));
  return contiguous(a);
}

// An output array the caller gave (out=...): written in place, so it must be exactly what would be made.
py::array given_output(const py::handle& h, const char* name, const py::dtype& dtype, const char* dtype_text,
                       const std::vector<py::ssize_t>& shape) {
  py::array a = require_array(h, name);
  if (!a.dtype().is(dtype)) throw py::value_error(std::string(name) + " must be " + dtype_text + ", got " + dtype_name(a));
  if (!(a.flags() & py::array::c_style) || !a.writeable()) throw py::value_error(std::string(name) + " must be a writable C-contiguous array");
  if (std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()) != shape) {
    std::string want = "(";
    for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
    throw py::value_error(std::string(name) + " must have shape " + want + (shape.size() == 1 ? ",)" : ")") + ", got " + shape_text(a));
  }
  return a;
}

std::vector<py::ssize_t> lead_shape(const py::array& a) {
  std::vector<py::ssize_t> s;
  for (py::ssize_t i = 0; i + 1 < a.ndim(); ++i) s.push_back(a.shape(i));
  return s;
}

// Codec parameters the C++ code refuses (a group size that does not divide the dimension, 9 bits) are
// bad arguments: ValueError with the C++ message.
template <class F>
auto as_value_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    throw py::value_error(e.what());
  }
}

QuantizerOptions make_options(int bits, int group_size, uint64_t seed, const std::optional<std::string>& grid,
                              const std::optional<std::string>& fit, const std::string& rotation, const std::string& codebook,
                              const std::string& layout) {
  return as_value_error([&] {
    TQ_CHECK(bits >= 1 && bits <= 8, "bits must be 1..8, got ", bits);
    QuantizerOptions o = QuantizerOptions::defaults(bits);
    o.group_size = group_size;
    o.seed = seed;
    if (grid) o.grid = parse_grid(*grid);
    if (fit) o.scale_fit = parse_scale_fit(*fit);
    o.rotation_block = parse_rotation_block(rotation);
    o.codebook = parse_distribution(codebook);
    TQ_CHECK(layout == "planes" || layout == "stream", "unknown code layout '", layout, "' (expected planes or stream)");
    o.layout = layout == "planes" ? PackLayout::planes : PackLayout::stream;
    return o;
  });
}

// GroupQuantizer with the NumPy-facing calls.
class Quantizer {
 public:
  Quantizer(int dim, const QuantizerOptions& o) : q_(as_value_error([&] { return GroupQuantizer(dim, o); })) {}

  const GroupQuantizer& q() const { return q_; }

  py::tuple quantize(const py::handle& x, bool rotated, const py::object& out = py::none()) const {
    FloatRows r = float_rows(x, "x");
    check_dim(r.dim, "x");
    const auto code_shape = with_last(r.lead, static_cast<py::ssize_t>(q_.code_bytes()));
    const auto scale_shape = with_last(r.lead, q_.groups());
    py::array codes, scales;
    if (out.is_none()) {
      codes = py::array(py::dtype::of<uint8_t>(), code_shape);
      scales = py::array(py::dtype("float16"), scale_shape);
    } else {
      const py::tuple t = out.cast<py::tuple>();
      if (t.size() != 2) throw py::value_error("out must be a tuple (codes, scales)");
      codes = given_output(t[0], "out codes", py::dtype::of<uint8_t>(), "uint8", code_shape);
      scales = given_output(t[1], "out scales", py::dtype("float16"), "float16", scale_shape);
    }
    uint8_t* c = static_cast<uint8_t*>(codes.mutable_data());
    f16* s = static_cast<f16*>(scales.mutable_data());
    {
      py::gil_scoped_release nogil;
      r.widen();
      if (rotated)
        q_.quantize_rotated(r.data, r.rows, c, s);
      else
        q_.quantize(r.data, r.rows, c, s);
    }
    return py::make_tuple(codes, scales);
  }

  py::array dequantize(const py::handle& codes_h, const py::handle& scales_h, bool rotated, const py::object& out_h = py::none()) const {
    const py::array codes = typed(codes_h, "codes", py::dtype::of<uint8_t>(), "uint8");
    const py::array scales = typed(scales_h, "scales", py::dtype("float16"), "float16");
    if (codes.shape(codes.ndim() - 1) != static_cast<py::ssize_t>(q_.code_bytes()))
      throw py::value_error("codes must have " + std::to_string(q_.code_bytes()) + " bytes on the last axis (" +
                            std::to_string(q_.bits()) + "-bit codes of " + std::to_string(q_.dim()) + " values), got shape " +
                            shape_text(codes));
    if (scales.shape(scales.ndim() - 1) != q_.groups())
      throw py::value_error("scales must have " + std::to_string(q_.groups()) + " values on the last axis (groups of " +
                            std::to_string(q_.group_size()) + " in " + std::to_string(q_.dim()) + "), got shape " + shape_text(scales));
    const auto lead = lead_shape(codes);
    if (lead != lead_shape(scales))
      throw py::value_error("codes and scales must have the same leading shape, got " + shape_text(codes) + " and " + shape_text(scales));
    const size_t rows = static_cast<size_t>(codes.size()) / q_.code_bytes();
    const auto out_shape = with_last(lead, q_.dim());
    py::array out = out_h.is_none() ? py::array(py::dtype::of<float>(), out_shape)
                                    : given_output(out_h, "out", py::dtype::of<float>(), "float32", out_shape);
    const uint8_t* c = static_cast<const uint8_t*>(codes.data());
    const f16* s = static_cast<const f16*>(scales.data());
    float* y = static_cast<float*>(out.mutable_data());
    {
      py::gil_scoped_release nogil;
      if (rotated)
        q_.dequantize_rotated(c, s, rows, y);
      else
        q_.dequantize(c, s, rows, y);
    }
    return out;
  }

  py::array_t<float> table(const float* p, int n) const {
    py::array_t<float> a(n);
    std::memcpy(a.mutable_data(), p, sizeof(float) * static_cast<size_t>(n));
    return a;
  }

 private:
  void check_dim(int64_t dim, const char* name) const {
    if (dim != q_.dim())
      throw py::value_error(std::string(name) + " must have " + std::to_string(q_.dim()) + " values on the last axis, got " +
                            std::to_string(dim));
  }
  GroupQuantizer q_;
};

py::array_t<float> rotate(const Rotation& rot, const py::handle& x, bool forward) {
  FloatRows r = float_rows(x, "x");
  if (r.dim != rot.dim())
    throw py::value_error("x must have " + std::to_string(rot.dim()) + " values on the last axis (the rotation's dimension), got " +
                          std::to_string(r.dim));
  py::array_t<float> out(with_last(r.lead, rot.dim()));
  float* y = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    r.widen();
    std::memcpy(y, r.data, sizeof(float) * r.rows * static_cast<size_t>(r.dim));
    if (forward)
      rot.forward(y, r.rows);
    else
      rot.inverse(y, r.rows);
  }
  return out;
}

py::array_t<float> vec(const std::vector<float>& v) {
  py::array_t<float> a(static_cast<py::ssize_t>(v.size()));
  std::memcpy(a.mutable_data(), v.data(), sizeof(float) * v.size());
  return a;
}

// q8_0 / q4_0: blocks of 32 values along the last axis, as llama.cpp lays them out (a binary16 scale, then
// the quants): uint8 [..., n / 32, block bytes].
template <class Block, void (*Quantize)(const float*, size_t, Block*)>
py::array_t<uint8_t> absmax_quantize(const py::handle& x, const char* format) {
  FloatRows r = float_rows(x, "x");
  if (r.dim % kAbsmaxBlock != 0)
    throw py::value_error(std::string(format) + " needs the last axis to be a multiple of 32, got " + std::to_string(r.dim));
  auto shape = r.lead;
  shape.push_back(r.dim / kAbsmaxBlock);
  shape.push_back(static_cast<py::ssize_t>(sizeof(Block)));
  py::array_t<uint8_t> out(shape);
  Block* b = reinterpret_cast<Block*>(out.mutable_data());
  {
    py::gil_scoped_release nogil;
    r.widen();
    Quantize(r.data, r.rows * static_cast<size_t>(r.dim), b);
  }
  return out;
}

template <class Block, void (*Dequantize)(const Block*, size_t, float*)>
py::array_t<float> absmax_dequantize(const py::handle& blocks_h, const char* format) {
  const py::array blocks = typed(blocks_h, "blocks", py::dtype::of<uint8_t>(), "uint8");
  if (blocks.ndim() < 2 || blocks.shape(blocks.ndim() - 1) != static_cast<py::ssize_t>(sizeof(Block)))
    throw py::value_error(std::string("blocks must have shape (..., n / 32, ") + std::to_string(sizeof(Block)) + ") for " + format +
                          ", got " + shape_text(blocks));
  std::vector<py::ssize_t> shape;
  for (py::ssize_t i = 0; i + 2 < blocks.ndim(); ++i) shape.push_back(blocks.shape(i));
  shape.push_back(blocks.shape(blocks.ndim() - 2) * kAbsmaxBlock);
  py::array_t<float> out(shape);
  const size_t n = static_cast<size_t>(blocks.size()) / sizeof(Block) * kAbsmaxBlock;
  const Block* b = reinterpret_cast<const Block*>(blocks.data());
  float* y = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    Dequantize(b, n, y);
  }
  return out;
}

const char* kQuantizeDoc = R"(Quantizes float vectors along the last axis with the TurboQuant group quantizer.

x: float32 or float16 array [..., dim] (a C-contiguous float32 array is read in place).
bits: 1..8. group_size: values per scale (divides dim). seed: the rotation's sign seed.
grid: "uniform", "lloyd_max" or "lloyd_absmax" (default: uniform at 8 bits, lloyd_absmax below).
fit: "plain", "norm_correction" (default) or "least_squares". rotation: "dim", "group" or "none".
codebook: "gaussian" or "sphere". layout: "planes" (default) or "stream" (docs/FORMATS.md).
Returns (codes uint8 [..., code_bytes], scales float16 [..., dim / group_size]), the bytes the C++
codec writes. Bad shapes, dtypes and parameters raise ValueError naming them.)";

}  // namespace

void bind_codec(py::module_& m) {
  py::class_<Quantizer>(m, "Quantizer", R"(A TurboQuant group quantizer for vectors of `dim` values (codec/group_quantizer.h):
rotate, one scale per group, nearest level, pack. Same parameters as turboquant.codec.quantize.)")
      .def(py::init([](int dim, int bits, int group_size, uint64_t seed, std::optional<std::string> grid, std::optional<std::string> fit,
                       const std::string& rotation, const std::string& codebook, const std::string& layout) {
             return Quantizer(dim, make_options(bits, group_size, seed, grid, fit, rotation, codebook, layout));
           }),
           py::arg("dim"), py::arg("bits"), py::arg("group_size") = 64, py::arg("seed") = 42, py::arg("grid") = py::none(),
           py::arg("fit") = py::none(), py::arg("rotation") = "dim", py::arg("codebook") = "gaussian", py::arg("layout") = "planes")
      .def("quantize", [](const Quantizer& q, const py::handle& x, const py::object& out) { return q.quantize(x, false, out); }, py::arg("x"),
           py::arg("out") = py::none(),
           "x [..., dim] float32/float16 -> (codes uint8 [..., code_bytes], scales float16 [..., groups]); out=(codes, scales) "
           "writes into arrays of exactly that shape and dtype.")
      .def("quantize_rotated", [](const Quantizer& q, const py::handle& x) { return q.quantize(x, true); }, py::arg("y"),
           "Like quantize, for vectors already in the rotated domain (no rotation applied).")
      .def("dequantize", [](const Quantizer& q, const py::handle& c, const py::handle& s, const py::object& out) { return q.dequantize(c, s, false, out); },
           py::arg("codes"), py::arg("scales"), py::arg("out") = py::none(),
           "(codes, scales) -> float32 [..., dim] in the original domain; out= writes into a float32 array of that shape.")
      .def("dequantize_rotated", [](const Quantizer& q, const py::handle& c, const py::handle& s) { return q.dequantize(c, s, true); },
           py::arg("codes"), py::arg("scales"), "(codes, scales) -> float32 [..., dim] left in the rotated domain (what fused attention reads).")
      .def_property_readonly("dim", [](const Quantizer& q) { return q.q().dim(); }, "Values per vector.")
      .def_property_readonly("bits", [](const Quantizer& q) { return q.q().bits(); }, "Bits per code.")
      .def_property_readonly("group_size", [](const Quantizer& q) { return q.q().group_size(); }, "Values per scale.")
      .def_property_readonly("groups", [](const Quantizer& q) { return q.q().groups(); }, "Scales per vector.")
      .def_property_readonly("code_bytes", [](const Quantizer& q) { return q.q().code_bytes(); }, "Bytes of codes per vector.")
      .def_property_readonly("bits_per_value", [](const Quantizer& q) { return q.q().bits_per_value(); }, "Codes and scales, in bits per value.")
      .def_property_readonly("levels", [](const Quantizer& q) { return q.table(q.q().levels(), q.q().level_count()); },
                             "Reconstruction levels [2^bits] in the stored-scale domain: x_rot = scale * levels[code].")
      .def_property_readonly("thresholds", [](const Quantizer& q) { return q.table(q.q().thresholds(), q.q().level_count() - 1); },
                             "Decision thresholds between consecutive levels [2^bits - 1].")
      .def("__repr__", [](const Quantizer& q) { return "turboquant.codec.Quantizer(dim=" + std::to_string(q.q().dim()) + ", " + describe(q.q().options()) + ")"; });

  m.def("quantize",
        [](const py::handle& x, int bits, int group_size, uint64_t seed, std::optional<std::string> grid, std::optional<std::string> fit,
           const std::string& rotation, const std::string& codebook, const std::string& layout) {
          const py::array a = require_array(x, "x");
          const int dim = static_cast<int>(a.shape(a.ndim() - 1));
          return Quantizer(dim, make_options(bits, group_size, seed, grid, fit, rotation, codebook, layout)).quantize(x, false);
        },
        py::arg("x"), py::arg("bits"), py::arg("group_size") = 64, py::arg("seed") = 42, py::arg("grid") = py::none(),
        py::arg("fit") = py::none(), py::arg("rotation") = "dim", py::arg("codebook") = "gaussian", py::arg("layout") = "planes",
        kQuantizeDoc);
  m.def("dequantize",
        [](const py::handle& codes, const py::handle& scales, int bits, int group_size, uint64_t seed, std::optional<std::string> grid,
           std::optional<std::string> fit, const std::string& rotation, const std::string& codebook, const std::string& layout) {
          const py::array s = require_array(scales, "scales");
          const int dim = static_cast<int>(s.shape(s.ndim() - 1)) * group_size;
          return Quantizer(dim, make_options(bits, group_size, seed, grid, fit, rotation, codebook, layout)).dequantize(codes, scales, false);
        },
        py::arg("codes"), py::arg("scales"), py::arg("bits"), py::arg("group_size") = 64, py::arg("seed") = 42, py::arg("grid") = py::none(),
        py::arg("fit") = py::none(), py::arg("rotation") = "dim", py::arg("codebook") = "gaussian", py::arg("layout") = "planes",
        R"(The inverse of quantize: (codes uint8 [..., code_bytes], scales float16 [..., groups]) -> float32
[..., groups * group_size], with the parameters quantize was given.)");

  py::class_<Rotation>(m, "Rotation", R"(The randomized Hadamard rotation y = H diag(s) x / sqrt(n), blockwise (codec/rotation.h).
dim: values per vector; seed: the sign vector's seed; block: 0 takes the largest supported block dividing dim.)")
      .def(py::init([](int dim, uint64_t seed, int block) { return as_value_error([&] { return Rotation(dim, block, seed); }); }),
           py::arg("dim"), py::arg("seed") = 42, py::arg("block") = 0)
      .def("forward", [](const Rotation& r, const py::handle& x) { return rotate(r, x, true); }, py::arg("x"),
           "x float32/float16 [..., dim] -> the rotated vectors, float32 [..., dim] (a new array).")
      .def("inverse", [](const Rotation& r, const py::handle& x) { return rotate(r, x, false); }, py::arg("y"),
           "y float32/float16 [..., dim] -> the vectors rotated back, float32 [..., dim] (a new array).")
      .def_property_readonly("dim", &Rotation::dim, "Values per vector.")
      .def_property_readonly("block", &Rotation::block, "Values per independently rotated block.")
      .def_property_readonly("seed", &Rotation::seed, "The sign vector's seed.")
      .def_property_readonly("signs", [](const Rotation& r) { return vec(std::vector<float>(r.signs(), r.signs() + r.dim())); },
                             "The sign vector s [dim] (+1 or -1).");

  py::class_<Codebook>(m, "Codebook", "A Lloyd-Max scalar codebook (codec/codebook.h), in the unit-variance domain.")
      .def_readonly("bits", &Codebook::bits, "Bits per code (2^bits centroids).")
      .def_readonly("dim", &Codebook::dim, "The dimension of the sphere marginal (0 for the Gaussian).")
      .def_property_readonly("distribution", [](const Codebook& c) { return to_string(c.distribution); }, "gaussian or sphere.")
      .def_property_readonly("centroids", [](const Codebook& c) { return vec(c.centroids); }, "Centroids [2^bits], ascending.")
      .def_property_readonly("boundaries", [](const Codebook& c) { return vec(c.boundaries); }, "Cell boundaries [2^bits - 1].")
      .def_readonly("mse", &Codebook::mse, "Mean squared error on the unit-variance density.")
      .def_readonly("iterations", &Codebook::iterations, "Lloyd iterations until convergence.");
  m.def("codebook",
        [](int bits, const std::string& distribution, int dim) {
          return as_value_error([&]() -> const Codebook& {
            TQ_CHECK(bits >= 1 && bits <= 8, "bits must be 1..8, got ", bits);
            return lloyd_max_codebook(bits, parse_distribution(distribution), dim);
          });
        },
        py::return_value_policy::reference, py::arg("bits"), py::arg("distribution") = "gaussian", py::arg("dim") = 0,
        "The Lloyd-Max codebook for N(0, 1) (\"gaussian\") or one coordinate of a random unit vector in `dim` dimensions (\"sphere\").");
  m.def("absmax_codebook",
        [](int bits, int group) {
          return as_value_error([&]() -> const Codebook& {
            TQ_CHECK(bits >= 1 && bits <= 8, "bits must be 1..8, got ", bits);
            TQ_CHECK(group >= 2, "group must be at least 2, got ", group);
            return absmax_codebook(bits, group);
          });
        },
        py::return_value_policy::reference, py::arg("bits"), py::arg("group") = 64,
        "The codebook for values divided by their group's largest magnitude (the lloyd_absmax grid).");

  m.def("quantize_q8_0", [](const py::handle& x) { return absmax_quantize<BlockQ8_0, quantize_q8_0>(x, "q8_0"); }, py::arg("x"),
        "llama.cpp's q8_0: x float32/float16 [..., n] (n a multiple of 32) -> uint8 blocks [..., n / 32, 34] (binary16 scale, 32 int8).");
  m.def("dequantize_q8_0", [](const py::handle& b) { return absmax_dequantize<BlockQ8_0, dequantize_q8_0>(b, "q8_0"); }, py::arg("blocks"),
        "uint8 q8_0 blocks [..., nb, 34] -> float32 [..., nb * 32].");
  m.def("quantize_q4_0", [](const py::handle& x) { return absmax_quantize<BlockQ4_0, quantize_q4_0>(x, "q4_0"); }, py::arg("x"),
        "llama.cpp's q4_0: x float32/float16 [..., n] (n a multiple of 32) -> uint8 blocks [..., n / 32, 18] (binary16 scale, 16 bytes of nibbles).");
  m.def("dequantize_q4_0", [](const py::handle& b) { return absmax_dequantize<BlockQ4_0, dequantize_q4_0>(b, "q4_0"); }, py::arg("blocks"),
        "uint8 q4_0 blocks [..., nb, 18] -> float32 [..., nb * 32].");
  m.def("simd_target", [] { return std::string(kernels::chosen_target_name()); }, "The SIMD target the codec kernels dispatch to (AVX3_DL, AVX2, ...).");
}

}  // namespace tq::python
