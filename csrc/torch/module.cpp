// attnrnn._C: importing it loads libattnrnn_torch, whose static initializers register the
// torch.ops.attnrnn operators. It also holds the eager calls of the operators the public functions
// call per step of a model (chunk_fwd, step, softmax_attn_step): the same dispatcher call as
// torch.ops.attnrnn.<op>.default, typed instead of boxed. torch.ops spends several µs of host time
// per call turning 8-13 Python arguments into IValues against the schema, time the GPU waits for
// when it is idle at the call's start. Anything the typed call cannot stand in for (a tensor
// subclass, a __torch_function__ mode) returns NotImplemented, and the caller goes through torch.ops.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <initializer_list>
#include <optional>
#include <string_view>
#include <tuple>

#include "attnrnn/attnrnn.h"
#include "attnrnn/testing.h"
#include "attnrnn/torch.h"
#include "operators.h"

namespace {

using attnrnn::operators::ForwardResult;
using attnrnn::operators::OptTensor;

// A call's positional arguments, read by type; `usable` turns false at the first one the typed
// call cannot take as torch.ops would.
struct Args {
  PyObject* const* items;
  bool usable = true;

  // Plain tensors (and Parameters) only: a subclass may handle the op its own way.
  const at::Tensor* tensor(int i) {
    if (!THPVariable_CheckExact(items[i])) {
      usable = false;
      return nullptr;
    }
    return &THPVariable_Unpack(items[i]);
  }
  OptTensor optional_tensor(int i) {
    if (items[i] == Py_None) return std::nullopt;
    const at::Tensor* t = tensor(i);
    return t != nullptr ? OptTensor(*t) : std::nullopt;
  }
  // Python floats and ints only (as the public functions pass them): no __float__ of other objects.
  double real(int i) {
    if (!PyFloat_Check(items[i]) && !PyLong_Check(items[i])) {
      usable = false;
      return 0.0;
    }
    const double value = PyFloat_AsDouble(items[i]);
    if (value == -1.0 && PyErr_Occurred()) return decline();  // an int too large: torch.ops' error
    return value;
  }
  int64_t integer(int i) {
    if (!PyLong_Check(items[i])) {
      usable = false;
      return 0;
    }
    const long long value = PyLong_AsLongLong(items[i]);
    if (value == -1 && PyErr_Occurred()) return decline();  // past int64: torch.ops' error
    return value;
  }
  bool boolean(int i) {
    if (!PyBool_Check(items[i])) usable = false;
    return items[i] == Py_True;
  }
  // The conversion's error cleared: torch.ops raises its own for the argument.
  int decline() {
    PyErr_Clear();
    usable = false;
    return 0;
  }
  std::string_view text(int i) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_Check(items[i]) ? PyUnicode_AsUTF8AndSize(items[i], &size) : nullptr;
    if (data == nullptr) {
      PyErr_Clear();
      usable = false;
      return {};
    }
    return {data, static_cast<size_t>(size)};
  }
};

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// The GIL released for the operator's call, as torch.ops does (a CPU kernel may run long), and
// taken back however the call ends.
struct GilReleased {
  PyThreadState* state = PyEval_SaveThread();
  GilReleased() = default;
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;
  ~GilReleased() { PyEval_RestoreThread(state); }
};

// A new tuple of the tensors as Python objects (nullptr with the error set if one fails).
PyObject* wrap_tuple(std::initializer_list<at::Tensor> tensors) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(tensors.size()));
  if (tuple == nullptr) return nullptr;
  Py_ssize_t i = 0;
  for (const at::Tensor& t : tensors) {
    PyObject* item = THPVariable_Wrap(t);
    if (item == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, i++, item);  // steals the reference
  }
  return tuple;
}

bool check_count(Py_ssize_t given, Py_ssize_t wanted, const char* name) {
  if (given == wanted) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments (%zd given)", name, wanted, given);
  return false;
}

// chunk_fwd(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize,
//           output_final_state, chunk_size, for_backward) -> (o, S, z, saved), as the schema.
PyObject* chunk_fwd(PyObject*, PyObject* const* items, Py_ssize_t count) {
  ForwardResult out;
  HANDLE_TH_ERRORS
  if (!check_count(count, 13, "chunk_fwd")) return nullptr;
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  Args a{items};
  const at::Tensor *q = a.tensor(0), *k = a.tensor(1), *v = a.tensor(2);
  const OptTensor S0 = a.optional_tensor(3), z0 = a.optional_tensor(4), cu_seqlens = a.optional_tensor(5);
  const double scale = a.real(6), eps = a.real(7);
  const std::string_view feature_map = a.text(8);
  const bool normalize = a.boolean(9), output_final_state = a.boolean(10);
  const int64_t chunk_size = a.integer(11);
  const bool for_backward = a.boolean(12);
  if (!a.usable) return not_implemented();
  const auto& op = attnrnn::operators::chunk_fwd();
  const GilReleased no_gil;
  out = op.call(*q, *k, *v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize, output_final_state, chunk_size,
                for_backward);
  END_HANDLE_TH_ERRORS
  // Wrapped once the warning handler has gone: a warning it turns into an error (warnings as
  // errors) then leaves no Python objects behind.
  return wrap_tuple({std::get<0>(out), std::get<1>(out), std::get<2>(out), std::get<3>(out)});
}

