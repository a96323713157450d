// The per-call lane of abp/_eager.py in C++: a one-input operator's forward, and its backward as an
// autograd node of its own, so that neither direction enters Python; and the affine norms' (a
// dense input and per-column gain and bias, abp/_affine_norm.py) on the same plans. The module
// also holds the sampled layers' row plan (abp/_row_plan.cpp).
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
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#if defined(ABP_PLAN_LANE_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;
using torch::autograd::variable_list;

namespace {

// abp_kernel_launch (abp.h), reached through the address ctypes resolved in the loaded libabp.so,
// so that this module links against torch only.
using LaunchEntry = int (*)(void *kernel, int device, void **args, int nargs, int64_t n, void *stream);

// Where a kernel argument or a produced value comes from (abp._eager's _INPUT ... _COLSUM).
enum Source : int64_t { kInput = 0, kParam = 1, kResult = 2, kResidual = 3, kGrad = 4, kColsum = 5 };
// What a backward argument must be (abp._eager.Plan.backward_checks' layouts).
enum Check : int64_t { kDense = 0, kPacked = 1, kRows = 2, kF32 = 3, kI64 = 4, kCols = 5 };

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
  int64_t inputs = 1;   // the dense input, then per-column ones (one value per column each)
  int64_t params = 0;
  bool rows = false;
  Pairs forward_args;   // (kInput, index) or (kParam, index)
  std::vector<bool> forward_i64;
  Pairs produces;       // (kind, index) per produced value: outputs first, then residuals
  int64_t outputs = 0;
  std::vector<int64_t> forward_allocs, backward_allocs;  // packed bits; 0: one per row; -1: dense
  Pairs backward_args;    // (kResidual or kGrad, index)
  Pairs backward_checks;  // (Check, packed bits)
  // A per-column input's gradient: a backward value (kResult or kGrad 0) summed over the rows.
  Pairs col_sums;
  // One gradient per input: (kResult, 0) for the dense input's, then (kColsum, index).
  Pairs backward_produces;
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

// The forward kernel on contiguous inputs (x, then the per-column ones, checked by the caller):
// (outputs, residuals).
std::pair<std::vector<torch::Tensor>, std::vector<Residual>> runForward(const Plan &plan,
                                                                      const std::vector<torch::Tensor> &inputs,
                                                                      const std::vector<Param> &params, int device,
                                                                      void *stream) {
  const torch::Tensor &x = inputs.at(0);
  const int64_t n = x.numel();
  std::vector<uint64_t> words;
  words.reserve(plan.forward_args.size() + plan.forward_allocs.size() + 2);
  for (size_t i = 0; i < plan.forward_args.size(); ++i) {
    const auto &source = plan.forward_args[i];
    if (source.first == kInput) {
      words.push_back(address(inputs[source.second]));
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
      value.tensor = source.first == kResult ? results[source.second] : inputs[source.second];
    }
    if (static_cast<int64_t>(i) < plan.outputs)
      outputs.push_back(value.tensor);
    else
      residuals.push_back(std::move(value));
  }
  return {std::move(outputs), std::move(residuals)};
}

const int64_t kFirstDim[] = {0};

// The backward kernel: one gradient per input, or none where Plan.backward would return None.
std::vector<torch::Tensor> runBackward(const Plan &plan, const std::vector<Residual> &residuals,
                                       const torch::Tensor &g, c10::IntArrayRef shape, c10::Device device_) {
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
    } else if (layout == kCols) {
      if (value.scalar_type() != plan.dtype || value.numel() != cols || value.is_neg())
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
  if (plan.col_sums.empty())
    return {results.at(0)};
  // As abp._launch._run sums them: over the rows, in the compute dtype (the launch dtype of a row
  // kernel). Over the leading dimensions as they are (a reshape is one more op per sum); one row
  // of a 1-d launch as a (1, cols) matrix, since a sum over no dimension would sum everything.
  std::vector<int64_t> leading;
  for (int64_t d = 0; d + 1 < static_cast<int64_t>(shape.size()); ++d)
    leading.push_back(d);
  std::vector<torch::Tensor> sums;
  for (const auto &source : plan.col_sums) {
    const torch::Tensor &value = source.first == kResult ? results[source.second] : grad;
    // (A dtype argument only where it differs: asked for, it costs the sum more host time.)
    const torch::Tensor rows2d = leading.empty() ? value.reshape({1, cols}) : value;
    const at::IntArrayRef dims = leading.empty() ? at::IntArrayRef(kFirstDim) : at::IntArrayRef(leading);
    torch::Tensor sum = value.scalar_type() == plan.compute ? rows2d.sum(dims) : rows2d.sum(dims, false, plan.compute);
    sums.push_back(sum.scalar_type() == plan.dtype ? sum : sum.to(plan.dtype));
  }
  std::vector<torch::Tensor> out;
  for (const auto &p : plan.backward_produces)
    out.push_back(p.first == kResult ? results[p.second] : sums[p.second]);
  return out;
}

// The lane's autograd nodes are torch::autograd::Node subclasses, as torch's own generated nodes
// are, not torch::autograd::Function: a Function keeps its state in a context (a map of IValues,
// a list of saved variables, output metadata) that cost 7 to 10 µs more per forward and backward
// than these nodes (bench/host_overhead.py's activation and norm rows, measured side by side on
// the CPU path). What Function::apply did around forward is done here: forward runs with grad mode off,
// the node exists only where a gradient is wanted, outputs get it as their grad_fn, tensors are
// saved as SavedVariables (so saved-tensor hooks, checkpointing and the "modified by an inplace
// operation" check apply), and an input carrying a forward-mode tangent, which no node here can
// propagate, is declined so that the Python lane raises.

using torch::autograd::isFwGradDefined;  // a forward-mode AD tangent (level 0, as torch's generated code asks)

// Nodes are held by std::shared_ptr up to some torch 2 release and by c10::intrusive_ptr after it
// (an Edge's `function` says which this torch uses). The helpers below are the one place that
// differs; names that exist in one API only are reached through template arguments, so the other
// branch is never instantiated.
using NodePtr = decltype(torch::autograd::Edge().function);

template <typename T, typename P = NodePtr>
struct NodeMaker;
template <typename T>
struct NodeMaker<T, std::shared_ptr<torch::autograd::Node>> {
  // deleteNode frees a long chain of nodes without recursing (torch's generated code uses it).
  static std::shared_ptr<T> make() {
    return std::shared_ptr<T>(new T(), [](T *node) { deleteNode(node); });
  }
};
template <typename T>
struct NodeMaker<T, c10::intrusive_ptr<torch::autograd::Node>> {
  static c10::intrusive_ptr<T> make() { return c10::make_intrusive<T>(); }
};

template <typename T>
auto makeNode() { return NodeMaker<T>::make(); }

// The owning pointer to `node` itself, which unpacking a saved output needs.
template <typename N>
auto selfOf(N *node, int) -> decltype(node->getptr()) { return node->getptr(); }
template <typename N>
auto selfOf(N *node, long) -> decltype(node->shared_from_this()) { return node->shared_from_this(); }

// Makes `node` the grad_fn of each output (an output of a type that cannot have a gradient gets
// none, as Function::apply leaves it), after it took its next edges.
void attach(const NodePtr &node, variable_list &outputs) {
  for (auto &out : outputs) {
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type()))
      torch::autograd::set_history(out, node);
    else
      node->add_input_metadata(torch::autograd::Node::undefined_input());
  }
}

