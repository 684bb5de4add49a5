// errors.h: the planner's errors, one type per cause.  Python twin:
// graphscale/_core/errors.py (InternalError, internal_assert).
//
// Each derives from the std exception that the Python binding's own
// translation turns into the Python error graphscale's callers catch or
// report: TooManyFactors -> OverflowError (graphscale/_backward/decide.py
// plan_backward falls back to the Python planner; govern.h declines
// "factors"), BadInput -> ValueError, BrokenInvariant -> RuntimeError.  The
// Python-facing layer (python_planner.h) registers no translator of its own.
#pragma once

#include <stdexcept>
#include <string>

namespace graphscale::planner {

// More than 64 distinct pin values: the native planner declines the plan.
struct TooManyFactors : std::overflow_error {
  TooManyFactors() : std::overflow_error("graphscale: more than 64 distinct factors; native planner declines") {}
};

// What the caller handed over does not fit (sizes that differ, an unknown policy).
struct BadInput : std::invalid_argument {
  explicit BadInput(const std::string& what) : std::invalid_argument("graphscale: " + what) {}
};

// A bug in graphscale (the grad_fn graph has a cycle).
struct BrokenInvariant : std::runtime_error {
  explicit BrokenInvariant(const std::string& what)
      : std::runtime_error("graphscale: internal invariant broken: " + what + ". This is a bug in graphscale.") {}
};

}  // namespace graphscale::planner
