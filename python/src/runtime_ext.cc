// morph._morph's runtime objects (ext.h): Runtime, State, Step, Communicator, KeyValueStore,
// and SIGINT as a preemption notice. Every object the program can keep shares the runtime's
// Life: one kept after its owner is gone (a State after `del rt`, a Step after the next
// begin_step or close, a communicator of an earlier generation) raises FailedPreconditionError
// instead of touching freed memory. Communicators and stores reach the torch backend
// (morph._torch_backend) as named capsules holding shared owners, never as raw addresses.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <glog/logging.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ext.h"

namespace morph_py {
namespace {

using namespace nb::literals;
using morph::FailedPreconditionError;
using morph::Status;
using morph::StatusOr;

// What the binding's objects of one runtime share. Read and written with the GIL held.
struct Life {
  bool open = true;
  uint64_t step = 0;       // serial of the step begin_step handed out last (a Step's validity)
  int64_t generation = 0;  // the generation that runs
  std::thread::id owner;   // the thread of the step loop (begin_step's caller)

  void Close() {
    open = false;
    ++step;
  }
  void CheckOpen(const std::string& what) const {
    if (!open) Fail(FailedPreconditionError(what + ": the runtime is closed (rt.close() or del rt)"));
  }
  void CheckOwner(const std::string& what) const {
    if (std::this_thread::get_id() != owner) {
      Fail(FailedPreconditionError(
          what + " from a thread other than the step loop's: a generation's communicators "
                 "are used by the thread that runs the steps (give another thread a group of "
                 "its own)"));
    }
  }
};
using LifePtr = std::shared_ptr<Life>;

// A capsule holding a shared owner of `T`, named for the type (the torch backend checks the
// name before it copies the owner out).
template <typename T>
nb::capsule SharedCapsule(std::shared_ptr<T> p, const char* name) {
  auto* holder = new std::shared_ptr<T>(std::move(p));
  return nb::capsule(holder, name, [](void* h) noexcept {
    delete static_cast<std::shared_ptr<T>*>(h);
  });
}

// A Python callable kept by C++ code that may drop it without the GIL (a TensorAllocator lives
// as long as the State): takes the GIL to release it.
struct PyCallable {
  explicit PyCallable(nb::object f) : fn(std::move(f)) {}
  ~PyCallable() {
    if (Py_IsInitialized()) {
      nb::gil_scoped_acquire gil;
      fn.reset();
    } else {
      fn.release();  // the interpreter is gone: leak rather than touch it
    }
  }
  nb::object fn;
};

struct StateRef {
  morph::State* s = nullptr;
  LifePtr life;
  morph::State& get() const {
    life->CheckOpen("the state");
    return *s;
  }
};

// TensorRef flattened for Python: (data_ptr, bytes, memory kind, frame origin, frame shape,
// flat_begin, flat_end). The Python layer maps data_ptr back to the torch tensor it allocated.
using TensorInfo = std::tuple<uintptr_t, int64_t, std::string, std::vector<int64_t>,
                              std::vector<int64_t>, int64_t, int64_t>;

struct CommRef {
  std::shared_ptr<morph::Communicator> c;
  std::string name;  // world, dp, tp, pp
  int64_t generation = 0;
  LifePtr life;
  morph::Communicator& get() const {
    const std::string what = "the " + name + " communicator of generation " +
                             std::to_string(generation);
    life->CheckOpen(what);
    if (life->generation != generation) {
      Fail(FailedPreconditionError(what + " used in generation " +
                                   std::to_string(life->generation) +
                                   ": a communicator is valid in its generation (take the "
                                   "current step's)"));
    }
    return *c;
  }
  morph::Communicator& ForOp(const char* op) const {
    morph::Communicator& comm = get();
    life->CheckOwner(std::string(op) + " on the " + name + " communicator");
    return comm;
  }
};

// A Step and what it needs after the runtime moved on: its config (the step's points into
// the runtime's current generation), its serial.
struct StepRef {
  morph::Step step;
  morph::ParallelConfig config;
  uint64_t serial = 0;
  LifePtr life;
  void CheckCurrent(const char* what) const {
    life->CheckOpen(std::string("step ") + std::to_string(step.index()) + "'s " + what);
    if (serial != life->step) {
      Fail(FailedPreconditionError("step " + std::to_string(step.index()) + "'s " + what +
                                   " after the step ended (a Step is valid until the next "
                                   "begin_step)"));
    }
  }
};

struct StoreRef {
  std::shared_ptr<morph::KeyValueStore> store;
};

struct Runtime {
  std::unique_ptr<morph::Runtime> rt;
  LifePtr life = std::make_shared<Life>();
  ~Runtime() { Close(); }
  morph::Runtime& get() const {
    if (!rt) Fail(FailedPreconditionError("the runtime is closed"));
    return *rt;
  }
  // Every object of it raises from now on; the runtime's destructor may wait (a hosted
  // coordinator waits for the others) and allocator releases take the GIL: without it here.
  void Close() {
    if (!rt) return;
    life->Close();
    std::unique_ptr<morph::Runtime> r = std::move(rt);
    if (PyGILState_Check()) {
      nb::gil_scoped_release nogil;
      r.reset();
    } else {
      r.reset();
    }
  }
};

std::chrono::milliseconds Ms(int64_t ms) { return std::chrono::milliseconds(ms); }

// ---- SIGINT, a preemption notice (docs/torch.md "Signals") ----
std::atomic<int> g_sigints{0};
struct sigaction g_previous_sigint;
bool g_sigint_installed = false;

void OnSigint(int) {
  if (g_sigints.fetch_add(1) == 0) {
    morph::Runtime::RequestLeaveFromSignal();
    static const char kNote[] =
        "morph: SIGINT: this worker leaves the job at its next step boundary (SIGINT again "
        "to exit at once)\n";
    (void)!write(2, kNote, sizeof(kNote) - 1);
    return;
  }
  signal(SIGINT, SIG_DFL);
  raise(SIGINT);
}

void HandleSigint(bool on) {
  if (on && !g_sigint_installed) {
    struct sigaction sa = {};
    sa.sa_handler = OnSigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &g_previous_sigint);
    g_sigint_installed = true;
    g_sigints.store(0);
  } else if (!on && g_sigint_installed) {
    sigaction(SIGINT, &g_previous_sigint, nullptr);
    g_sigint_installed = false;
  }
}

morph::ReduceOp ParseReduceOp(const std::string& op) {
  if (op == "sum") return morph::ReduceOp::kSum;
  if (op == "max") return morph::ReduceOp::kMax;
  if (op == "min") return morph::ReduceOp::kMin;
  Fail(morph::InvalidArgumentError("reduce op '" + op + "' (sum, max, min)"));
}

void BindState(nb::module_& m) {
  nb::class_<StateRef>(m, "State")
      .def("adopt_tensor",
           [](StateRef& self, std::string name, std::vector<int64_t> shape,
              const std::string& dtype, const morph::Layout& layout, nb::object allocate,
              nb::object release) {
             auto alloc = std::make_shared<PyCallable>(std::move(allocate));
             auto rel = std::make_shared<PyCallable>(std::move(release));
             morph::TensorAllocator a;
             std::string tname = name;
             a.allocate = [alloc, tname](int64_t bytes) -> StatusOr<morph::BufferView> {
               nb::gil_scoped_acquire gil;
               try {
                 nb::tuple r = nb::cast<nb::tuple>(alloc->fn(bytes));
                 morph::BufferView v;
                 v.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(r[0]));
                 v.bytes = nb::cast<size_t>(r[1]);
                 v.kind = nb::cast<bool>(r[2]) ? morph::MemoryKind::kCuda : morph::MemoryKind::kHost;
                 return v;
               } catch (const std::exception& e) {
                 return morph::ResourceExhaustedError("tensor '" + tname + "': allocating " +
                                                      std::to_string(bytes) + " bytes: " + e.what());
               }
             };
             a.release = [rel](morph::BufferView v) {
               nb::gil_scoped_acquire gil;
               try {
                 rel->fn(reinterpret_cast<uintptr_t>(v.data));
               } catch (const std::exception& e) {
                 LOG(WARNING) << "morph (python): releasing a tensor's storage: " << e.what();
               }
             };
             Check(self.get().AdoptTensor(std::move(name), std::move(shape),
                                          ParseDTypeOrThrow(dtype), layout, std::move(a)));
           },
           "name"_a, "shape"_a, "dtype"_a, "layout"_a, "allocate"_a, "release"_a,
           "Registers a tensor whose shards live in storage `allocate(bytes) -> (data_ptr, "
           "bytes, is_cuda)` returns; `release(data_ptr)` when morph no longer needs it.")
      .def("add_host_tensor",
           [](StateRef& self, std::string name, std::vector<int64_t> shape,
              const std::string& dtype, const morph::Layout& layout, bool pad_dp_shards) {
             morph::TensorAllocator a = HostTensorAllocator(name);
             a.pad_dp_shards = pad_dp_shards;
             Check(self.get().AdoptTensor(std::move(name), std::move(shape),
                                          ParseDTypeOrThrow(dtype), layout, std::move(a)));
           },
           "name"_a, "shape"_a, "dtype"_a, "layout"_a, "pad_dp_shards"_a = false,
           "Registers a host tensor whose shards live in blocks this module allocates (any "
           "thread); host_storage(data_ptr, bytes) views one as a torch uint8 tensor. With "
           "pad_dp_shards, a DP-sharded tensor's blocks have room for its DP group's first "
           "shard (TensorAllocator::pad_dp_shards: FSDP2's padded shards).")
      .def("add_scalar", [](StateRef& self, std::string name, int64_t bytes) {
        Check(self.get().AddScalar(std::move(name), bytes));
      }, "name"_a, "bytes"_a)
      .def("tensor_info", [](StateRef& self, const std::string& name) -> TensorInfo {
        morph::State::TensorRef t = Value(self.get().tensor(name));
        return {reinterpret_cast<uintptr_t>(t.data.data), static_cast<int64_t>(t.data.bytes),
                std::string(morph::MemoryKindName(t.data.kind)), t.shard.frame.origin(),
                t.shard.frame.shape(), t.shard.flat_begin, t.shard.flat_end};
      }, "name"_a)
      .def("tensor_spec", [](StateRef& self, const std::string& name) {
        morph::State::TensorRef t = Value(self.get().tensor(name));
        return std::make_tuple(t.spec->shape, std::string(morph::DTypeName(t.spec->dtype)),
                               t.spec->layout, morph::PlanShape(*t.spec));
      }, "name"_a)
      .def("tensor_names", [](StateRef& self) {
        std::vector<std::string> out;
        for (const morph::TensorSpec& s : self.get().tensors()) out.push_back(s.name);
        return out;
      })
      .def("scalar_names", [](StateRef& self) {
        std::vector<std::string> out;
        for (const morph::ScalarSpec& s : self.get().scalars()) out.push_back(s.name);
        return out;
      })
      .def("get_scalar", [](StateRef& self, const std::string& name) {
        auto span = Value(self.get().scalar(name));
        return nb::bytes(reinterpret_cast<const char*>(span.data()), span.size());
      }, "name"_a)
      .def("set_scalar", [](StateRef& self, const std::string& name, nb::bytes value) {
        auto span = Value(self.get().scalar(name));
        if (value.size() != span.size()) {
          Fail(morph::InvalidArgumentError("scalar '" + name + "' holds " +
                                           std::to_string(span.size()) + " bytes, got " +
                                           std::to_string(value.size())));
        }
        std::memcpy(span.data(), value.c_str(), span.size());
      }, "name"_a, "value"_a)
      .def_prop_ro("local_bytes", [](StateRef& self) { return self.get().local_bytes(); })
      .def_prop_ro("config", [](StateRef& self) -> std::optional<morph::ParallelConfig> {
        const morph::ParallelConfig* c = self.get().config();
        if (c == nullptr) return std::nullopt;
        return *c;
      })
      .def_prop_ro("rank", [](StateRef& self) { return self.get().rank(); });
}

