// _turboquant: the compiled half of the Python package (python/turboquant wraps it). tq::Error arrives in
// Python as turboquant.Error (a RuntimeError) with the C++ message unchanged; a std::exception as
// RuntimeError, also with its message.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "core/error.h"

PYBIND11_MODULE(_turboquant, m) {
  m.doc() = "turboquant.cpp's C++ runtime and codec (use the turboquant package, which wraps this module)";
  auto error = pybind11::register_exception<tq::Error>(m, "Error", PyExc_RuntimeError);
  error.attr("__doc__") = "An error of the C++ runtime (tq::Error), with its message unchanged: bad input, a file that is not what it should be, "
                          "a request the engine refuses.";
  pybind11::module_ codec = m.def_submodule("codec", "The TurboQuant codec on NumPy arrays (src/codec)");
  tq::python::bind_codec(codec);
  tq::python::bind_runtime(m);
}
