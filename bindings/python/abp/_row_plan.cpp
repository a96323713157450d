// The sampled linear layers' row plan in C++: abp.sampling.plan_rows after its two kernels (the
// row norms and the Philox draws), i.e. abp._selection's integer_masses, uniforms48 and
// plan_slots, as one call of the C++ lane's module (abp/_plan_lane.py builds this file with
// _plan_lane.cpp).
//
// The plan is about sixty tensor ops on a few vectors; from Python each op is also an interpreter
// step and an argument parse, which made the plan most of SampledLinear's host time
// (bench/host_overhead.py). Here the same ATen ops run in the same order with the same operand
// kinds (a Python float is a Scalar here, a tensor a tensor), so every value is the Python
// lane's bit for bit, on every device, and still made without a host synchronisation
// (tests/python/test_row_plan.py). The reasoning behind each step (whole-number masses whose
// sums are exact, the winners' objective, the draws) is in abp/_selection.py's docstrings; the
// comments here only name the Python function a block mirrors.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

namespace py = pybind11;

namespace abp_lane {
namespace {

using torch::Tensor;

// integer_masses' masses(v): ceil(v / max(v) · scale), or 1 everywhere when max(v) is not > 0.
Tensor masses(const Tensor &v, double scale) {
  Tensor top = v.max();
  Tensor positive = top > 0;
  return at::where(positive, at::ceil(v / at::where(positive, top, 1.0) * scale), 1.0);
}

// _selection.integer_masses(scores, other, floor): (masses, usable).
std::pair<Tensor, Tensor> integerMasses(const Tensor &scores, const c10::optional<Tensor> &other, double floor) {
  Tensor x = scores.to(at::kDouble);
  const int64_t n = x.numel();
  int bits = 0;  // Python's int.bit_length()
  for (int64_t v = n; v > 0; v >>= 1)
    ++bits;
  const double scale = std::ldexp(1.0, 48 - bits);
  Tensor usable = (x >= 0).all();
  const double largest = std::numeric_limits<double>::max();
  x = at::nan_to_num(x, std::numeric_limits<double>::quiet_NaN(), largest, largest);
  Tensor a = masses(x, scale);
  if (!other.has_value())
    return {a, usable};
  Tensor xg = x * other->to(x.device(), at::kDouble);
  Tensor informative = at::isfinite(xg).all() & (xg >= 0).all() & (xg.max() > 0);
  Tensor b = masses(at::where(informative, xg, x), scale);
  const double f = std::max(floor, 1e-8);  // _selection.SMOOTHING
  Tensor mixed = at::ceil(((b / b.sum()) * (1.0 - f) + (a / a.sum()) * f) * scale);
  return {at::where(informative, mixed, a), usable};
}

// _selection.uniforms48(u): k uniforms of 48 bits from 2k draws of 24.
Tensor uniforms48(const Tensor &u) {
  const int64_t k = u.numel() / 2;
  return u.slice(0, 0, k).to(at::kDouble) + u.slice(0, k, 2 * k).to(at::kDouble) * std::ldexp(1.0, -24);
}

// _selection._draw(masses, u): rows drawn with probability masses_j / Σ masses.
Tensor draw(const Tensor &m, const Tensor &u) {
  Tensor cdf = at::cumsum(m, 0);
  Tensor j = at::searchsorted(cdf, at::floor(u * cdf.select(0, -1)), /*out_int32=*/false, /*right=*/true);
  Tensor rows = at::arange(m.numel(), m.options().dtype(at::kLong));
  return at::minimum(j, (rows * (m > 0)).max());
}

// _selection._winners(sorted_masses, total, k): the WTA-CRS winner count, a 0-d int64 tensor.
Tensor winners(const Tensor &sorted, const Tensor &total, int64_t k) {
  Tensor top = sorted.slice(0, 0, std::min<int64_t>(k, sorted.numel()));
  Tensor q = at::cumsum(top, 0) - top;
  if (top.numel() < k)
    q = at::cat({q, total.reshape(1)});
  Tensor c = at::arange(q.numel(), q.options().dtype(at::kDouble));
  Tensor objective = (total - q) / at::rsub(c, k);
  Tensor near = objective <= objective.min() * (1.0 + 1e-12);
  return at::argmax(near.to(at::kByte));
}

// _selection.plan_slots(masses, usable, k, u, method): (index int32, weight float64, winners).
std::tuple<Tensor, Tensor, Tensor> planSlots(const Tensor &m, const Tensor &usable, int64_t k, const Tensor &draws,
                                             const std::string &method) {
  const int64_t n = m.numel();
  Tensor slots = at::arange(k, m.options().dtype(at::kLong));
  Tensor total = m.sum();
  Tensor count, index, weight;
  if (method == "wtacrs") {
    std::tuple<Tensor, Tensor> sorted = at::sort(m, /*stable=*/true, /*dim=*/0, /*descending=*/true);
    Tensor order = std::get<1>(sorted);
    count = winners(std::get<0>(sorted), total, k);
    Tensor rank = at::empty_like(order);
    rank.index_put_({order}, at::arange(n, order.options()));
    Tensor rest = at::where(rank < count, 0.0, m);
    Tensor mass = rest.sum();
    Tensor j = draw(rest, draws.index({(slots - count).clamp_min(0)}));
    Tensor drawn = at::where(mass > 0, mass / (at::rsub(count, k) * rest.index({j})), 0.0);
    Tensor won = slots < count;
    index = at::where(won, order.index({slots.clamp_max(n - 1)}), j);
    weight = at::where(won, 1.0, drawn);
  } else {  // "crs" and "uniform" (the caller passes only these three)
    count = at::zeros({}, m.options().dtype(at::kLong));
    index = draw(m, draws);
    weight = at::where(total > 0, total / (m.index({index}) * k), 0.0);
  }
  weight = at::where(usable, weight, std::numeric_limits<double>::quiet_NaN());
  return {index.to(at::kInt), weight, count};
}

// abp.sampling.plan_rows after its kernels: the k slots of `method` over the rows' norms (and
// gamma, one value per row, or None) from 2k float32 Philox draws `u`.
std::tuple<Tensor, Tensor, Tensor> rowPlan(const Tensor &norms, const c10::optional<Tensor> &gamma, const Tensor &u,
                                           int64_t k, const std::string &method, double floor) {
  std::pair<Tensor, Tensor> massesAndUsable = integerMasses(norms, gamma, floor);
  Tensor m = massesAndUsable.first;
  if (method == "uniform")
    m = at::where(at::isinf(norms), m, at::ones_like(m));
  return planSlots(m, massesAndUsable.second, k, uniforms48(u), method);
}

}  // namespace

void defineRowPlan(py::module &m) {
  m.def("row_plan", &rowPlan, py::arg("norms"), py::arg("gamma"), py::arg("u"), py::arg("k"), py::arg("method"),
        py::arg("floor"));
}

}  // namespace abp_lane