void BindCommunicator(nb::module_& m) {
  nb::class_<CommRef>(m, "Communicator")
      .def_prop_ro("rank", [](const CommRef& c) { return c.get().rank(); })
      .def_prop_ro("size", [](const CommRef& c) { return c.get().size(); })
      .def_prop_ro("generation", [](const CommRef& c) { return c.generation; })
      .def_prop_ro("backend", [](const CommRef& c) { return c.get().capabilities().backend; })
      .def("allreduce", [](const CommRef& c, uintptr_t ptr, size_t count, const std::string& dtype,
                           const std::string& op, int64_t timeout_ms) {
        morph::ReduceOp r = ParseReduceOp(op);
        morph::DType dt = ParseDTypeOrThrow(dtype);
        morph::Communicator& comm = c.ForOp("allreduce");
        nb::gil_scoped_release nogil;
        Check(comm.Allreduce(reinterpret_cast<void*>(ptr), count, dt, r, Ms(timeout_ms)));
      }, "data_ptr"_a, "count"_a, "dtype"_a, "op"_a, "timeout_ms"_a)
      .def("broadcast", [](const CommRef& c, uintptr_t ptr, size_t count, const std::string& dtype,
                           int root, int64_t timeout_ms) {
        morph::DType dt = ParseDTypeOrThrow(dtype);
        morph::Communicator& comm = c.ForOp("broadcast");
        nb::gil_scoped_release nogil;
        Check(comm.Broadcast(reinterpret_cast<void*>(ptr), count, dt, root, Ms(timeout_ms)));
      }, "data_ptr"_a, "count"_a, "dtype"_a, "root"_a, "timeout_ms"_a)
      .def("allgather", [](const CommRef& c, uintptr_t send, uintptr_t recv, size_t count,
                           const std::string& dtype, int64_t timeout_ms) {
        morph::DType dt = ParseDTypeOrThrow(dtype);
        morph::Communicator& comm = c.ForOp("allgather");
        nb::gil_scoped_release nogil;
        Check(comm.Allgather(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv),
                             count, dt, Ms(timeout_ms)));
      }, "send_ptr"_a, "recv_ptr"_a, "count"_a, "dtype"_a, "timeout_ms"_a)
      .def("barrier", [](const CommRef& c, int64_t timeout_ms) {
        morph::Communicator& comm = c.ForOp("barrier");
        nb::gil_scoped_release nogil;
        Check(comm.Barrier(Ms(timeout_ms)));
      }, "timeout_ms"_a)
      .def("abort", [](const CommRef& c) { c.get().Abort(); })
      .def("_capsule", [](const CommRef& c) {
        c.get();
        return SharedCapsule(c.c, "morph.Communicator");
      }, "A capsule holding a shared owner of the communicator (for morph._torch_backend).")
      .def_prop_ro("broken", [](const CommRef& c) { return c.get().broken(); });
}