bool isOneOf(const torch::Tensor &t, const variable_list &outputs) {
  for (const auto &out : outputs)
    if (out.defined() && out.unsafeGetTensorImpl() == t.unsafeGetTensorImpl())
      return true;
  return false;
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

// A one-input operator's backward (Plan.backward), and what it needs of forward.
struct PlanNode : public torch::autograd::Node {
  const Plan *plan = nullptr;  // plans live as long as the process (makePlan)
  std::vector<torch::autograd::SavedVariable> saved;  // the tensor residuals, in order
  std::vector<char> is_tensor;
  std::vector<double> scalars;
  std::vector<int64_t> shape;
  c10::Device device = c10::Device(c10::DeviceType::CPU);

  std::string name() const override { return "abp::" + plan->op + "Backward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto &v : saved)
      v.reset_data();
  }

  variable_list apply(variable_list &&grads) override {
    checkGradients(plan->op, grads);
    std::vector<Residual> residuals(is_tensor.size());
    size_t t = 0, s = 0;
    for (size_t i = 0; i < residuals.size(); ++i) {
      residuals[i].is_tensor = is_tensor[i] != 0;
      if (residuals[i].is_tensor)
        residuals[i].tensor = saved[t++].unpack(selfOf(this, 0));
      else
        residuals[i].scalar = scalars[s++];
    }
    // Under backward(create_graph=True) the general path makes a second backward fail loudly
    // (once_differentiable); so do several output gradients and anything runBackward refuses.
    torch::Tensor dx;
    if (grads.size() == 1 && !torch::GradMode::is_enabled()) {
      std::vector<torch::Tensor> dxs = runBackward(*plan, residuals, grads[0], shape, device);
      if (!dxs.empty())
        dx = dxs[0];
    }
    if (!dx.defined())
      dx = generalBackward(*plan, residuals, grads, shape, device);
    return {dx};
  }
};

// Plan.forward and OperatorFunction.apply's autograd in one: the outputs, with a PlanNode as their
// grad_fn where the input wants a gradient.
variable_list planApply(const torch::Tensor &input, const std::shared_ptr<Plan> &plan,
                        const std::vector<Param> &params) {
  int device;
  void *stream;
  deviceAndStream(input, &device, &stream);  // run() took only devices it serves
  std::pair<std::vector<torch::Tensor>, std::vector<Residual>> done;
  {
    torch::NoGradGuard no_grad;  // as a Function's forward runs
    done = runForward(*plan, {input.resolve_neg().contiguous()}, params, device, stream);
  }
  variable_list &outputs = done.first;
  if (!torch::GradMode::is_enabled() || !input.requires_grad())
    return outputs;
  auto node = makeNode<PlanNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  attach(node, outputs);
  node->plan = plan.get();
  for (const auto &r : done.second) {
    node->is_tensor.push_back(r.is_tensor);
    if (r.is_tensor)
      node->saved.emplace_back(r.tensor, isOneOf(r.tensor, outputs));
    else
      node->scalars.push_back(r.scalar);
  }
  node->shape = input.sizes().vec();
  node->device = input.device();
  return outputs;
}

std::shared_ptr<Plan> makePlan(std::string op, uint64_t launch_entry, uint64_t forward_kernel, uint64_t backward_kernel,
                               const torch::Tensor &dtype_of, const torch::Tensor &compute_of, int64_t inputs,
                               int64_t params, bool rows,
                               Pairs forward_args, Pairs produces, int64_t outputs,
                               std::vector<int64_t> forward_allocs, Pairs backward_args, Pairs backward_checks,
                               std::vector<int64_t> backward_allocs, Pairs col_sums, Pairs backward_produces,
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
  plan->inputs = inputs;
  plan->params = params;
  plan->rows = rows;
  if (inputs < 1 || (inputs > 1 && !rows))
    throw std::invalid_argument("plan: one dense input, and per-column ones only in a row kernel");
  // A parameter's index is 2 * index + 1 for an i64 argument, 2 * index for an f32 one.
  for (const auto &a : forward_args) {
    if (a.first != kInput && a.first != kParam)
      throw std::invalid_argument("plan: a forward argument is an input or a parameter");
    if (a.second < 0 || a.second >= (a.first == kParam ? 2 * params : inputs))
      throw std::invalid_argument("plan: forward argument index out of range");
    plan->forward_i64.push_back(a.first == kParam && (a.second & 1));
    plan->forward_args.emplace_back(a.first, a.first == kParam ? a.second >> 1 : a.second);
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
                          : p.first == kParam ? params : p.first == kInput ? inputs : 0;
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
  for (const auto &c : col_sums) {
    const int64_t bound = c.first == kResult ? static_cast<int64_t>(plan->backward_allocs.size())
                          : c.first == kGrad ? 1 : 0;
    if (c.second < 0 || c.second >= bound)
      throw std::invalid_argument("plan: column sum out of range");
  }
  if (plan->backward_kernel) {
    const bool one = backward_produces.size() == static_cast<size_t>(inputs) && !backward_produces.empty() &&
                     backward_produces[0] == std::make_pair(int64_t(kResult), int64_t(0));
    bool sums = one;
    for (size_t i = 1; sums && i < backward_produces.size(); ++i)
      sums = backward_produces[i].first == kColsum && backward_produces[i].second >= 0 &&
             backward_produces[i].second < static_cast<int64_t>(col_sums.size());
    if (!sums)
      throw std::invalid_argument("plan: backward produces the dense input's gradient, then a column sum per input");
  }
  plan->col_sums = std::move(col_sums);
  plan->backward_produces = std::move(backward_produces);
  plan->check_status = std::move(check_status);
  plan->general_backward = std::move(general_backward);
  return plan;
}

// The memory-sharing norms with their affine map (abp/_affine_norm.py's _AffineMSNorm, step for
// step, so that both lanes give the same bytes), on the plan of ms_<norm>_gain or _affine: x and
// the per-column gain (weight, with `offset` added in the kernel) and bias, cast to the launch
// dtype, go to one row kernel each way; the gain's and the bias's gradients are the backward's
// column sums. Saved: y (in the save dtype where given), the per-row statistic, and the caller's
// weight and bias as they are (a bias without a weight runs the affine plan with a gain of ones).
struct AffineState {
  const Plan *plan = nullptr;
  double eps = 0.0, offset = 0.0;
  at::ScalarType dtype = at::ScalarType::Float;  // x's (its gradient's)
  bool has_weight = false, has_bias = false;
};

// abp._affine_norm.backward_in_python, set once when the module loads; never released (a Python
// object must not be released after the interpreter finalizes).
py::object *affinePythonBackward = nullptr;

py::object tensorOrNone(const torch::Tensor &t) { return t.defined() ? py::cast(t) : py::none(); }

// `t` contiguous in `dtype`, with its values in memory (a negative-bit view resolved), without an
// op where it already is (this is every call's path).
torch::Tensor launchable(const torch::Tensor &t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous() && !t.is_neg())
    return t;
  return t.to(dtype).resolve_neg().contiguous();
}

// The per-column inputs of the plan's launch (index 0, the dense input, left undefined): the gain
// and, for the affine plan, the bias, contiguous in the launch dtype.
std::vector<torch::Tensor> columnInputs(const Plan &plan, const torch::Tensor &weight, const torch::Tensor &bias,
                                        int64_t columns, const torch::Tensor &like) {
  std::vector<torch::Tensor> inputs(1);
  inputs.push_back(weight.defined() ? launchable(weight, plan.dtype)
                                    : torch::ones({columns}, like.options().dtype(plan.dtype)));
  if (plan.inputs == 3)
    inputs.push_back(launchable(bias, plan.dtype));
  return inputs;
}

// The saved values in the plan's residual order: y (the shared output), the statistic, the
// per-column inputs and the parameters; false where a residual is none of these.
bool affineResiduals(const Plan &plan, const torch::Tensor &y, const torch::Tensor &statistic,
                     const std::vector<torch::Tensor> &inputs, const AffineState &state,
                     std::vector<Residual> *out) {
  const int64_t output = plan.produces.at(0).second;
  for (size_t i = plan.outputs; i < plan.produces.size(); ++i) {
    const auto &source = plan.produces[i];
    Residual value;
    value.is_tensor = source.first != kParam;
    if (source.first == kResult)
      value.tensor = source.second == output ? y : statistic;
    else if (source.first == kInput && source.second > 0)
      value.tensor = inputs.at(source.second);
    else if (source.first == kParam)
      value.scalar = source.second == 0 ? state.eps : state.offset;
    else
      return false;
    out->push_back(std::move(value));
  }
  return true;
}

// The affine norm's backward by the Python lane: under backward(create_graph=True), whose
// gradients it marks not differentiable (abp.autograd.once_only: the kernels' backward is not),
// and wherever the plan declines (a saved tensor a saved-tensor hook changed), which names what.
// `saved`: y, the statistic, then weight and bias where given; `needs`: their gradients wanted.
variable_list pythonBackward(const AffineState &state, const variable_list &saved, const variable_list &grads,
                             bool needs_weight, bool needs_bias, bool create_graph) {
  torch::Tensor weight = state.has_weight ? saved[2] : torch::Tensor();
  torch::Tensor bias = state.has_bias ? saved[state.has_weight ? 3 : 2] : torch::Tensor();
  variable_list out;
  py::gil_scoped_acquire gil;
  try {
    if (affinePythonBackward == nullptr)
      throw std::runtime_error("abp plan lane: the affine norms' Python backward is not set");
    py::tuple result = (*affinePythonBackward)(state.plan->op, state.eps, state.offset,
                                               torch::empty({0}, torch::dtype(state.dtype)), saved[0], saved[1],
                                               tensorOrNone(weight), tensorOrNone(bias), grads[0],
                                               state.has_weight && needs_weight, state.has_bias && needs_bias,
                                               create_graph);
    for (int i = 0; i < 3; ++i)
      out.push_back(result[i].is_none() ? torch::Tensor() : result[i].cast<torch::Tensor>());
  } catch (py::error_already_set &e) {
    rethrow(e);
  }
  return out;
}

// The affine norm's backward (_AffineMSNorm.backward): next edges x, weight, bias (an invalid edge
// for one not given), so apply returns one gradient for each.
struct AffineNode : public torch::autograd::Node {
  AffineState state;
  torch::autograd::SavedVariable y, statistic, weight, bias;  // weight, bias: undefined where not given
  std::vector<int64_t> out_shape;  // y's, for a gradient to materialise as zeros
  at::TensorOptions out_options;

  std::string name() const override { return "abp::" + state.plan->op + "Backward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    y.reset_data();
    statistic.reset_data();
    weight.reset_data();
    bias.reset_data();
  }

  variable_list apply(variable_list &&grads) override {
    checkGradients(state.plan->op, grads);
    if (!grads[0].defined())  // as Function materialised it: zeros of y's shape
      grads[0] = torch::zeros(out_shape, out_options);
    auto self = selfOf(this, 0);
    variable_list saved = {y.unpack(self), statistic.unpack(self)};
    if (state.has_weight)
      saved.push_back(weight.unpack(self));
    if (state.has_bias)
      saved.push_back(bias.unpack(self));
    const bool needs_weight = task_should_compute_output(1), needs_bias = task_should_compute_output(2);
    if (torch::GradMode::is_enabled())  // backward(create_graph=True): the Python lane's, marked
      return pythonBackward(state, saved, grads, needs_weight, needs_bias, /*create_graph=*/true);
    const Plan &plan = *state.plan;
    const torch::Tensor w = state.has_weight ? saved[2] : torch::Tensor();
    const torch::Tensor b = state.has_bias ? saved[state.has_weight ? 3 : 2] : torch::Tensor();
    const torch::Tensor &dy = grads[0];
    // The launch dtype's y (a save dtype's or an autocast output's copy), as the kernel reads it.
    torch::Tensor yl = launchable(saved[0], plan.dtype);
    std::vector<torch::Tensor> launched = columnInputs(plan, w, b, yl.dim() ? yl.size(-1) : 1, yl);
    std::vector<Residual> residuals;
    std::vector<torch::Tensor> out;
    if (affineResiduals(plan, yl, saved[1], launched, state, &residuals))
      out = runBackward(plan, residuals, dy.scalar_type() == plan.dtype ? dy : dy.to(plan.dtype), yl.sizes(),
                        yl.device());
    if (out.empty())  // what the plan does not take (a statistic a saved-tensor hook changed): Python names it
      return pythonBackward(state, saved, grads, needs_weight, needs_bias, /*create_graph=*/false);
    auto as = [](const torch::Tensor &t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); };
    variable_list result = {as(out[0], state.dtype), torch::Tensor(), torch::Tensor()};
    if (state.has_weight && needs_weight)
      result[1] = as(out[1], w.scalar_type());
    if (state.has_bias && needs_bias)
      result[2] = as(out.back(), b.scalar_type());
    return result;
  }
};

