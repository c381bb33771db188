// The per-step host work of ReplicatedAdam's device mode, in C++ (track_1_short/perf/host_step.py says what
// it replaces, why, and which Python class is its reference).
//
// Per Adam step the host reads every parameter's .grad (address, version, contiguity) and every parameter's
// config (lr, lr_mul, weight_decay, wd_mul, adam_betas, eps), counts the step in each active parameter's
// state dict and writes two small rows of numbers. Here that is a loop over TensorImpls and a few attribute
// reads through the C API, where Python paid a bound-method call and a boxed number per value.

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Rows of the per-step input table, in STEP_INPUTS order (perf/kernels/replicated_adam.py).
constexpr int64_t kInputRows = 6;
constexpr int kConfigValues = 4;  // lr, lr_mul, weight_decay, wd_mul: rows 0..3
constexpr int kStepRow = 4;
constexpr int kActiveRow = 5;
// stage_update()'s answers other than the index of a gradient changed in place (perf/host_step.py's
// STATIC_SAME and STATIC_CHANGED).
constexpr int64_t kStaticSame = -1;
constexpr int64_t kStaticChanged = -2;
const char* const kConfigNames[kConfigValues] = {"lr", "lr_mul", "weight_decay", "wd_mul"};

double to_double(PyObject* value) {
  const double out = PyFloat_AsDouble(value);
  if (out == -1.0 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return out;
}

double item_as_double(const py::handle& sequence, Py_ssize_t index) {
  py::object item = py::reinterpret_steal<py::object>(PySequence_GetItem(sequence.ptr(), index));
  if (!item) {
    throw py::error_already_set();
  }
  return to_double(item.ptr());
}

void check_row_buffer(const at::Tensor& buffer, at::ScalarType dtype, int64_t rows, int64_t n,
                      const char* what) {
  const bool shape_ok = rows == 1 ? (buffer.dim() == 1 && buffer.size(0) == n)
                                  : (buffer.dim() == 2 && buffer.size(0) == rows && buffer.size(1) == n);
  if (!buffer.device().is_cpu() || buffer.scalar_type() != dtype || !buffer.is_contiguous() || !shape_ok) {
    throw py::value_error(std::string(what) + ": expected a contiguous CPU tensor of " +
                          std::string(c10::toString(dtype)) + ", shape [" +
                          (rows == 1 ? "" : std::to_string(rows) + ", ") + std::to_string(n) + "], got " +
                          std::string(c10::toString(buffer.scalar_type())) + " " +
                          c10::str(buffer.sizes()) + " on " + buffer.device().str());
  }
}

// The CUDA driver's graph launch, looked up at run time: the extension is built without the CUDA toolkit, and
// on a machine without a driver nothing here is loaded until a replay is asked for.
using CuResult = int;
using CuGraphLaunch = CuResult (*)(void* graph_exec, void* stream);
using CuGetErrorString = CuResult (*)(CuResult, const char**);

struct Driver {
  CuGraphLaunch graph_launch = nullptr;
  CuGetErrorString error_string = nullptr;
};

const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library != nullptr) {
      d.graph_launch = reinterpret_cast<CuGraphLaunch>(dlsym(library, "cuGraphLaunch"));
      d.error_string = reinterpret_cast<CuGetErrorString>(dlsym(library, "cuGetErrorString"));
    }
    return d;
  }();
  if (loaded.graph_launch == nullptr) {
    throw std::runtime_error("replay: the CUDA driver (libcuda.so.1, cuGraphLaunch) could not be loaded");
  }
  return loaded;
}

// The current stream of CUDA device `device_index`, as the driver's handle (torch.cuda.current_stream()).
void* current_stream(int64_t device_index) {
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
  return cuda.getStream(device).native_handle();
}

// Launch an instantiated graph on `stream`: what torch.cuda.CUDAGraph.replay() does for a graph that holds no
// random-number work.
void launch_graph(const Driver& d, int64_t graph_exec, void* stream) {
  const CuResult result = d.graph_launch(reinterpret_cast<void*>(graph_exec), stream);
  if (result != 0) {
    const char* text = nullptr;
    if (d.error_string == nullptr || d.error_string(result, &text) != 0 || text == nullptr) {
      text = "unknown error";
    }
    throw std::runtime_error("replay: cuGraphLaunch failed with CUDA error " + std::to_string(result) + " (" +
                             text + ")");
  }
}

// A graph launch with every check that can fail before it made up front (a graph given, the driver found, the
// stream read), so that a caller can make them before it writes anything and launch after.
struct PreparedLaunch {
  const Driver* driver;
  int64_t graph_exec;
  void* stream;
  void operator()() const { launch_graph(*driver, graph_exec, stream); }
};

PreparedLaunch prepare_launch(int64_t graph_exec, int64_t device_index, const char* caller) {
  if (graph_exec == 0) {
    throw py::value_error(std::string(caller) + ": graph_exec is 0; pass CUDAGraph.raw_cuda_graph_exec()");
  }
  const Driver& d = driver();
  return PreparedLaunch{&d, graph_exec, current_stream(device_index)};
}