void BindStep(nb::module_& m) {
  nb::class_<StepRef>(m, "Step")
      .def_prop_ro("done", [](const StepRef& s) { return s.step.done(); })
      .def_prop_ro("index", [](const StepRef& s) { return s.step.index(); })
      .def_prop_ro("generation", [](const StepRef& s) { return s.step.generation(); })
      .def_prop_ro("reconfigured", [](const StepRef& s) { return s.step.reconfigured(); })
      .def_prop_ro("config", [](const StepRef& s) { return s.config; })
      .def_prop_ro("rank", [](const StepRef& s) { return s.step.rank(); })
      .def_prop_ro("world_size", [](const StepRef& s) { return s.config.world(); })
      .def_prop_ro("coords", [](const StepRef& s) {
        auto c = s.config.CoordsOf(s.step.rank());
        return std::make_tuple(c.p, c.d, c.t);
      })
      .def_prop_ro("samples", [](const StepRef& s) {
        s.CheckCurrent("samples");
        return s.step.samples();
      })
      .def_prop_ro("micro_batches", [](const StepRef& s) {
        s.CheckCurrent("micro_batches");
        return s.step.batch().micro_batches;
      })
      .def_prop_ro("global_batch", [](const StepRef& s) {
        s.CheckCurrent("global_batch");
        return s.step.global_batch();
      })
      .def("communicator", [](const StepRef& s, const std::string& which) {
        s.CheckCurrent("communicator");
        if (s.step.done()) Fail(FailedPreconditionError("the step is done"));
        morph::Communicator* c = which == "world" ? &s.step.world()
                                 : which == "dp"  ? &s.step.dp()
                                 : which == "tp"  ? &s.step.tp()
                                 : which == "pp"  ? &s.step.pp()
                                                  : nullptr;
        if (c == nullptr) {
          Fail(morph::InvalidArgumentError("communicator '" + which + "' (world, dp, tp, pp)"));
        }
        return CommRef{s.step.Shared(*c), which, s.step.generation(), s.life};
      }, "which"_a);
}