// _AffineMSNorm.apply's forward and autograd: y, with an AffineNode as its grad_fn where x, the
// weight or the bias wants a gradient. `weight` and `bias` may be undefined (not both).
torch::Tensor affineApply(const torch::Tensor &x, const torch::Tensor &weight, const torch::Tensor &bias,
                          const std::shared_ptr<Plan> &plan, double eps, double offset,
                          c10::optional<at::ScalarType> out_dtype, c10::optional<at::ScalarType> save_dtype) {
  torch::Tensor y, saved, statistic;
  {
    torch::NoGradGuard no_grad;  // as a Function's forward runs
    // Half-precision rows run in fp32: y is rounded once, as torch's norms do.
    std::vector<torch::Tensor> launched = columnInputs(*plan, weight, bias, x.size(-1), x);
    launched[0] = launchable(x, plan->dtype);
    int device;
    void *stream;
    deviceAndStream(launched[0], &device, &stream);
    auto done = runForward(*plan, launched, {paramOf(eps), paramOf(offset)}, device, stream);
    y = done.first.at(0);
    for (size_t i = plan->outputs; i < plan->produces.size(); ++i)
      if (plan->produces[i].first == kResult && plan->produces[i].second != plan->produces[0].second)
        statistic = done.second.at(i - plan->outputs).tensor;
    at::ScalarType target = out_dtype.has_value() ? *out_dtype : x.scalar_type();
    if (target != y.scalar_type())
      y = y.to(target);
    // y is saved as the very tensor returned (the next Linear saves the same storage), or a copy
    // in the save dtype (abp/_affine_norm.py).
    saved = !save_dtype.has_value() || *save_dtype == y.scalar_type() ? y : y.to(*save_dtype);
  }
  if (!torch::GradMode::is_enabled() ||
      !(x.requires_grad() || (weight.defined() && weight.requires_grad()) || (bias.defined() && bias.requires_grad())))
    return y;
  auto node = makeNode<AffineNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
  variable_list outputs = {y};  // y itself: the same TensorImpl gets the grad_fn
  attach(node, outputs);
  node->y = torch::autograd::SavedVariable(saved, saved.unsafeGetTensorImpl() == y.unsafeGetTensorImpl());
  node->statistic = torch::autograd::SavedVariable(statistic, false);
  if (weight.defined())
    node->weight = torch::autograd::SavedVariable(weight, false);
  if (bias.defined())
    node->bias = torch::autograd::SavedVariable(bias, false);
  node->state.plan = plan.get();
  node->state.eps = eps;
  node->state.offset = offset;
  node->state.dtype = x.scalar_type();
  node->state.has_weight = weight.defined();
  node->state.has_bias = bias.defined();
  node->out_shape = y.sizes().vec();
  node->out_options = y.options();
  return y;
}

