// The parts of the _turboquant extension (module.cc puts them together).
#pragma once

#include <pybind11/pybind11.h>

namespace tq::python {

void bind_codec(pybind11::module_& m);    // turboquant.codec (codec.cc)
void bind_runtime(pybind11::module_& m);  // models, generation, prompt caches (runtime.cc)

}  // namespace tq::python