void BindStore(nb::module_& m) {
  nb::class_<StoreRef>(m, "KeyValueStore")
      .def_prop_ro("generation", [](const StoreRef& s) { return s.store->generation(); })
      .def("set", [](const StoreRef& s, const std::string& key, nb::bytes value,
                     int64_t timeout_ms) {
        std::string v(value.c_str(), value.size());
        nb::gil_scoped_release nogil;
        Check(s.store->Set(key, v, morph::Deadline::AfterMs(timeout_ms)));
      }, "key"_a, "value"_a, "timeout_ms"_a)
      .def("get", [](const StoreRef& s, const std::string& key, int64_t timeout_ms) {
        StatusOr<std::string> v = [&] {
          nb::gil_scoped_release nogil;
          return s.store->Get(key, morph::Deadline::AfterMs(timeout_ms));
        }();
        std::string out = Value(std::move(v));
        return nb::bytes(out.data(), out.size());
      }, "key"_a, "timeout_ms"_a)
      .def("_capsule", [](const StoreRef& s) {
        return SharedCapsule(s.store, "morph.KeyValueStore");
      }, "A capsule holding a shared owner of the store (for morph._torch_backend).");
}

void BindRuntimeClass(nb::module_& m) {
  nb::class_<Runtime>(m, "Runtime")
      .def_static("start", [](morph::Options options, nb::object declare) {
        std::optional<nb::python_error> py_error;  // what declare raised, re-raised below
        auto rt = std::make_unique<Runtime>();
        LifePtr life = rt->life;
        StatusOr<std::unique_ptr<morph::Runtime>> started = [&] {
          nb::gil_scoped_release nogil;
          return morph::Runtime::Start(std::move(options), [&](morph::State& s) -> Status {
            nb::gil_scoped_acquire gil;
            try {
              declare(StateRef{&s, life});
              return Status::Ok();
            } catch (nb::python_error& e) {
              py_error.emplace(e);
              return morph::InvalidArgumentError(std::string("declare raised: ") + e.what());
            } catch (const StatusError& e) {
              return e.status;
            }
          });
        }();
        if (!started.ok()) life->Close();  // the State declare saw is gone
        if (py_error) throw nb::python_error(*py_error);
        rt->rt = Value(std::move(started));
        life->generation = rt->rt->generation().id;
        life->owner = std::this_thread::get_id();
        return rt;
      }, "options"_a, "declare"_a)
      .def_prop_ro("state", [](Runtime& r) { return StateRef{&r.get().state(), r.life}; })
      .def_prop_ro("fresh_start", [](Runtime& r) { return r.get().fresh_start(); })
      .def_prop_ro("last_reconfiguration", [](Runtime& r) { return r.get().last_reconfiguration(); })
      .def("begin_step", [](Runtime& r) {
        morph::Runtime& rt = r.get();
        StatusOr<morph::Step> s = [&] {
          nb::gil_scoped_release nogil;
          return rt.BeginStep();
        }();
        morph::Step step = Value(std::move(s));
        Life& life = *r.life;
        life.owner = std::this_thread::get_id();
        life.generation = rt.generation().id;
        return StepRef{step, step.config(), ++life.step, r.life};
      })
      .def("begin_update", [](Runtime& r) {
        morph::Runtime& rt = r.get();
        nb::gil_scoped_release nogil;
        rt.BeginUpdate();
      })
      .def("commit_update", [](Runtime& r) {
        morph::Runtime& rt = r.get();
        nb::gil_scoped_release nogil;
        Check(rt.CommitUpdate());
      })
      .def("end_step", [](Runtime& r) {
        morph::Runtime& rt = r.get();
        nb::gil_scoped_release nogil;
        Check(rt.EndStep());
      })
      .def("abort_step", [](Runtime& r, int code, const std::string& message) {
        morph::Runtime& rt = r.get();
        Status why(static_cast<morph::StatusCode>(code), message);
        nb::gil_scoped_release nogil;
        Check(rt.AbortStep(why));
      }, "code"_a, "message"_a)
      .def_prop_ro("finished", [](Runtime& r) { return r.get().Finished(); })
      .def("leave", [](Runtime& r, std::string reason) {
        morph::Runtime& rt = r.get();
        nb::gil_scoped_release nogil;
        rt.Leave(std::move(reason));
      }, "reason"_a = "leave()")
      .def("finish", [](Runtime& r, int64_t timeout_ms) {
        morph::Runtime& rt = r.get();
        nb::gil_scoped_release nogil;
        Check(rt.Finish(timeout_ms));
      }, "timeout_ms"_a = 60000)
      .def("connect_store", [](Runtime& r, const std::string& prefix) {
        morph::Runtime& rt = r.get();
        StatusOr<std::unique_ptr<morph::KeyValueStore>> s = [&] {
          nb::gil_scoped_release nogil;
          return rt.ConnectStore(prefix);
        }();
        return StoreRef{std::shared_ptr<morph::KeyValueStore>(Value(std::move(s)))};
      }, "prefix"_a, "A client of the job's store for this generation (morph/key_value_store.h).")
      .def("close", [](Runtime& r) { r.Close(); })
      .def_prop_ro("worker_id", [](Runtime& r) { return r.get().worker_id(); })
      .def_prop_ro("generation", [](Runtime& r) { return r.get().generation().id; })
      .def_prop_ro("config", [](Runtime& r) { return r.get().generation().config; })
      .def_prop_ro("rank", [](Runtime& r) { return r.get().rank(); })
      .def_prop_ro("next_step", [](Runtime& r) { return r.get().next_step(); })
      .def_prop_ro("cursor", [](Runtime& r) -> morph::DatasetCursor { return r.get().cursor(); },
                   "The job's dataset cursor (a copy: a value, usable after close).")
      .def_prop_ro("coordinator_address", [](Runtime& r) { return r.get().coordinator_address(); })
      .def_prop_ro("api_address", [](Runtime& r) { return r.get().api_address(); });
}

}  // namespace

void BindRuntime(nb::module_& m) {
  BindState(m);
  BindCommunicator(m);
  BindStep(m);
  BindStore(m);
  BindRuntimeClass(m);
  m.def("handle_sigint", &HandleSigint, "on"_a,
        "SIGINT as a preemption notice (on) or as before (off): the first asks this worker to "
        "leave at its next step boundary, a second ends the process.");
}

}  // namespace morph_py