c10::optional<at::ScalarType> dtypeOf(const py::object &like) {
  if (like.is_none())
    return c10::nullopt;
  return like.cast<torch::Tensor>().scalar_type();
}

// A dtype of rows abp's norms take (abp._launch.ROW_DTYPES).
bool rowDtype(at::ScalarType t) {
  return t == torch::kFloat || t == torch::kHalf || t == torch::kBFloat16 || t == torch::kDouble;
}

// True where `t` is a per-column input the plan can read: None, or what abp.functional's
// _check_affine accepts for rows of x (a strided vector of a row dtype, one value per column, on
// x's device). Anything else takes the Python lane, whose checks name it.
bool columnInput(const torch::Tensor &t, const torch::Tensor &x) {
  return !t.defined() || (t.layout() == torch::kStrided && t.has_storage() && rowDtype(t.scalar_type()) &&
                          t.dim() == 1 && t.size(0) == x.size(-1) && t.device() == x.device());
}

// Whether autocast is on for x's device type, as abp._amp reads it (torch 2.4 asks by device type).
bool autocastOn(const torch::Tensor &x) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(x.device().type());
#else
  return x.is_cuda() ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

// _AffineMSNorm.apply in C++: y, or None where the plan does not serve the input (another compute
// dtype, a device this lane leaves to Python); `plan` is ms_<norm>_affine's where `bias` is given,
// else ms_<norm>_gain's; `weight` and `bias` are tensors or None (not both), the dtypes None or an
// empty tensor of that dtype. The caller has checked the arguments; with `unless_autocast`, an
// fp32 x under autocast is declined (abp.functional's fast path leaves that case, whose output
// dtype autocast decides, to its checks).
py::object affineNorm(const std::shared_ptr<Plan> &plan, const torch::Tensor &x, py::object weight, py::object bias,
                      double eps, double offset, py::object out_like, py::object save_like, bool unless_autocast) {
  int device;
  void *stream;
  if (plan->inputs != (bias.is_none() ? 2 : 3) || plan->params != 2 || !plan->rows || !plan->backward_kernel ||
      x.layout() != torch::kStrided || !x.has_storage() || x.dim() == 0 || !rowDtype(x.scalar_type()) ||
      torch::jit::tracer::isTracing() ||
      !deviceAndStream(x, &device, &stream))
    return py::none();
  const at::ScalarType compute = x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  if (compute != plan->dtype || (unless_autocast && x.scalar_type() == torch::kFloat && autocastOn(x)))
    return py::none();
  torch::Tensor w = weight.is_none() ? torch::Tensor() : weight.cast<torch::Tensor>();
  torch::Tensor b = bias.is_none() ? torch::Tensor() : bias.cast<torch::Tensor>();
  if ((!w.defined() && !b.defined()) || !columnInput(w, x) || !columnInput(b, x))
    return py::none();
  if (isFwGradDefined(x) || isFwGradDefined(w) || isFwGradDefined(b))
    return py::none();
  return py::cast(affineApply(x, w, b, plan, eps, offset, dtypeOf(out_like), dtypeOf(save_like)));
}