class HostStep {
 public:
  HostStep(const py::list& params, const py::list& cfgs, const py::list& states)
      : n_(static_cast<int64_t>(params.size())) {
    if (static_cast<int64_t>(cfgs.size()) != n_ || static_cast<int64_t>(states.size()) != n_) {
      throw py::value_error("HostStep: params, cfgs and states must have one entry per parameter");
    }
    for (int64_t i = 0; i < n_; ++i) {
      if (!THPVariable_Check(params[i].ptr())) {
        throw py::type_error("HostStep: parameter " + std::to_string(i) + " is not a torch.Tensor");
      }
      params_.push_back(py::reinterpret_borrow<py::object>(params[i]));
      cfgs_.push_back(py::reinterpret_borrow<py::object>(cfgs[i]));
      states_.push_back(py::reinterpret_borrow<py::object>(states[i]));
    }
    for (int k = 0; k < kConfigValues; ++k) {
      config_names_[k] = py::str(kConfigNames[k]);
    }
    betas_name_ = py::str("adam_betas");
    eps_name_ = py::str("eps");
    step_key_ = py::str("step");
    held_.resize(n_);
    addresses_.assign(n_, 0);
    versions_.assign(n_, 0);
    values_.assign(n_ * (kConfigValues + 3), 0.0);
    static_.assign(n_ * 3, 0.0);
  }

  // This step's gradients: hold them, note their addresses (0: none) and versions. Returns -1, or the index
  // of the first gradient that is not contiguous (then nothing is noted).
  int64_t read_gradients() {
    std::vector<at::Tensor> grads(n_);
    for (int64_t i = 0; i < n_; ++i) {
      const at::Tensor& grad = THPVariable_Unpack(params_[i].ptr()).grad();
      if (grad.defined() && !grad.is_contiguous()) {
        return i;
      }
      grads[i] = grad;
    }
    for (int64_t i = 0; i < n_; ++i) {
      const at::Tensor& grad = grads[i];
      const bool present = grad.defined();
      addresses_[i] = present ? reinterpret_cast<int64_t>(grad.const_data_ptr()) : 0;
      versions_[i] = present ? grad._version() : 0;
    }
    held_.swap(grads);
    return -1;
  }

  // The first held gradient whose version moved since read_gradients() (changed in place), or -1.
  int64_t changed_in_place() const {
    for (int64_t i = 0; i < n_; ++i) {
      if (held_[i].defined() && held_[i]._version() != versions_[i]) {
        return i;
      }
    }
    return -1;
  }

  void write_addresses(const at::Tensor& row) const {
    check_row_buffer(row, at::kLong, 1, n_, "write_addresses");
    int64_t* out = row.data_ptr<int64_t>();
    for (int64_t i = 0; i < n_; ++i) {
      out[i] = addresses_[i];
    }
  }

  // Reads every config (raising before anything is written), counts the step of every parameter that had a
  // gradient at read_gradients(), writes rows [6, n] (STEP_INPUTS order). Returns whether a beta or eps
  // differs from set_static()'s.
  bool write_inputs(const at::Tensor& rows) {
    check_row_buffer(rows, at::kDouble, kInputRows, n_, "write_inputs");
    constexpr int stride = kConfigValues + 3;
    bool changed = false;
    for (int64_t i = 0; i < n_; ++i) {
      PyObject* cfg = cfgs_[i].ptr();
      double* values = values_.data() + i * stride;
      for (int k = 0; k < kConfigValues; ++k) {
        py::object value = py::reinterpret_steal<py::object>(PyObject_GetAttr(cfg, config_names_[k].ptr()));
        if (!value) {
          throw py::error_already_set();
        }
        values[k] = to_double(value.ptr());
      }
      py::object betas = py::reinterpret_steal<py::object>(PyObject_GetAttr(cfg, betas_name_.ptr()));
      py::object eps = py::reinterpret_steal<py::object>(PyObject_GetAttr(cfg, eps_name_.ptr()));
      if (!betas || !eps) {
        throw py::error_already_set();
      }
      if (PySequence_Size(betas.ptr()) != 2) {
        PyErr_Clear();
        throw py::value_error("parameter " + std::to_string(i) + ": adam_betas must hold two numbers");
      }
      values[kConfigValues] = item_as_double(betas, 0);
      values[kConfigValues + 1] = item_as_double(betas, 1);
      values[kConfigValues + 2] = to_double(eps.ptr());
      for (int k = 0; k < 3; ++k) {
        changed = changed || values[kConfigValues + k] != static_[i * 3 + k];
      }
    }
    double* out = rows.data_ptr<double>();
    for (int64_t i = 0; i < n_; ++i) {
      const bool active = addresses_[i] != 0;
      PyObject* state = states_[i].ptr();
      py::object step = py::reinterpret_steal<py::object>(PyObject_GetItem(state, step_key_.ptr()));
      if (!step) {
        throw py::error_already_set();
      }
      if (active) {
        py::object one = py::reinterpret_steal<py::object>(PyLong_FromLong(1));
        step = py::reinterpret_steal<py::object>(PyNumber_Add(step.ptr(), one.ptr()));
        if (!step || PyObject_SetItem(state, step_key_.ptr(), step.ptr()) != 0) {
          throw py::error_already_set();
        }
      }
      const double* values = values_.data() + i * stride;
      for (int k = 0; k < kConfigValues; ++k) {
        out[k * n_ + i] = values[k];
      }
      out[kStepRow * n_ + i] = to_double(step.ptr());
      out[kActiveRow * n_ + i] = active ? 1.0 : 0.0;
    }
    return changed;
  }