// step(q, k, v, S, z, state_indices, scale, eps, feature_map, normalize) -> o, as the schema
// (S and z updated in place; the ADInplaceOrView kernel bumps their versions on this path too).
PyObject* step(PyObject*, PyObject* const* items, Py_ssize_t count) {
  at::Tensor o;
  HANDLE_TH_ERRORS
  if (!check_count(count, 10, "step")) return nullptr;
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  Args a{items};
  const at::Tensor *q = a.tensor(0), *k = a.tensor(1), *v = a.tensor(2), *S = a.tensor(3);
  const OptTensor z = a.optional_tensor(4), state_indices = a.optional_tensor(5);
  const double scale = a.real(6), eps = a.real(7);
  const std::string_view feature_map = a.text(8);
  const bool normalize = a.boolean(9);
  if (!a.usable) return not_implemented();
  const auto& op = attnrnn::operators::step();
  at::Tensor state = *S;
  const GilReleased no_gil;
  o = op.call(*q, *k, *v, state, z, state_indices, scale, eps, feature_map, normalize);
  END_HANDLE_TH_ERRORS
  return THPVariable_Wrap(std::move(o));  // after the warning handler, as in chunk_fwd
}

// softmax_attn_step(q, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, split_size) -> o, as the
// schema (the caches written in place, their versions bumped as through torch.ops).
PyObject* softmax_attn_step(PyObject*, PyObject* const* items, Py_ssize_t count) {
  at::Tensor o;
  HANDLE_TH_ERRORS
  if (!check_count(count, 8, "softmax_attn_step")) return nullptr;
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  Args a{items};
  const at::Tensor *q = a.tensor(0), *k_cache = a.tensor(1), *v_cache = a.tensor(2), *cache_seqlens = a.tensor(3);
  const OptTensor k_new = a.optional_tensor(4), v_new = a.optional_tensor(5);
  const double scale = a.real(6);
  const int64_t split_size = a.integer(7);
  if (!a.usable) return not_implemented();
  const auto& op = attnrnn::operators::softmax_attn_step();
  at::Tensor keys = *k_cache, values = *v_cache;
  const GilReleased no_gil;
  o = op.call(*q, keys, values, *cache_seqlens, k_new, v_new, scale, split_size);
  END_HANDLE_TH_ERRORS
  return THPVariable_Wrap(std::move(o));
}

// The test override of the CUDA chunk plan (attnrnn/testing.h):
// _set_plan_override(mma_sync: bool, segments: int, pairing: int, separate_grad_kv: bool).
PyObject* set_plan_override(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  if (!check_count(count, 4, "_set_plan_override")) return nullptr;
  Args a{items};
  attnrnn::testing::PlanOverride forced;
  forced.mma_sync = a.boolean(0);
  forced.segments = static_cast<int>(a.integer(1));
  const int64_t pairing = a.integer(2);
  forced.separate_grad_kv = a.boolean(3);
  if (!a.usable || pairing < 0 || pairing > 2) {
    PyErr_SetString(PyExc_TypeError,
                    "_set_plan_override expects (bool mma_sync, int segments, int pairing in 0..2, bool separate_grad_kv)");
    return nullptr;
  }
  forced.pairing = static_cast<attnrnn::testing::Pairing>(pairing);
  attnrnn::testing::set_plan_override(forced);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _plan_override() -> (mma_sync, segments, pairing, separate_grad_kv)
PyObject* get_plan_override(PyObject*, PyObject*) {
  const attnrnn::testing::PlanOverride forced = attnrnn::testing::plan_override();
  return Py_BuildValue("(OiiO)", forced.mma_sync ? Py_True : Py_False, forced.segments, static_cast<int>(forced.pairing),
                       forced.separate_grad_kv ? Py_True : Py_False);
}

// built_with_wgmma() -> bool: the CUDA kernels include sm_90a code (the wgmma sweeps).
PyObject* built_with_wgmma(PyObject*, PyObject*) { return PyBool_FromLong(attnrnn::built_with_wgmma()); }

PyMethodDef methods[] = {
    {"chunk_fwd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&chunk_fwd)), METH_FASTCALL,
     "The eager call of torch.ops.attnrnn.chunk_fwd.default (NotImplemented: use torch.ops)."},
    {"step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&step)), METH_FASTCALL,
     "The eager call of torch.ops.attnrnn.step.default (NotImplemented: use torch.ops)."},
    {"softmax_attn_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&softmax_attn_step)),
     METH_FASTCALL, "The eager call of torch.ops.attnrnn.softmax_attn_step.default (NotImplemented: use torch.ops)."},
    {"_set_plan_override", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&set_plan_override)),
     METH_FASTCALL, "Test hook: force the CUDA chunk plan's choices (attnrnn/testing.h)."},
    {"_plan_override", &get_plan_override, METH_NOARGS, "The CUDA chunk plan's test override in force."},
    {"built_with_wgmma", &built_with_wgmma, METH_NOARGS, "Whether the CUDA kernels include sm_90a code."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef attnrnn_module = {PyModuleDef_HEAD_INIT, "_C", "attnrnn operator registrations and eager calls", -1,
                              methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&attnrnn_module); }
