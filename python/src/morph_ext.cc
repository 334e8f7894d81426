// morph._morph: the thin binding of libmorph's public surface (include/morph/morph.h) for the
// Python package (python/src/morph/). Everything Pythonic — torch tensors, the step context,
// exception classes, process groups — lives in the Python layer above; this file only converts
// types, turns a non-OK Status into a StatusError (which the translator below raises as
// morph.<Code>Error, built by morph._errors), and releases the GIL around every call that blocks
// or moves data (Start, BeginStep, CommitUpdate, EndStep, AbortStep, Finish, collectives).
//
// Tensor storage is adopted by morph (State::AdoptTensor), visible to torch without a copy:
//  - host tensors: blocks allocated here (HostBlocks), without Python, so from any thread
//    (TensorAllocator::any_thread: morph allocates and pre-faults a change's new shards while
//    the old generation trains); host_storage(ptr) hands torch a uint8 tensor over a block
//    (DLPack) that keeps it alive, so the range of storage the program still holds after morph
//    released it is never reused; blocks of 1 MiB or more are mappings of their own whose pages
//    a growing shard takes over (HostBlocks::MovePages), leaving the old range inaccessible;
//  - CUDA tensors: the allocator calls back into Python (holding the GIL only for that call)
//    for a torch tensor of the asked bytes on the device, and hands its pointer to morph.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <glog/logging.h>
#include <morph/morph.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using morph::Status;
using morph::StatusOr;

// A non-OK Status on its way to Python (see the translator in the module body).
struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)), text(status.ToString()) {}
  const char* what() const noexcept override { return text.c_str(); }
  Status status;
  std::string text;
};

void Check(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <typename T>
T Value(StatusOr<T>&& s) {
  if (!s.ok()) throw StatusError(std::move(s).status());
  return std::move(s).value();
}

using Release = nb::call_guard<nb::gil_scoped_release>;

// Host storage of the package's CPU tensors: aligned blocks, each owned by shared pointers held
// by morph (from allocate to release) and by every torch tensor host_storage made over it.
// Any thread; no Python.
struct HostBlock {
  void* data = nullptr;
  size_t bytes = 0;
  size_t mapped = 0;  // the length of its own anonymous mapping (1 MiB or more), else 0
  ~HostBlock() {
    if (mapped > 0) {
      munmap(data, mapped);
    } else {
      std::free(data);
    }
  }
};

class HostBlocks {
 public:
  static HostBlocks& Get() {
    static auto* blocks = new HostBlocks();  // outlives every State (never destroyed)
    return *blocks;
  }
  StatusOr<morph::BufferView> Allocate(const std::string& tensor, int64_t bytes) {
    const size_t n = static_cast<size_t>(bytes > 0 ? bytes : 1);
    auto b = std::make_shared<HostBlock>();
    if (n >= (size_t{1} << 20)) {
      // A mapping of its own, as morph's HostAllocator gives (reshard/buffer.h MapHost): not
      // from malloc's arenas, whose locks and trimming the pre-allocating thread would share
      // with the training thread, and returned to the system when released.
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      const size_t len = (n + page - 1) / page * page;
      void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p != MAP_FAILED) {
        b->data = p;
        b->mapped = len;
      }
    } else if (posix_memalign(&b->data, 64, (n + 63) / 64 * 64) != 0) {
      b->data = nullptr;
    }
    if (b->data == nullptr) {
      return morph::ResourceExhaustedError("tensor '" + tensor + "': allocating " +
                                           std::to_string(bytes) + " bytes of host memory failed");
    }
    b->bytes = n;
    morph::BufferView v{b->data, static_cast<size_t>(bytes), morph::MemoryKind::kHost};
    std::lock_guard<std::mutex> l(mu_);
    blocks_[reinterpret_cast<uintptr_t>(b->data)] = std::move(b);
    return v;
  }
  void Release(const void* data) {
    std::shared_ptr<HostBlock> last;  // freed outside the lock
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(data));
    if (it == blocks_.end()) return;
    last = std::move(it->second);
    blocks_.erase(it);
  }
  // TensorAllocator::move_pages for host blocks: the pages of `from` (a page-aligned part of a
  // block, rounded up to whole pages) become bytes [offset, ...) of block `to`, not copied;
  // `from`'s range stays reserved but inaccessible, so that a torch view of the old shard the
  // program kept faults when read instead of reading zeros or another shard. Both blocks must
  // be mappings of their own (1 MiB or more); false (nothing changed) otherwise, or where the
  // kernel lacks MREMAP_DONTUNMAP (5.7).
  bool MovePages(morph::BufferView from, morph::BufferView to, size_t offset) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(from.data);
    std::shared_ptr<HostBlock> src = Containing(p);
    std::shared_ptr<HostBlock> dst = Find(reinterpret_cast<uintptr_t>(to.data));
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t len = (from.bytes + page - 1) / page * page;
    if (!src || !dst || src->mapped == 0 || dst->mapped == 0 || len == 0 || p % page != 0 ||
        offset % page != 0 || p + len > reinterpret_cast<uintptr_t>(src->data) + src->mapped ||
        offset + len > dst->mapped) {
      return false;
    }