  // update()'s host work with one process, in one call: refuse a held gradient changed in place (its index
  // is returned, nothing written), then write_inputs() and write_addresses(). Both buffers are checked
  // before anything is written; the addresses go last since writing them cannot fail.
  int64_t stage_update(const at::Tensor& addresses_row, const at::Tensor& rows) {
    check_row_buffer(addresses_row, at::kLong, 1, n_, "stage_update");
    check_row_buffer(rows, at::kDouble, kInputRows, n_, "stage_update");
    const int64_t bad = changed_in_place();
    if (bad >= 0) {
      return bad;
    }
    const bool changed = write_inputs(rows);
    write_addresses(addresses_row);
    return changed ? kStaticChanged : kStaticSame;
  }

  // stage_update(), then, when it wrote the rows and no beta or eps changed (STATIC_SAME), launch the update
  // graph that uploads them, on the current stream of the parameters' device: update()'s one call with one
  // process once that graph is trusted. On any other answer nothing is launched: a refusal wrote nothing, and
  // after a change of betas or eps the caller rebuilds the static data and captures the graph again.
  int64_t stage_and_replay(const at::Tensor& addresses_row, const at::Tensor& rows, int64_t graph_exec,
                           int64_t device_index) {
    const PreparedLaunch launch = prepare_launch(graph_exec, device_index, "stage_and_replay");  // may raise
    const int64_t answer = stage_update(addresses_row, rows);
    if (answer == kStaticSame) {
      launch();
    }
    return answer;
  }

  // Launch a graph on the current stream of CUDA device `device_index` and do nothing else: the one CUDA call
  // of a device step without its host work (perf/bench_replicated_adam.py's device_floor path times it).
  void replay(int64_t graph_exec, int64_t device_index) { prepare_launch(graph_exec, device_index, "replay")(); }

  // zero_grad(): every parameter's .grad = None, and the held gradients released.
  void drop_gradients() {
    release();
    for (const auto& param : params_) {
      THPVariable_Unpack(param.ptr()).mutable_grad().reset();
    }
  }

  // The (beta1, beta2, eps) of every parameter that the static data on the device was built for.
  void set_static(const std::vector<std::array<double, 3>>& keys) {
    if (static_cast<int64_t>(keys.size()) != n_) {
      throw py::value_error("set_static: expected one (beta1, beta2, eps) per parameter");
    }
    for (int64_t i = 0; i < n_; ++i) {
      for (int k = 0; k < 3; ++k) {
        static_[i * 3 + k] = keys[i][k];
      }
    }
  }

  // Drop the held gradients and forget the arrivals.
  void release() {
    for (auto& grad : held_) {
      grad.reset();
    }
    std::fill(addresses_.begin(), addresses_.end(), 0);
  }

  std::vector<bool> arrived() const {
    std::vector<bool> out(n_);
    for (int64_t i = 0; i < n_; ++i) {
      out[i] = addresses_[i] != 0;
    }
    return out;
  }

  std::vector<int64_t> addresses() const { return addresses_; }

 private:
  int64_t n_;
  std::vector<py::object> params_, cfgs_, states_;
  std::array<py::object, kConfigValues> config_names_;
  py::object betas_name_, eps_name_, step_key_;
  std::vector<at::Tensor> held_;
  std::vector<int64_t> addresses_, versions_;
  std::vector<double> values_, static_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The per-step host work of ReplicatedAdam's device mode (track_1_short/perf/host_step.py).";
  m.attr("STATIC_SAME") = kStaticSame;
  m.attr("STATIC_CHANGED") = kStaticChanged;
  py::class_<HostStep>(m, "HostStep")
      .def(py::init<const py::list&, const py::list&, const py::list&>(), py::arg("params"), py::arg("cfgs"),
           py::arg("states"))
      .def("read_gradients", &HostStep::read_gradients)
      .def("changed_in_place", &HostStep::changed_in_place)
      .def("write_addresses", &HostStep::write_addresses, py::arg("row"))
      .def("write_inputs", &HostStep::write_inputs, py::arg("rows"))
      .def("set_static", &HostStep::set_static, py::arg("keys"))
      .def("stage_update", &HostStep::stage_update, py::arg("addresses_row"), py::arg("rows"))
      .def("stage_and_replay", &HostStep::stage_and_replay, py::arg("addresses_row"), py::arg("rows"),
           py::arg("graph_exec"), py::arg("device_index"))
      .def("replay", &HostStep::replay, py::arg("graph_exec"), py::arg("device_index"))
      .def("drop_gradients", &HostStep::drop_gradients)
      .def("release", &HostStep::release)
      .def("arrived", &HostStep::arrived)
      .def("addresses", &HostStep::addresses);
}
