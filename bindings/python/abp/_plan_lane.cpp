// The per-call lane of abp/_eager.py in C++: a one-input operator's forward and backward as a
// torch::autograd::Function, so that neither direction enters Python.
//
// Built on first use against the torch it runs in (abp/_plan_lane.py, torch.utils.cpp_extension),
// because torch's C++ ABI changes between releases: this is the one native file of abp that is
// compiled on the user's machine (docs/design.md, "The launch path"). A Plan holds what
// abp._eager.Plan resolved from the manifest (kernel addresses, where each argument comes from,
// what to allocate); run() and the backward below are the same straight-line code as
// Plan.forward and Plan.backward, and never decide an error: whatever they do not expect sends
// the call back to Python (run returns None; the backward calls the general path), which handles
// it or raises the error that names it. tests/python/test_plan_lane.py holds both lanes to the
// same bytes.
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(ABP_PLAN_LANE_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// abp_kernel_launch (abp.h), reached through the address ctypes resolved in the loaded libabp.so,
// so that this module links against torch only.
using LaunchEntry = int (*)(void *kernel, int device, void **args, int nargs, int64_t n, void *stream);

// Where a kernel argument or a produced value comes from (abp._eager's _INPUT ... _GRAD).
enum Source : int64_t { kInput = 0, kParam = 1, kResult = 2, kResidual = 3, kGrad = 4 };
// What a backward argument must be (abp._eager.Plan.backward_checks' layouts).
enum Check : int64_t { kDense = 0, kPacked = 1, kRows = 2, kF32 = 3, kI64 = 4 };

using Pairs = std::vector<std::pair<int64_t, int64_t>>;

// A parameter in both launch forms, as the Python lane converts it: `f` is float(value) (an f32
// argument takes its bits, a scalar residual keeps it), `i` is int(value) modulo 2^64 (an i64
// argument). A form marked not ok is one the Python lane would refuse or this lane cannot give
// exactly; a call that needs it takes the Python lane.
struct Param {
  double f = 0.0;
  uint64_t i = 0;
  bool f_ok = false, i_ok = false;
};

Param paramOf(double value) {
  Param p;
  p.f = value;
  p.f_ok = true;
  // int(value): truncation, for finite values within int64 (beyond it Python's int is exact and
  // this one is not).
  if (std::isfinite(value) && std::fabs(value) < 9223372036854775808.0) {
    p.i = static_cast<uint64_t>(static_cast<int64_t>(value));
    p.i_ok = true;
  }
  return p;
}

// Python ints and floats only (a numpy or 0-d tensor number takes the Python lane, which converts it).
bool paramOf(const py::handle &value, Param *out) {
  PyObject *o = value.ptr();
  if (PyFloat_CheckExact(o)) {
    *out = paramOf(PyFloat_AS_DOUBLE(o));
    return true;
  }
  if (!PyLong_CheckExact(o))
    return false;
  Param p;
  p.i = PyLong_AsUnsignedLongLongMask(o);  // as the launcher takes an int: modulo 2^64
  p.i_ok = !PyErr_Occurred();
  PyErr_Clear();
  p.f = PyLong_AsDouble(o);  // float(value): correctly rounded; OverflowError beyond the doubles
  p.f_ok = !PyErr_Occurred();
  PyErr_Clear();
  *out = p;
  return true;
}

// A residual as backward reads it: a tensor, or a scalar parameter.
struct Residual {
  bool is_tensor = false;
  torch::Tensor tensor;
  double scalar = 0.0;
};

struct Plan {
  std::string op;
  LaunchEntry launch = nullptr;
  void *forward_kernel = nullptr;
  void *backward_kernel = nullptr;  // null: no backward (the general path returns no gradients)
  at::ScalarType dtype, compute;
  int64_t params = 0;
  bool rows = false;
  Pairs forward_args;   // (kInput, 0) or (kParam, index); second of a param: 1 for i64, 0 for f32
  std::vector<bool> forward_i64;
  Pairs produces;       // (kind, index) per produced value: outputs first, then residuals
  int64_t outputs = 0;
  std::vector<int64_t> forward_allocs, backward_allocs;  // packed bits; 0: one per row; -1: dense
  Pairs backward_args;    // (kResidual or kGrad, index)
  Pairs backward_checks;  // (Check, packed bits)
  // A norm's plan (affine_norm): per residual, 0 for the normalised rows (the shared output), 1
  // for the per-row statistic; empty for other plans.
  std::vector<int64_t> norm_roles;
  py::object check_status;      // abp._lib.check: raises the runtime's error for a status
  // (saved, grads, shape, device string) -> the input's gradient by the general path
  py::object general_backward;
};

int64_t packedBytes(int64_t bits, int64_t n) { return (bits * n + 7) / 8; }

uint64_t f32Bits(double value) {
  // As C converts (IEEE: beyond the range, ±inf), which is what abp._launch._f32_bits gives.
  float f = static_cast<float>(value);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// (device index or -1 for the CPU path, stream handle), or false for a device this lane leaves
// to Python.
bool deviceAndStream(const torch::Tensor &t, int *device, void **stream) {
  if (t.device().is_cpu()) {
    *device = -1;
    *stream = nullptr;
    return true;
  }
#if defined(ABP_PLAN_LANE_CUDA)
  if (t.device().is_cuda()) {
    *device = t.device().index();
    *stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
    return true;
  }
#endif
  return false;
}

// Launches and, on a failed status, raises the runtime's error (its AbpError) through Python.
// Re-raises a Python error from backward so that torch's engine hands it to the caller as it is
// (its type included), as it does for a Python autograd.Function.
// A gradient without storage is a batched one (jacobian or hessian with vectorize=True vmaps the
// backward): abp's kernels read memory, so say so instead of "Cannot access data pointer".
// abp/autograd.py's raise_naming_batched says the same for the Python lane.
void checkGradients(const std::string &op, const variable_list &grads) {
  for (const auto &g : grads)
    if (g.defined() && g.layout() == torch::kStrided && !g.has_storage())
      throw std::runtime_error(
          op + ": its backward got a gradient that holds no memory (a batched tensor: jacobian or hessian with "
               "vectorize=True, or a torch.func / functorch transform over the backward); abp's backward runs its own "
               "kernels, which such transforms cannot batch. Use vectorize=False (the default), or torch's modules "
               "where a transform is needed");
}

[[noreturn]] void rethrow(py::error_already_set &e) {
  e.restore();
  throw python_error();
}

// Launches and, on a failed status, raises the runtime's error (its AbpError). Forward runs from
// Python, holding the GIL: it is released around the launch (as around torch's ops) and the
// error goes back through pybind11. Backward runs on the engine's thread without the GIL.
void launch(const Plan &plan, void *kernel, int device, int64_t n, void *stream, std::vector<uint64_t> &words,
            bool from_python) {
  std::vector<void *> pointers(words.size());
  for (size_t i = 0; i < words.size(); ++i)
    pointers[i] = &words[i];
  int status;
  if (from_python) {
    py::gil_scoped_release release;
    status = plan.launch(kernel, device, pointers.data(), static_cast<int>(words.size()), n, stream);
  } else {
    status = plan.launch(kernel, device, pointers.data(), static_cast<int>(words.size()), n, stream);
  }
  if (status != 0) {
    py::gil_scoped_acquire gil;
    try {
      plan.check_status(status);  // raises
    } catch (py::error_already_set &e) {
      if (from_python)
        throw;
      rethrow(e);
    }
    throw std::runtime_error(plan.op + ": abp_kernel_launch failed with status " + std::to_string(status));
  }
}

uint64_t address(const torch::Tensor &t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

std::vector<torch::Tensor> allocate(const Plan &plan, const std::vector<int64_t> &allocs, const torch::Tensor &like) {
  std::vector<torch::Tensor> out;
  out.reserve(allocs.size());
  const int64_t n = like.numel();
  for (int64_t bits : allocs) {
    if (bits > 0) {
      out.push_back(torch::empty({packedBytes(bits, n)}, like.options().dtype(torch::kUInt8)));
    } else if (bits == 0) {
      auto sizes = like.sizes();
      out.push_back(torch::empty(sizes.slice(0, sizes.size() - 1), like.options().dtype(plan.compute)));
    } else {
      out.push_back(torch::empty_like(like));  // `like` is contiguous, of the launch dtype
    }
  }
  return out;
}

int64_t rowsOf(c10::IntArrayRef shape) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i)
    rows *= shape[i];
  return rows;
}

// The forward kernel on a contiguous x: (outputs, residuals).
std::pair<std::vector<torch::Tensor>, std::vector<Residual>> runForward(const Plan &plan, const torch::Tensor &x,
                                                                      const std::vector<Param> &params, int device,
                                                                      void *stream) {
  const int64_t n = x.numel();
  std::vector<uint64_t> words;
  words.reserve(plan.forward_args.size() + plan.forward_allocs.size() + 2);
  for (size_t i = 0; i < plan.forward_args.size(); ++i) {
    const auto &source = plan.forward_args[i];
    if (source.first == kInput) {
      words.push_back(address(x));
    } else {
      const Param &value = params[source.second];  // run() checked the form this argument takes
      words.push_back(plan.forward_i64[i] ? value.i : f32Bits(value.f));
    }
  }
  std::vector<torch::Tensor> results = allocate(plan, plan.forward_allocs, x);
  int64_t count = n;
  if (plan.rows)
    count = rowsOf(x.sizes());
  if (count) {
    for (const auto &r : results)
      words.push_back(address(r));
    if (plan.rows) {
      words.push_back(static_cast<uint64_t>(count));
      words.push_back(static_cast<uint64_t>(x.sizes().back()));
    } else {
      words.push_back(static_cast<uint64_t>(n));
    }
    launch(plan, plan.forward_kernel, device, n, stream, words, /*from_python=*/true);
  }
  std::vector<torch::Tensor> outputs;
  std::vector<Residual> residuals;
  for (size_t i = 0; i < plan.produces.size(); ++i) {
    const auto &source = plan.produces[i];
    Residual value;
    if (source.first == kParam) {
      value.scalar = params[source.second].f;
    } else {
      value.is_tensor = true;
      value.tensor = source.first == kResult ? results[source.second] : x;
    }
    if (static_cast<int64_t>(i) < plan.outputs)
      outputs.push_back(value.tensor);
    else
      residuals.push_back(std::move(value));
  }
  return {std::move(outputs), std::move(residuals)};
}

// The backward kernel, or an undefined tensor where Plan.backward would return None.
torch::Tensor runBackward(const Plan &plan, const std::vector<Residual> &residuals, const torch::Tensor &g,
                          c10::IntArrayRef shape, c10::Device device_) {
  if (!plan.backward_kernel || !g.defined() || g.layout() != torch::kStrided || g.scalar_type() != plan.dtype ||
      g.sizes() != shape || g.device() != device_)
    return {};
  // resolve_neg: a negative-bit view holds the un-negated values in memory, which a kernel reads.
  torch::Tensor grad = g.resolve_neg().contiguous();
  int device;
  void *stream;
  if (!deviceAndStream(grad, &device, &stream))
    return {};
  const int64_t n = grad.numel();
  const int64_t cols = shape.empty() ? 1 : shape.back();
  const int64_t rows = plan.rows ? rowsOf(shape) : 0;
  std::vector<uint64_t> words;
  std::vector<torch::Tensor> keep;  // contiguous copies live until the launch
  for (size_t i = 0; i < plan.backward_args.size(); ++i) {
    const auto &source = plan.backward_args[i];
    const int64_t layout = plan.backward_checks[i].first, bits = plan.backward_checks[i].second;
    if (source.first == kGrad && source.second != 0)
      return {};  // the gradient of another output: one gradient is all this path takes
    const Residual *residual = source.first == kGrad ? nullptr : &residuals[source.second];
    if (layout == kF32 || layout == kI64) {  // a saved scalar (a parameter)
      if (residual == nullptr || residual->is_tensor)
        return {};
      if (layout == kI64) {
        const Param p = paramOf(residual->scalar);
        if (!p.i_ok)
          return {};  // int() of it fails or is beyond int64 in Python: the general path decides
        words.push_back(p.i);
      } else {
        words.push_back(f32Bits(residual->scalar));
      }
      continue;
    }
    if (residual != nullptr && !residual->is_tensor)
      return {};
    const torch::Tensor &value = residual == nullptr ? grad : residual->tensor;
    if (!value.defined() || !value.is_contiguous() || value.device() != device_)
      return {};
    if (layout == kDense) {
      if (value.scalar_type() != plan.dtype || value.numel() != n)
        return {};
    } else if (layout == kPacked) {
      if (value.scalar_type() != torch::kUInt8 || value.numel() < packedBytes(bits, n))
        return {};
    } else if (value.scalar_type() != plan.compute || value.numel() != rows) {
      return {};
    }
    words.push_back(address(value));
  }
  std::vector<torch::Tensor> results = allocate(plan, plan.backward_allocs, grad);
  if (plan.rows ? rows : n) {
    for (const auto &r : results)
      words.push_back(address(r));
    if (plan.rows) {
      words.push_back(static_cast<uint64_t>(rows));
      words.push_back(static_cast<uint64_t>(cols));
    } else {
      words.push_back(static_cast<uint64_t>(n));
    }
    launch(plan, plan.backward_kernel, device, n, stream, words, /*from_python=*/false);
  }
  return results.at(0);
}

// What a PlanFunction node keeps besides its saved tensors, in one capsule (one entry of the
// context's map instead of one per field: this is every call's path).
struct NodeState : torch::CustomClassHolder {
  const Plan *plan = nullptr;  // plans live as long as the process (makePlan)
  std::vector<char> is_tensor;
  std::vector<double> scalars;
  std::vector<int64_t> shape;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
};

const NodeState &stateOf(AutogradContext *ctx) {
  return *static_cast<const NodeState *>(ctx->saved_data.at("abp").toCapsule().get());
}

std::vector<Residual> residualsOf(AutogradContext *ctx, const NodeState &state) {
  variable_list tensors = ctx->get_saved_variables();
  std::vector<Residual> residuals(state.is_tensor.size());
  size_t t = 0, s = 0;
  for (size_t i = 0; i < residuals.size(); ++i) {
    residuals[i].is_tensor = state.is_tensor[i] != 0;
    if (residuals[i].is_tensor)
      residuals[i].tensor = tensors[t++];
    else
      residuals[i].scalar = state.scalars[s++];
  }
  return residuals;
}

// The input's gradient by the general path (abp._plan_lane.general_backward, in Python), which
// converts what it can and raises the error that names what it cannot.
torch::Tensor generalBackward(const Plan &plan, const std::vector<Residual> &residuals, const variable_list &grads,
                              c10::IntArrayRef shape, c10::Device device) {
  py::gil_scoped_acquire gil;
  try {
    py::list saved, grad_list;
    for (const auto &r : residuals)
      saved.append(r.is_tensor ? py::cast(r.tensor) : py::cast(r.scalar));
    for (const auto &g : grads)
      grad_list.append(g.defined() ? py::cast(g) : py::none());
    py::object out = plan.general_backward(saved, grad_list, py::cast(shape.vec()), device.str());
    return out.is_none() ? torch::Tensor() : out.cast<torch::Tensor>();
  } catch (py::error_already_set &e) {
    rethrow(e);
  }
}

struct PlanFunction : public torch::autograd::Function<PlanFunction> {
  // Runs with grad mode off (Function::apply), as a Python Function's forward does.
  static variable_list forward(AutogradContext *ctx, const torch::Tensor &input, const std::shared_ptr<Plan> &plan,
                               const std::vector<Param> &params) {
    int device;
    void *stream;
    deviceAndStream(input, &device, &stream);  // run() took only devices it serves
    // C++14: torch 1.13's extensions build with -std=c++14 (no structured bindings).
    auto done = runForward(*plan, input.resolve_neg().contiguous(), params, device, stream);
    auto state = c10::make_intrusive<NodeState>();
    state->plan = plan.get();
    std::vector<torch::Tensor> tensors;
    for (const auto &r : done.second) {
      state->is_tensor.push_back(r.is_tensor);
      if (r.is_tensor)
        tensors.push_back(r.tensor);
      else
        state->scalars.push_back(r.scalar);
    }
    state->shape = input.sizes().vec();
    state->device = input.device();
    ctx->save_for_backward(tensors);
    ctx->saved_data["abp"] = c10::IValue::make_capsule(std::move(state));
    ctx->set_materialize_grads(false);
    return done.first;
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const NodeState &state = stateOf(ctx);
    const Plan &plan = *state.plan;
    checkGradients(plan.op, grads);
    std::vector<Residual> residuals = residualsOf(ctx, state);
    const std::vector<int64_t> &shape = state.shape;
    const c10::Device device = state.device;
    // Under backward(create_graph=True) the general path makes a second backward fail loudly
    // (once_differentiable); so do several output gradients and anything runBackward refuses.
    torch::Tensor dx;
    if (grads.size() == 1 && !torch::GradMode::is_enabled())
      dx = runBackward(plan, residuals, grads[0], shape, device);
    if (!dx.defined())
      dx = generalBackward(plan, residuals, grads, shape, device);
    // One gradient per forward argument: the input's, none for the plan and the parameters.
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};

std::shared_ptr<Plan> makePlan(std::string op, uint64_t launch_entry, uint64_t forward_kernel, uint64_t backward_kernel,
                               const torch::Tensor &dtype_of, const torch::Tensor &compute_of, int64_t params,
                               bool rows,
                               Pairs forward_args, Pairs produces, int64_t outputs,
                               std::vector<int64_t> forward_allocs, Pairs backward_args, Pairs backward_checks,
                               std::vector<int64_t> backward_allocs, std::vector<int64_t> norm_roles,
                               py::object check_status, py::object general_backward) {
  // Nodes refer to their plan by address: plans live as long as the process, as the Python
  // plans they mirror do (cached on their operator, which is never replaced). Never destroyed:
  // a plan holds Python objects, which must not be released after the interpreter finalizes.
  static auto *plans = new std::vector<std::shared_ptr<Plan>>();
  auto plan = std::make_shared<Plan>();
  plans->push_back(plan);
  plan->op = std::move(op);
  plan->launch = reinterpret_cast<LaunchEntry>(launch_entry);
  plan->forward_kernel = reinterpret_cast<void *>(forward_kernel);
  plan->backward_kernel = reinterpret_cast<void *>(backward_kernel);
  plan->dtype = dtype_of.scalar_type();  // dtypes come as empty tensors: one caster on every torch
  plan->compute = compute_of.scalar_type();
  plan->params = params;
  plan->rows = rows;
  for (const auto &a : forward_args) {
    if (a.first != kInput && a.first != kParam)
      throw std::invalid_argument("plan: a forward argument is the input or a parameter");
    if (a.first == kParam && (a.second < 0 || a.second >= 2 * params))
      throw std::invalid_argument("plan: forward parameter index out of range");
    plan->forward_i64.push_back(a.first == kParam && (a.second & 1));
    plan->forward_args.emplace_back(a.first, a.first == kParam ? a.second >> 1 : 0);
  }
  plan->produces = std::move(produces);
  plan->outputs = outputs;
  plan->forward_allocs = std::move(forward_allocs);
  plan->backward_args = std::move(backward_args);
  plan->backward_checks = std::move(backward_checks);
  plan->backward_allocs = std::move(backward_allocs);
  if (!plan->launch || !plan->forward_kernel)
    throw std::invalid_argument("plan: null launch entry or forward kernel");
  if (plan->backward_args.size() != plan->backward_checks.size())
    throw std::invalid_argument("plan: backward arguments and checks differ in number");
  // Every index a launch follows is checked here, once: a plan never reads out of its vectors.
  const int64_t produced = static_cast<int64_t>(plan->produces.size());
  if (plan->outputs < 1 || plan->outputs > produced)
    throw std::invalid_argument("plan: output count out of range");
  for (const auto &p : plan->produces) {
    const int64_t bound = p.first == kResult ? static_cast<int64_t>(plan->forward_allocs.size())
                          : p.first == kParam ? params : p.first == kInput ? 1 : 0;
    if (p.second < 0 || p.second >= bound)
      throw std::invalid_argument("plan: produced value out of range");
  }
  for (const auto &a : plan->backward_args) {
    const int64_t bound = a.first == kResidual ? produced - plan->outputs : a.first == kGrad ? plan->outputs : 0;
    if (a.second < 0 || a.second >= bound)
      throw std::invalid_argument("plan: backward argument out of range");
  }
  if (plan->backward_kernel && plan->backward_allocs.empty())
    throw std::invalid_argument("plan: a backward kernel without a result");
  if (!norm_roles.empty()) {
    int found = 0;
    for (int64_t role : norm_roles)
      found |= role == 0 || role == 1 ? 1 << role : 4;
    if (found != 3 || static_cast<int64_t>(norm_roles.size()) != produced - plan->outputs || !plan->rows ||
        !plan->backward_kernel)
      throw std::invalid_argument("plan: norm roles are 0 (normalised rows) or 1 (statistic), one per residual");
  }
  plan->norm_roles = std::move(norm_roles);
  plan->check_status = std::move(check_status);
  plan->general_backward = std::move(general_backward);
  return plan;
}

// The memory-sharing norm with its affine map (abp/_affine_norm.py's _AffineMSNorm, op for op, so
// that both give the same bytes) around the row plan of the compute dtype:
// y = n * (weight + offset) + bias, saving y, the per-row statistic, weight and bias; backward
// recovers n = (y - bias) / gamma and hands dn = dy * gamma to the plan's backward kernel.
// `roles` says which of the plan's residuals is n (0) and which the statistic (1).
// What an AffineNormFunction node keeps besides its saved tensors.
struct AffineState : torch::CustomClassHolder {
  const Plan *plan = nullptr;
  double offset = 0.0;
  at::ScalarType dtype = at::ScalarType::Float;
  bool has_weight = false, has_bias = false;
};

// abp._affine_norm.backward_under_create_graph, set once when the module loads; never released
// (a Python object must not be released after the interpreter finalizes).
py::object *affineCreateGraph = nullptr;

py::object tensorOrNone(const torch::Tensor &t) { return t.defined() ? py::cast(t) : py::none(); }

// The affine norm's backward under backward(create_graph=True), by the Python lane, whose
// gradients are marked not differentiable (abp.autograd.once_only): the kernels' backward is not.
variable_list createGraphBackward(AutogradContext *ctx, const AffineState &state, const variable_list &grads) {
  variable_list saved = ctx->get_saved_variables();
  torch::Tensor weight = state.has_weight ? saved[2] : torch::Tensor();
  torch::Tensor bias = state.has_bias ? saved[state.has_weight ? 3 : 2] : torch::Tensor();
  variable_list out;
  {
    py::gil_scoped_acquire gil;
    try {
      if (affineCreateGraph == nullptr)
        throw std::runtime_error("abp plan lane: the create_graph backward of the affine norms is not set");
      py::tuple result = (*affineCreateGraph)(state.plan->op, state.offset,
                                              torch::empty({0}, torch::dtype(state.dtype)), saved[0], saved[1],
                                              tensorOrNone(weight), tensorOrNone(bias), grads[0],
                                              state.has_weight && ctx->needs_input_grad(1),
                                              state.has_bias && ctx->needs_input_grad(state.has_weight ? 2 : 1));
      out.push_back(result[0].is_none() ? torch::Tensor() : result[0].cast<torch::Tensor>());
      if (state.has_weight)
        out.push_back(result[1].is_none() ? torch::Tensor() : result[1].cast<torch::Tensor>());
      if (state.has_bias)
        out.push_back(result[2].is_none() ? torch::Tensor() : result[2].cast<torch::Tensor>());
    } catch (py::error_already_set &e) {
      rethrow(e);
    }
  }
  out.resize(out.size() + 7);
  return out;
}

struct AffineNormFunction : public torch::autograd::Function<AffineNormFunction> {
  // `inputs`: x, then weight and bias where given (an autograd Function takes no undefined tensor).
  static variable_list forward(AutogradContext *ctx, at::TensorList inputs, bool has_weight, bool has_bias,
                               const std::shared_ptr<Plan> &plan, double eps, double offset,
                               c10::optional<at::ScalarType> out_dtype, c10::optional<at::ScalarType> save_dtype) {
    const torch::Tensor &x = inputs[0];
    const torch::Tensor weight = has_weight ? inputs[1] : torch::Tensor();
    const torch::Tensor bias = has_bias ? inputs[has_weight ? 2 : 1] : torch::Tensor();
    torch::Tensor xc = x.to(plan->dtype).resolve_neg().contiguous();  // half-precision rows run in fp32: y rounds once
    int device;
    void *stream;
    deviceAndStream(xc, &device, &stream);
    auto done = runForward(*plan, xc, {paramOf(eps)}, device, stream);
    torch::Tensor n = done.first.at(0), r;
    for (size_t i = 0; i < done.second.size(); ++i)
      if (plan->norm_roles.at(i) == 1)
        r = done.second[i].tensor;
    torch::Tensor y = n;
    if (weight.defined())
      y = offset != 0.0 ? y * (weight.to(n.scalar_type()) + offset) : y * weight.to(n.scalar_type());
    if (bias.defined())
      y = y + bias.to(n.scalar_type());
    at::ScalarType target = out_dtype.has_value() ? *out_dtype : x.scalar_type();
    if (target != y.scalar_type())
      y = y.to(target);
    torch::Tensor saved = !save_dtype.has_value() || *save_dtype == y.scalar_type() ? y : y.to(*save_dtype);
    variable_list to_save = {saved, r};
    if (has_weight)
      to_save.push_back(weight);
    if (has_bias)
      to_save.push_back(bias);
    ctx->save_for_backward(to_save);
    auto state = c10::make_intrusive<AffineState>();
    state->plan = plan.get();
    state->offset = offset;
    state->dtype = x.scalar_type();
    state->has_weight = has_weight;
    state->has_bias = has_bias;
    ctx->saved_data["abp"] = c10::IValue::make_capsule(std::move(state));
    return {y};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const auto &state = *static_cast<const AffineState *>(ctx->saved_data.at("abp").toCapsule().get());
    checkGradients(state.plan->op, grads);
    if (torch::GradMode::is_enabled())  // backward(create_graph=True): the Python lane's, marked
      return createGraphBackward(ctx, state, grads);
    const Plan &plan = *state.plan;
    const double offset = state.offset;
    const at::ScalarType dtype = state.dtype;
    const bool has_weight = state.has_weight, has_bias = state.has_bias;
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &y = saved[0], &r = saved[1];
    const torch::Tensor weight = has_weight ? saved[2] : torch::Tensor();
    const torch::Tensor bias = has_bias ? saved[has_weight ? 3 : 2] : torch::Tensor();
    const torch::Tensor &dy = grads[0];
    const at::ScalarType compute = plan.dtype;
    torch::Tensor centred = y.to(compute);
    if (bias.defined())
      centred = centred - bias.to(compute);
    torch::Tensor dy_c = dy.to(compute), n, dn;
    if (weight.defined()) {
      torch::Tensor gamma = offset != 0.0 ? weight.to(compute) + offset : weight.to(compute);
      // A zero gamma makes n unrecoverable there (abp/_affine_norm.py); other features stay exact.
      n = centred / torch::where(gamma == 0, torch::ones_like(gamma), gamma);
      dn = dy_c * gamma;
    } else {
      n = centred;
      dn = dy_c;
    }
    n = n.contiguous();
    std::vector<Residual> residuals(plan.norm_roles.size());
    for (size_t i = 0; i < residuals.size(); ++i) {
      residuals[i].is_tensor = true;
      residuals[i].tensor = plan.norm_roles[i] == 0 ? n : r;
    }
    dn = dn.contiguous();
    torch::Tensor dx = runBackward(plan, residuals, dn, n.sizes(), n.device());
    if (!dx.defined())  // a statistic a saved-tensor hook changed: the general path names it
      dx = generalBackward(plan, residuals, {dn}, n.sizes(), n.device());
    dx = dx.to(dtype);
    std::vector<int64_t> rows;
    for (int64_t d = 0; d + 1 < dy.dim(); ++d)
      rows.push_back(d);
    // Summed over the rows; one row (a 1-d input) is its own sum (sum over no dimension sums all).
    auto overRows = [&](const torch::Tensor &t) { return rows.empty() ? t : t.sum(rows); };
    variable_list out = {dx};
    if (has_weight)
      out.push_back(ctx->needs_input_grad(1) ? overRows(dy_c * n).to(weight.scalar_type()) : torch::Tensor());
    if (has_bias)
      out.push_back(ctx->needs_input_grad(out.size()) ? overRows(dy_c).to(bias.scalar_type()) : torch::Tensor());
    // None for the seven other arguments (flags, plan, eps, offset, dtypes).
    out.resize(out.size() + 7);
    return out;
  }
};

c10::optional<at::ScalarType> dtypeOf(const py::object &like) {
  if (like.is_none())
    return c10::nullopt;
  return like.cast<torch::Tensor>().scalar_type();
}

// _AffineMSNorm.apply in C++: y, or None where the plan does not serve the input (another compute
// dtype, a device this lane leaves to Python); `weight` and `bias` are tensors or None, the
// dtypes None or an empty tensor of that dtype. The caller has checked the arguments.
py::object affineNorm(const std::shared_ptr<Plan> &plan, const torch::Tensor &x, py::object weight, py::object bias,
                      double eps, double offset, py::object out_like, py::object save_like) {
  int device;
  void *stream;
  if (plan->norm_roles.empty() || plan->params != 1 || x.layout() != torch::kStrided || !x.has_storage() ||
      x.dim() == 0 || torch::jit::tracer::isTracing() || !deviceAndStream(x, &device, &stream))
    return py::none();
  const at::ScalarType compute = x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  if (compute != plan->dtype)
    return py::none();
  torch::Tensor w = weight.is_none() ? torch::Tensor() : weight.cast<torch::Tensor>();
  torch::Tensor b = bias.is_none() ? torch::Tensor() : bias.cast<torch::Tensor>();
  variable_list inputs = {x};
  if (w.defined())
    inputs.push_back(w);
  if (b.defined())
    inputs.push_back(b);
  variable_list out = AffineNormFunction::apply(at::TensorList(inputs), w.defined(), b.defined(), plan, eps, offset, dtypeOf(out_like),
                                                dtypeOf(save_like));
  return py::cast(out[0]);
}

// Plan.forward and OperatorFunction.forward in one: the outputs (one tensor, or a tuple), or None
// where abp._eager.Plan.forward would return None or where the Python lane must decide (a
// parameter this lane cannot convert exactly, torch.jit tracing, which records Python functions
// but not this lane's launches). The caller then takes the Python lane.
py::object run(const std::shared_ptr<Plan> &plan, const torch::Tensor &input, const py::tuple &params) {
  int device;
  void *stream;
  if (input.scalar_type() != plan->dtype || static_cast<int64_t>(params.size()) != plan->params ||
      input.layout() != torch::kStrided || !input.has_storage() || (plan->rows && input.dim() == 0) ||
      torch::jit::tracer::isTracing() || !deviceAndStream(input, &device, &stream))
    return py::none();
  std::vector<Param> values(params.size());
  for (size_t i = 0; i < values.size(); ++i)
    if (!paramOf(params[i], &values[i]))
      return py::none();
  for (size_t i = 0; i < plan->forward_args.size(); ++i) {
    const auto &a = plan->forward_args[i];
    if (a.first == kParam && !(plan->forward_i64[i] ? values[a.second].i_ok : values[a.second].f_ok))
      return py::none();
  }
  for (const auto &p : plan->produces)
    if (p.first == kParam && !values[p.second].f_ok)
      return py::none();
  variable_list outputs = PlanFunction::apply(input, plan, values);
  if (outputs.size() == 1)
    return py::cast(outputs[0]);
  py::tuple out(outputs.size());  // several outputs: a tuple, as OperatorFunction returns them
  for (size_t i = 0; i < outputs.size(); ++i)
    out[i] = py::cast(outputs[i]);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "abp's per-call lane in C++ (abp/_plan_lane.cpp), built against this torch";
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan").def_readonly("op", &Plan::op);
  m.def("make_plan", &makePlan);
  m.def("run", &run, py::arg("plan"), py::arg("input"), py::arg("params"));
  m.def("set_affine_create_graph", [](py::object fn) {
    if (affineCreateGraph == nullptr)
      affineCreateGraph = new py::object(std::move(fn));
  });
  m.def("affine_norm", &affineNorm, py::arg("plan"), py::arg("input"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"), py::arg("offset"), py::arg("out_like"), py::arg("save_like"));
}
