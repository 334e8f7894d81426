// morph._morph: the thin binding of libmorph's public surface (include/morph/morph.h) for the
// Python package (python/src/morph/). Everything Pythonic — torch tensors, the step context,
// exception classes, process groups — lives in the Python layer above; the binding only converts
// types, turns a non-OK Status into a StatusError (which the translator below raises as
// morph.<Code>Error, built by morph._errors), and releases the GIL around every call that blocks
// or moves data. This file: the module, the translator and the value types; runtime_ext.cc: the
// runtime and the objects a program keeps (State, Step, Communicator, KeyValueStore);
// host_blocks.cc: the storage of host tensors.
//
// Tensor storage is adopted by morph (State::AdoptTensor), visible to torch without a copy:
//  - host tensors: blocks of host_blocks.cc, allocated without Python, so from any thread;
//  - CUDA tensors: the allocator calls back into Python (holding the GIL only for that call)
//    for a torch tensor of the asked bytes on the device, and hands its pointer to morph.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <glog/logging.h>
#include <morph/morph.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "ext.h"

namespace nb = nanobind;
using namespace nb::literals;
using morph_py::Check;
using morph_py::Fail;
using morph_py::ParseDTypeOrThrow;
using morph_py::StatusError;
using morph_py::Value;

namespace {
std::once_flag g_logging_once;

// DatasetCursor's preconditions, as InvalidArgumentError (the C++ calls do not check them).
void CheckCursorArgs(int64_t step, int dp, int dp_rank, int64_t micro_batch) {
  if (step < 0 || step >= (int64_t{1} << 40)) {
    Fail(morph::InvalidArgumentError("step " + std::to_string(step) + ": not in [0, 2^40)"));
  }
  if (dp < 1 || dp_rank < 0 || dp_rank >= dp) {
    Fail(morph::InvalidArgumentError("dp_rank " + std::to_string(dp_rank) + " of dp " +
                                     std::to_string(dp) + ": want dp >= 1, 0 <= dp_rank < dp"));
  }
  if (micro_batch < 1) {
    Fail(morph::InvalidArgumentError("micro_batch " + std::to_string(micro_batch) + " < 1"));
  }
}
}  // namespace

NB_MODULE(_morph, m) {
  m.doc() = "libmorph's public surface (the morph package wraps it; use `import morph`).";

  // Objects of the module that torch or the package keep until the interpreter's end (a
  // registered backend creator, a process group's options) are not leaks a program can act
  // on: without this every worker's exit printed nanobind's leak report.
  nb::set_leak_warnings(false);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const morph::Status& s = e.status;
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

  morph_py::BindHostStorage(m);
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

  // ---- the dataset cursor (morph/dataset_cursor.h): a value, any thread ----
  nb::class_<morph::RankBatch>(m, "RankBatch")
      .def_ro("first_position", &morph::RankBatch::first_position)
      .def_ro("samples", &morph::RankBatch::samples)
      .def_ro("micro_batches", &morph::RankBatch::micro_batches);

  nb::class_<morph::DatasetCursor>(m, "DatasetCursor")
      .def("__init__", [](morph::DatasetCursor* self, int64_t num_samples, int64_t global_batch,
                          uint64_t seed, bool shuffle) {
        new (self) morph::DatasetCursor(Value(morph::DatasetCursor::Create(
            {.num_samples = num_samples, .global_batch = global_batch, .seed = seed,
             .shuffle = shuffle})));
      }, "num_samples"_a, "global_batch"_a, "seed"_a = 0, "shuffle"_a = true,
         "InvalidArgumentError naming the field for a count below 1 or a global batch above "
         "2^22.")
      .def_prop_ro("num_samples", [](const morph::DatasetCursor& c) { return c.spec().num_samples; })
      .def_prop_ro("global_batch",
                   [](const morph::DatasetCursor& c) { return c.spec().global_batch; })
      .def_prop_ro("seed", [](const morph::DatasetCursor& c) { return c.spec().seed; })
      .def_prop_ro("shuffle", [](const morph::DatasetCursor& c) { return c.spec().shuffle; })
      .def("sample_at", [](const morph::DatasetCursor& c, int64_t pos) {
        if (pos < 0) Fail(morph::InvalidArgumentError("position " + std::to_string(pos) + " < 0"));
        return c.SampleAt(pos);
      }, "pos"_a, "The sample at stream position `pos`.")
      .def("range_for", [](const morph::DatasetCursor& c, int64_t step, int dp, int dp_rank) {
        CheckCursorArgs(step, dp, dp_rank, 1);
        morph::DatasetCursor::Range r = c.RangeFor(step, dp, dp_rank);
        return std::make_pair(r.begin, r.end);
      }, "step"_a, "dp"_a, "dp_rank"_a,
         "[begin, end) of the stream positions DP rank `dp_rank` of `dp` takes at `step`.")
      .def("batch_for", [](const morph::DatasetCursor& c, int64_t step, int dp, int dp_rank,
                           int64_t micro_batch) {
        CheckCursorArgs(step, dp, dp_rank, micro_batch);
        return c.BatchFor(step, dp, dp_rank, micro_batch);
      }, "step"_a, "dp"_a, "dp_rank"_a, "micro_batch"_a,
         "DP rank `dp_rank`'s samples of `step` under `dp` ranks, cut into micro-batches of at "
         "most `micro_batch` (what Step.samples and Step.micro_batches hold).")
      .def("__getstate__", [](const morph::DatasetCursor& c) {
        const morph::DatasetSpec& s = c.spec();
        return std::make_tuple(s.num_samples, s.global_batch, s.seed, s.shuffle);
      })
      .def("__setstate__", [](morph::DatasetCursor* self,
                              const std::tuple<int64_t, int64_t, uint64_t, bool>& t) {
        new (self) morph::DatasetCursor(Value(morph::DatasetCursor::Create(
            {.num_samples = std::get<0>(t), .global_batch = std::get<1>(t),
             .seed = std::get<2>(t), .shuffle = std::get<3>(t)})));
      })
      .def("__repr__", [](const morph::DatasetCursor& c) {
        const morph::DatasetSpec& s = c.spec();
        return "DatasetCursor(num_samples=" + std::to_string(s.num_samples) +
               ", global_batch=" + std::to_string(s.global_batch) + ", seed=" +
               std::to_string(s.seed) + ", shuffle=" + (s.shuffle ? "True" : "False") + ")";
      });

  morph_py::BindRuntime(m);
}