#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif
    void* at = static_cast<char*>(dst->data) + offset;
    if (mremap(from.data, len, len, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, at) ==
        MAP_FAILED) {
      return false;
    }
    (void)mprotect(from.data, len, PROT_NONE);  // left readable (zeros) if it fails
    return true;
  }
  // The block whose mapping holds address `p`.
  std::shared_ptr<HostBlock> Containing(uintptr_t p) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return nullptr;
    --it;
    const HostBlock& b = *it->second;
    const size_t span = b.mapped > 0 ? b.mapped : b.bytes;
    return p < it->first + span ? it->second : nullptr;
  }
  std::shared_ptr<HostBlock> Find(uintptr_t data) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.find(data);
    return it == blocks_.end() ? nullptr : it->second;
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, std::shared_ptr<HostBlock>> blocks_;  // by address (Containing)
};

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

morph::DType ParseDTypeOrThrow(const std::string& name) { return Value(morph::ParseDType(name)); }

// The state as the declare callback and the program see it (State's constructor and destructor
// are the runtime's; Python holds a pointer that the Runtime object keeps valid).
struct StateRef {
  morph::State* s = nullptr;
  morph::State& get() const {
    if (s == nullptr) throw StatusError(morph::FailedPreconditionError("the runtime is closed"));
    return *s;
  }
};

// TensorRef flattened for Python: (data_ptr, bytes, memory kind, frame origin, frame shape,
// flat_begin, flat_end). The Python layer maps data_ptr back to the torch tensor it allocated.
using TensorInfo = std::tuple<uintptr_t, int64_t, std::string, std::vector<int64_t>,
                              std::vector<int64_t>, int64_t, int64_t>;

struct Runtime {
  std::unique_ptr<morph::Runtime> rt;
  morph::Runtime& get() const {
    if (!rt) throw StatusError(morph::FailedPreconditionError("the runtime is closed"));
    return *rt;
  }
};

// A Step copy; its communicators stay valid until the next BeginStep (the Python layer drops
// them there).
struct StepRef {
  morph::Step step;
};

struct CommRef {
  morph::Communicator* c = nullptr;
  morph::Communicator& get() const {
    if (c == nullptr) throw StatusError(morph::FailedPreconditionError("no communicator"));
    return *c;
  }
};

std::chrono::milliseconds Ms(int64_t ms) { return std::chrono::milliseconds(ms); }

std::once_flag g_logging_once;

}  // namespace

