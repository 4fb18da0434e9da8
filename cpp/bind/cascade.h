// bind/cascade.h: the cascade's binding (cpp/src/cascade.h): the groups of a step's tables.
#pragma once
#include <pybind11/pybind11.h>

void bind_cascade(pybind11::module_& m);