// Plan.forward and OperatorFunction.forward in one: the outputs (one tensor, or a tuple), or None
// where abp._eager.Plan.forward would return None or where the Python lane must decide (a
// parameter this lane cannot convert exactly, torch.jit tracing, which records Python functions
// but not this lane's launches). The caller then takes the Python lane.
py::object run(const std::shared_ptr<Plan> &plan, const torch::Tensor &input, const py::tuple &params) {
  int device;
  void *stream;
  if (plan->inputs != 1 || input.scalar_type() != plan->dtype || static_cast<int64_t>(params.size()) != plan->params ||
      input.layout() != torch::kStrided || !input.has_storage() || (plan->rows && input.dim() == 0) ||
      torch::jit::tracer::isTracing() || isFwGradDefined(input) || !deviceAndStream(input, &device, &stream))
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
  variable_list outputs = planApply(input, plan, values);
  if (outputs.size() == 1)
    return py::cast(outputs[0]);
  py::tuple out(outputs.size());  // several outputs: a tuple, as OperatorFunction returns them
  for (size_t i = 0; i < outputs.size(); ++i)
    out[i] = py::cast(outputs[i]);
  return out;
}

}  // namespace

namespace abp_lane {
void defineRowPlan(py::module &m);  // abp/_row_plan.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "abp's per-call lane in C++ (abp/_plan_lane.cpp), built against this torch";
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan").def_readonly("op", &Plan::op);
  m.def("make_plan", &makePlan);
  m.def("run", &run, py::arg("plan"), py::arg("input"), py::arg("params"));
  m.def("set_affine_backward", [](py::object fn) {
    if (affinePythonBackward == nullptr)
      affinePythonBackward = new py::object(std::move(fn));
  });
  m.def("affine_norm", &affineNorm, py::arg("plan"), py::arg("input"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"), py::arg("offset"), py::arg("out_like"), py::arg("save_like"), py::arg("unless_autocast"));
  abp_lane::defineRowPlan(m);
}