NB_MODULE(_morph, m) {
  m.doc() = "libmorph's public surface (the morph package wraps it; use `import morph`).";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const Status& s = e.status;
      std::vector<int> peers(s.failed_peers().begin(), s.failed_peers().end());
      nb::object kind = nb::none(), group = nb::none();
      if (const morph::CollectiveFailure* f = s.collective_failure()) {
        kind = nb::str(std::string(morph::CollectiveFailureKindName(f->kind)).c_str());
        group = nb::str(f->group.c_str());
      }
      nb::object errors = nb::module_::import_("morph._errors");
      nb::object exc = errors.attr("_from_status")(static_cast<int>(s.code()),
                                                   std::string(s.message()), peers, kind, group);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("init_logging", [](const std::string& program, int verbosity) {
    std::call_once(g_logging_once, [&] {
      FLAGS_logtostderr = true;
      FLAGS_v = std::max<int>(FLAGS_v, verbosity);  // GLOG_v, if higher, stays
      static std::string name = program;  // glog keeps the pointer
      google::InitGoogleLogging(name.c_str());
    });
  }, "program"_a, "verbosity"_a = 0, "Sends libmorph's log lines to stderr (once per process).");

  m.def("dtype_size", [](const std::string& d) { return morph::DTypeSize(ParseDTypeOrThrow(d)); });
  m.def("dtype_name", [](const std::string& d) {
    return std::string(morph::DTypeName(ParseDTypeOrThrow(d)));
  });

  // ---- values ----
  nb::class_<morph::ParallelConfig>(m, "ParallelConfig")
      .def(nb::init<>())
      .def_rw("dp", &morph::ParallelConfig::dp)
      .def_rw("tp", &morph::ParallelConfig::tp)
      .def_rw("pp", &morph::ParallelConfig::pp)
      .def_rw("stage_of_layer", &morph::ParallelConfig::stage_of_layer)
      .def_rw("zero_stage", &morph::ParallelConfig::zero_stage)
      .def_rw("micro_batches", &morph::ParallelConfig::micro_batches)
      .def_prop_ro("world", &morph::ParallelConfig::world)
      .def("coords_of", [](const morph::ParallelConfig& c, int rank) {
        auto x = c.CoordsOf(rank);
        return std::make_tuple(x.p, x.d, x.t);
      }, "rank"_a, "(pp, dp, tp) coordinates of `rank`: rank = (p*dp + d)*tp + t.")
      .def("rank_of", [](const morph::ParallelConfig& c, int p, int d, int t) {
        return c.RankOf({p, d, t});
      }, "p"_a, "d"_a, "t"_a)
      .def("dp_group", &morph::ParallelConfig::DpGroup, "rank"_a)
      .def("tp_group", &morph::ParallelConfig::TpGroup, "rank"_a)
      .def("pp_group", &morph::ParallelConfig::PpGroup, "rank"_a)
      .def("validate", [](const morph::ParallelConfig& c) { Check(c.Validate()); })
      .def("__eq__", [](const morph::ParallelConfig& a, const morph::ParallelConfig& b) {
        return a == b;
      })
      .def("__repr__", [](const morph::ParallelConfig& c) {
        return "ParallelConfig(" + c.ToString() + ")";
      });

  nb::class_<morph::Layout>(m, "Layout")
      .def(nb::init<>())
      .def_static("layer", &morph::Layout::Layer, "layer"_a)
      .def_static("layers", &morph::Layout::Layers, "layers"_a)
      .def("split_tp", &morph::Layout::SplitTP, "dim"_a)
      .def("zero_shard", [](const morph::Layout& l, int group) { return l.ZeroShard(group); },
           "group_size"_a = 0)
      .def("replicated", [](const morph::Layout& l) { return l.ZeroShard(false); })
      .def("also_on_layer", &morph::Layout::AlsoOnLayer, "layer"_a)
      .def("split_tp_blocks", &morph::Layout::SplitTPBlocks, "dim"_a, "blocks"_a)
      .def("pad_to_multiple", &morph::Layout::PadToMultiple, "multiple"_a)
      .def("chunk_tp", &morph::Layout::ChunkTP, "dim"_a)
      .def("chunk_dp", &morph::Layout::ChunkDP, "group_size"_a = 0)
      .def_prop_ro("tp_chunked", &morph::Layout::tp_chunked)
      .def_prop_ro("dp_chunked", &morph::Layout::dp_chunked)
      .def_prop_ro("layer_index", &morph::Layout::layer)
      .def_prop_ro("all_layers", &morph::Layout::layers)
      .def_prop_ro("tp_dim", &morph::Layout::tp_dim)
      .def_prop_ro("zero_sharded", &morph::Layout::zero_sharded)
      .def_prop_ro("zero_group", &morph::Layout::zero_group)
      .def_prop_ro("tp_blocks", &morph::Layout::tp_blocks)
      .def_prop_ro("pad_multiple", &morph::Layout::pad_multiple)
      .def("__eq__", [](const morph::Layout& a, const morph::Layout& b) { return a == b; })
      .def("__repr__", [](const morph::Layout& l) { return "Layout(" + l.ToString() + ")"; });

  m.def("host_storage", [](uintptr_t data, size_t bytes) {
    std::shared_ptr<HostBlock> b = HostBlocks::Get().Find(data);
    if (b == nullptr || bytes > b->bytes) {
      throw StatusError(morph::NotFoundError("no host block of " + std::to_string(bytes) +
                                             " bytes at " + std::to_string(data)));
    }
    auto* keep = new std::shared_ptr<HostBlock>(std::move(b));
    nb::capsule owner(keep, [](void* p) noexcept {
      delete static_cast<std::shared_ptr<HostBlock>*>(p);
    });
    size_t shape[1] = {bytes};
    return nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::device::cpu>(
        reinterpret_cast<uint8_t*>(data), 1, shape, owner);
  }, "data_ptr"_a, "bytes"_a,
  "A torch uint8 tensor over `bytes` bytes of the host block at data_ptr (a host tensor's "
  "shard), keeping the block alive while torch holds it.");
  m.def("zero_range", [](int64_t n, int dp, int d) {
    morph::Interval i = morph::ZeroRange(n, dp, d);
    return std::make_pair(i.begin, i.end);
  }, "n"_a, "dp"_a, "d"_a, "DP rank d's [begin, end) of n flattened elements under ZeRO.");

  m.def("shard_of", [](const std::string& name, std::vector<int64_t> shape,
                       const std::string& dtype, const morph::Layout& layout,
                       const morph::ParallelConfig& config, int rank) {
    morph::TensorSpec spec{name, ParseDTypeOrThrow(dtype), std::move(shape), layout};
    Check(morph::ValidateTensorSpec(spec));
    morph::Shard s = Value(morph::ShardOf(spec, config, rank));
    return std::make_tuple(s.frame.origin(), s.frame.shape(), s.flat_begin, s.flat_end);
  }, "name"_a, "shape"_a, "dtype"_a, "layout"_a, "config"_a, "rank"_a,
     "(frame origin, frame shape, flat_begin, flat_end) of what `rank` holds (planning "
     "coordinates).");

  nb::class_<morph::ModelShape>(m, "ModelShape")
      .def(nb::init<>())
      .def_rw("num_layers", &morph::ModelShape::num_layers)
      .def_rw("num_heads", &morph::ModelShape::num_heads)
      .def_rw("tp_candidates", &morph::ModelShape::tp_candidates)
      .def_rw("pp_candidates", &morph::ModelShape::pp_candidates)
      .def_rw("global_batch", &morph::ModelShape::global_batch)
      .def_rw("micro_batches", &morph::ModelShape::micro_batches)
      .def_rw("zero_stage", &morph::ModelShape::zero_stage)
      .def_rw("device_memory_bytes", &morph::ModelShape::device_memory_bytes);

  nb::class_<morph::Options>(m, "Options")
      .def(nb::init<>())
      .def_static("from_env", [] { return Value(morph::Options::FromEnv()); },
                  "Options read from the MORPH_* environment (docs/operations.md).")
      .def("validate", [](const morph::Options& o) { Check(o.Validate()); })
      .def_rw("model", &morph::Options::model)
      .def_rw("dataset_samples", &morph::Options::dataset_samples)
      .def_rw("dataset_seed", &morph::Options::dataset_seed)
      .def_rw("dataset_shuffle", &morph::Options::dataset_shuffle)
      .def_rw("micro_batch", &morph::Options::micro_batch)
      .def_rw("coordinator", &morph::Options::coordinator)
      .def_rw("initial_world", &morph::Options::initial_world)
      .def_rw("max_world", &morph::Options::max_world)
      .def_rw("data_hostname", &morph::Options::data_hostname)
      .def_prop_rw("backend",
                   [](const morph::Options& o) { return std::string(morph::BackendName(o.backend)); },
                   [](morph::Options& o, const std::string& b) {
                     o.backend = Value(morph::ParseBackend("backend", b));
                   })
      .def_rw("cuda_device", &morph::Options::cuda_device)
      .def_rw("launcher_local_rank", &morph::Options::launcher_local_rank)
      .def_rw("heartbeat_ms", &morph::Options::heartbeat_ms)
      .def_rw("heartbeat_timeout_ms", &morph::Options::heartbeat_timeout_ms)
      .def_rw("start_timeout_ms", &morph::Options::start_timeout_ms)
      .def_rw("change_timeout_ms", &morph::Options::change_timeout_ms)
      .def_rw("handle_sigterm", &morph::Options::handle_sigterm)
      .def_rw("undo_copy", &morph::Options::undo_copy)
      .def_rw("keep_old_until_barrier", &morph::Options::keep_old_until_barrier)
      .def_rw("checkpoint_dir", &morph::Options::checkpoint_dir)
      .def_rw("checkpoint_every", &morph::Options::checkpoint_every)
      .def_rw("snapshot_every", &morph::Options::snapshot_every);

  nb::class_<morph::Reconfiguration>(m, "Reconfiguration")
      .def_ro("from_generation", &morph::Reconfiguration::from_generation)
      .def_ro("generation", &morph::Reconfiguration::generation)
      .def_ro("step", &morph::Reconfiguration::step)
      .def_ro("old_config", &morph::Reconfiguration::old_config)
      .def_ro("config", &morph::Reconfiguration::config)
      .def_ro("old_rank", &morph::Reconfiguration::old_rank)
      .def_ro("rank", &morph::Reconfiguration::rank)
      .def_ro("communicators_seconds", &morph::Reconfiguration::communicators_seconds)
      .def_ro("plan_seconds", &morph::Reconfiguration::plan_seconds)
      .def_ro("transfer_seconds", &morph::Reconfiguration::transfer_seconds)
      .def_ro("resume_seconds", &morph::Reconfiguration::resume_seconds)
      .def_ro("stall_seconds", &morph::Reconfiguration::stall_seconds)
      .def_ro("bytes_sent", &morph::Reconfiguration::bytes_sent)
      .def_ro("bytes_received", &morph::Reconfiguration::bytes_received)
      .def_ro("peak_bytes", &morph::Reconfiguration::peak_bytes)
      .def_ro("bound_bytes", &morph::Reconfiguration::bound_bytes)
      .def_ro("old_state_bytes", &morph::Reconfiguration::old_state_bytes)
      .def_ro("prepare_bytes", &morph::Reconfiguration::prepare_bytes)
      .def_ro("new_state_bytes", &morph::Reconfiguration::new_state_bytes)
      .def_ro("abort_seconds", &morph::Reconfiguration::abort_seconds)
      .def_ro("recovery", &morph::Reconfiguration::recovery)
      .def_prop_ro("source", [](const morph::Reconfiguration& r) {
        switch (r.source) {
          case morph::RecoverySource::kReplicas: return "replicas";
          case morph::RecoverySource::kSnapshot: return "snapshot";
          case morph::RecoverySource::kCheckpoint: return "checkpoint";
        }
        return "unknown";
      })
      .def_ro("newest_step", &morph::Reconfiguration::newest_step)
      .def_prop_ro("lost_steps", &morph::Reconfiguration::lost_steps)
      .def_ro("stale", &morph::Reconfiguration::stale)
      .def_ro("resumed", &morph::Reconfiguration::resumed)
      .def_ro("checkpoint", &morph::Reconfiguration::checkpoint)
      .def("__repr__", [](const morph::Reconfiguration& r) {
        return "Reconfiguration(generation " + std::to_string(r.from_generation) + " -> " +
               std::to_string(r.generation) + " at step " + std::to_string(r.step) + ": " +
               r.old_config.ToString() + " -> " + r.config.ToString() + ", rank " +
               std::to_string(r.old_rank) + " -> " + std::to_string(r.rank) +
               (r.recovery ? ", recovery" : "") + ")";
      });

  // ---- the state ----
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
              const std::string& dtype, const morph::Layout& layout) {
             morph::TensorAllocator a;
             a.allocate = [tname = name](int64_t bytes) {
               return HostBlocks::Get().Allocate(tname, bytes);
             };
             a.release = [](morph::BufferView v) { HostBlocks::Get().Release(v.data); };
             a.move_pages = [](morph::BufferView from, morph::BufferView to, size_t offset) {
               return HostBlocks::Get().MovePages(from, to, offset);
             };
             a.any_thread = true;
             Check(self.get().AdoptTensor(std::move(name), std::move(shape),
                                          ParseDTypeOrThrow(dtype), layout, std::move(a)));
           },
           "name"_a, "shape"_a, "dtype"_a, "layout"_a,
           "Registers a host tensor whose shards live in blocks this module allocates (any "
           "thread); host_storage(data_ptr, bytes) views one as a torch uint8 tensor.")
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
          throw StatusError(morph::InvalidArgumentError(
              "scalar '" + name + "' holds " + std::to_string(span.size()) + " bytes, got " +
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

  // ---- communicators (the step's: valid until the next begin_step) ----
  nb::class_<CommRef>(m, "Communicator")
      .def_prop_ro("rank", [](const CommRef& c) { return c.get().rank(); })
      .def_prop_ro("size", [](const CommRef& c) { return c.get().size(); })
      .def_prop_ro("generation", [](const CommRef& c) { return c.get().generation(); })
      .def_prop_ro("backend", [](const CommRef& c) { return c.get().capabilities().backend; })
      .def("allreduce", [](const CommRef& c, uintptr_t ptr, size_t count, const std::string& dtype,
                           const std::string& op, int64_t timeout_ms) {
        morph::ReduceOp r = op == "max" ? morph::ReduceOp::kMax
                            : op == "min" ? morph::ReduceOp::kMin : morph::ReduceOp::kSum;
        if (op != "sum" && op != "max" && op != "min") {
          throw StatusError(morph::InvalidArgumentError("reduce op '" + op + "' (sum, max, min)"));
        }
        morph::DType dt = ParseDTypeOrThrow(dtype);
        nb::gil_scoped_release nogil;
        Check(c.get().Allreduce(reinterpret_cast<void*>(ptr), count, dt, r, Ms(timeout_ms)));
      }, "data_ptr"_a, "count"_a, "dtype"_a, "op"_a, "timeout_ms"_a)
      .def("broadcast", [](const CommRef& c, uintptr_t ptr, size_t count, const std::string& dtype,
                           int root, int64_t timeout_ms) {
        morph::DType dt = ParseDTypeOrThrow(dtype);
        nb::gil_scoped_release nogil;
        Check(c.get().Broadcast(reinterpret_cast<void*>(ptr), count, dt, root, Ms(timeout_ms)));
      }, "data_ptr"_a, "count"_a, "dtype"_a, "root"_a, "timeout_ms"_a)
      .def("allgather", [](const CommRef& c, uintptr_t send, uintptr_t recv, size_t count,
                           const std::string& dtype, int64_t timeout_ms) {
        morph::DType dt = ParseDTypeOrThrow(dtype);
        nb::gil_scoped_release nogil;
        Check(c.get().Allgather(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv),
                                count, dt, Ms(timeout_ms)));
      }, "send_ptr"_a, "recv_ptr"_a, "count"_a, "dtype"_a, "timeout_ms"_a)
      .def("barrier", [](const CommRef& c, int64_t timeout_ms) {
        nb::gil_scoped_release nogil;
        Check(c.get().Barrier(Ms(timeout_ms)));
      }, "timeout_ms"_a)
      .def("abort", [](const CommRef& c) { c.get().Abort(); })
      .def("_address", [](const CommRef& c) { return reinterpret_cast<uintptr_t>(&c.get()); },
           "The morph::Communicator's address (for morph._torch_backend; valid as long as the "
           "communicator).")
      .def_prop_ro("broken", [](const CommRef& c) { return c.get().broken(); });

  nb::class_<StepRef>(m, "Step")
      .def_prop_ro("done", [](const StepRef& s) { return s.step.done(); })
      .def_prop_ro("index", [](const StepRef& s) { return s.step.index(); })
      .def_prop_ro("generation", [](const StepRef& s) { return s.step.generation(); })
      .def_prop_ro("reconfigured", [](const StepRef& s) { return s.step.reconfigured(); })
      .def_prop_ro("config", [](const StepRef& s) { return s.step.config(); })
      .def_prop_ro("rank", [](const StepRef& s) { return s.step.rank(); })
      .def_prop_ro("world_size", [](const StepRef& s) { return s.step.world_size(); })
      .def_prop_ro("coords", [](const StepRef& s) {
        auto c = s.step.coords();
        return std::make_tuple(c.p, c.d, c.t);
      })
      .def_prop_ro("samples", [](const StepRef& s) { return s.step.samples(); })
      .def_prop_ro("micro_batches", [](const StepRef& s) { return s.step.batch().micro_batches; })
      .def_prop_ro("global_batch", [](const StepRef& s) { return s.step.global_batch(); })
      .def("communicator", [](const StepRef& s, const std::string& which) {
        if (s.step.done()) throw StatusError(morph::FailedPreconditionError("the step is done"));
        if (which == "world") return CommRef{&s.step.world()};
        if (which == "dp") return CommRef{&s.step.dp()};
        if (which == "tp") return CommRef{&s.step.tp()};
        if (which == "pp") return CommRef{&s.step.pp()};
        throw StatusError(morph::InvalidArgumentError("communicator '" + which +
                                                      "' (world, dp, tp, pp)"));
      }, "which"_a);

  // ---- the runtime ----
  nb::class_<Runtime>(m, "Runtime")
      .def_static("start", [](morph::Options options, nb::object declare) {
        std::optional<nb::python_error> py_error;  // what declare raised, re-raised below
        auto rt = std::make_unique<Runtime>();
        StatusOr<std::unique_ptr<morph::Runtime>> started = [&] {
          nb::gil_scoped_release nogil;
          return morph::Runtime::Start(std::move(options), [&](morph::State& s) -> Status {
            nb::gil_scoped_acquire gil;
            try {
              declare(StateRef{&s});
              return Status::Ok();
            } catch (nb::python_error& e) {
              py_error.emplace(e);
              return morph::InvalidArgumentError(std::string("declare raised: ") + e.what());
            } catch (const StatusError& e) {
              return e.status;
            }
          });
        }();
        if (py_error) throw nb::python_error(*py_error);
        rt->rt = Value(std::move(started));
        return rt;
      }, "options"_a, "declare"_a)
      .def_prop_ro("state", [](Runtime& r) { return StateRef{&r.get().state()}; })
      .def_prop_ro("fresh_start", [](Runtime& r) { return r.get().fresh_start(); })
      .def_prop_ro("last_reconfiguration", [](Runtime& r) { return r.get().last_reconfiguration(); })
      .def("begin_step", [](Runtime& r) {
        morph::Runtime& rt = r.get();
        StatusOr<morph::Step> s = [&] {
          nb::gil_scoped_release nogil;
          return rt.BeginStep();
        }();
        return StepRef{Value(std::move(s))};
      })
      .def("begin_update", [](Runtime& r) { r.get().BeginUpdate(); }, Release())
      .def("commit_update", [](Runtime& r) { Check(r.get().CommitUpdate()); }, Release())
      .def("end_step", [](Runtime& r) { Check(r.get().EndStep()); }, Release())
      .def("abort_step", [](Runtime& r, int code, const std::string& message) {
        Status why(static_cast<morph::StatusCode>(code), message);
        nb::gil_scoped_release nogil;
        Check(r.get().AbortStep(why));
      }, "code"_a, "message"_a)
      .def_prop_ro("finished", [](Runtime& r) { return r.get().Finished(); })
      .def("leave", [](Runtime& r, std::string reason) { r.get().Leave(std::move(reason)); },
           "reason"_a = "leave()", Release())
      .def("finish", [](Runtime& r, int64_t timeout_ms) { Check(r.get().Finish(timeout_ms)); },
           "timeout_ms"_a = 60000, Release())
      .def("close", [](Runtime& r) {
        std::unique_ptr<morph::Runtime> rt = std::move(r.rt);
        nb::gil_scoped_release nogil;  // the destructor may wait; allocator releases take the GIL
        rt.reset();
      })
      .def_prop_ro("worker_id", [](Runtime& r) { return r.get().worker_id(); })
      .def_prop_ro("generation", [](Runtime& r) { return r.get().generation().id; })
      .def_prop_ro("config", [](Runtime& r) { return r.get().generation().config; })
      .def_prop_ro("rank", [](Runtime& r) { return r.get().rank(); })
      .def_prop_ro("next_step", [](Runtime& r) { return r.get().next_step(); })
      .def_prop_ro("coordinator_address", [](Runtime& r) { return r.get().coordinator_address(); })
      .def_prop_ro("api_address", [](Runtime& r) { return r.get().api_address(); });
}
