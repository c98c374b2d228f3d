// JAX on a CPU: Keras' Adam with the step's averages folded in
// (adam_average.h) as an XLA FFI handler, called from JAX's compiled step
// through `jax.ffi.ffi_call` with every state buffer aliased to its output
// (updated in place under donation). XLA's own CPU code makes one loop per
// output and reads the new moments and weights back: 13 floats an element
// where this moves 9. Built by keras_ema_opt/backend/_jax_cpu.py.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "adam_average.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using keras_ema_opt::kMaxAverages;
using keras_ema_opt::kRuleScalars;
using keras_ema_opt::Step;
using keras_ema_opt::Tensor;

struct Work {
  Step step;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
};

void RunPieces(Work& work) {
  const size_t count = work.step.pieces.size();
  for (size_t p = work.next.fetch_add(1); p < count;
       p = work.next.fetch_add(1)) {
    keras_ema_opt::RunPiece(work.step, work.step.pieces[p]);
    work.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error AdamAverageImpl(ffi::ThreadPool pool,
                           ffi::Buffer<ffi::F32> scalars,
                           ffi::RemainingArgs args, ffi::RemainingRets rets,
                           int64_t averages, int64_t decay) {
  if (averages < 0 || averages > kMaxAverages) {
    return ffi::Error::InvalidArgument("averages must be 0 to 2");
  }
  const int64_t in_per = 4 + averages, out_per = 3 + averages;
  if (args.size() % in_per != 0 ||
      rets.size() != args.size() / in_per * out_per) {
    return ffi::Error::InvalidArgument("unexpected number of buffers");
  }
  if (scalars.element_count() !=
      static_cast<size_t>(kRuleScalars + averages)) {
    return ffi::Error::InvalidArgument("unexpected number of scalars");
  }
  auto work = std::make_shared<Work>();
  Step& step = work->step;
  step.SetScalars(scalars.typed_data(), static_cast<int>(averages),
                  decay != 0);
  const size_t n = args.size() / in_per;
  step.tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto in = [&](int64_t k) {
      return args.get<ffi::Buffer<ffi::F32>>(i * in_per + k);
    };
    auto out = [&](int64_t k) {
      return rets.get<ffi::Buffer<ffi::F32>>(i * out_per + k);
    };
    auto g = in(0), m = in(1), v = in(2), w = in(3);
    auto m_out = out(0), v_out = out(1), w_out = out(2);
    if (g.has_error() || m.has_error() || v.has_error() || w.has_error() ||
        m_out.has_error() || v_out.has_error() || w_out.has_error()) {
      return ffi::Error::InvalidArgument("buffers must be float32");
    }
    const size_t size = w->element_count();
    if (g->element_count() != size || m->element_count() != size ||
        v->element_count() != size) {
      return ffi::Error::InvalidArgument("buffers of one tensor differ");
    }
    Tensor t{};
    t.g = g->typed_data();
    t.m_in = m->typed_data();
    t.v_in = v->typed_data();
    t.w_in = w->typed_data();
    t.m = (*m_out)->typed_data();
    t.v = (*v_out)->typed_data();
    t.w = (*w_out)->typed_data();
    for (int j = 0; j < averages; ++j) {
      auto a = in(4 + j);
      auto a_out = out(3 + j);
      if (a.has_error() || a_out.has_error() ||
          a->element_count() != size) {
        return ffi::Error::InvalidArgument("averages must match weights");
      }
      t.a_in[j] = a->typed_data();
      t.a[j] = (*a_out)->typed_data();
    }
    step.tensors.push_back(t);
    step.AddPieces(static_cast<int64_t>(size));
  }
  // Helpers from XLA's intra-op pool take pieces as they come free; this
  // thread takes them too, and waits only for pieces a helper has begun,
  // never for a helper that has not started (the pool may be busy: it
  // runs other parts of the program, or this very call).
  const int64_t helpers = std::min<int64_t>(
      std::max<int64_t>(pool.num_threads(), 1) - 1,
      static_cast<int64_t>(step.pieces.size()) - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([work] { RunPieces(*work); });
  }
  RunPieces(*work);
  while (work->done.load(std::memory_order_acquire) < step.pieces.size()) {
    std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KeoAdamAverage, AdamAverageImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("averages")
                                  .Attr<int64_t>("decay"));
