// morph: elastic training for data-, tensor- and pipeline-parallel jobs (docs/design.md). When
// the allocation changes — a scheduler grows or shrinks the job, a worker is preempted or dies —
// the surviving processes stay alive, the state is resharded in memory, and training resumes at
// the next step. The one header a training program includes; link morph::morph (libmorph).
//
//   auto rt = *morph::Runtime::Start(*morph::Options::FromEnv(), [](morph::State& s) {
//     return s.AddTensor("w", {4096, 4096}, morph::DType::kF32, morph::Layout::Layer(0).SplitTP(1));
//   });
//   while (true) {
//     morph::Step step = *rt->BeginStep();                  // a change applies here
//     if (step.done() || step.index() >= steps) break;
//     Train(step, rt->state());                             // step.tp(), step.samples(), ...
//     (void)rt->EndStep();
//   }
//   return rt->Finish().ok() ? 0 : 1;
//
// What is here: Runtime (runtime.h) with its Options, State, Step and Reconfiguration; the
// dataset cursor that decides each step's samples (dataset_cursor.h); the
// communicators a step hands out (communicator.h); layouts (layout.h, box.h, shard.h) and
// element types (dtype.h); Status (status.h); the job's store for a library's rendezvous
// (key_value_store.h); checkpoints (checkpoint.h); the planner's dry run
// (plan.h). Everything else in the source tree is internal and may change.
#ifndef MORPH_MORPH_H_
#define MORPH_MORPH_H_

#include "morph/api.h"
#include "morph/box.h"
#include "morph/buffer.h"
#include "morph/checkpoint.h"
#include "morph/communicator.h"
#include "morph/dataset_cursor.h"
#include "morph/deadline.h"
#include "morph/dtype.h"
#include "morph/generation.h"
#include "morph/key_value_store.h"
#include "morph/layout.h"
#include "morph/options.h"
#include "morph/parallel_config.h"
#include "morph/plan.h"
#include "morph/runtime.h"
#include "morph/shard.h"
#include "morph/state.h"
#include "morph/status.h"
#include "morph/step.h"

#endif  // MORPH_MORPH_H_
