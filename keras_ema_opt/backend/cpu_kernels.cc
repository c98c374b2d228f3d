// Keras' Adam update with the step's weight averages folded in, for
// float32 tensors on XLA's CPU client: one pass over each tensor, reading
// g, m, v, w and each average once and writing m, v, w and each average
// once (9 floats an element with one average), where XLA's CPU code makes
// one loop per output and reads the new moments and weights back (13).
//
// Built on first use by keras_ema_opt/backend/_jax_cpu.py with the
// system's C++ compiler against jaxlib's XLA FFI headers, and called from
// JAX's compiled step through `jax.ffi.ffi_call` with every state buffer
// aliased to its output (updated in place under donation).
//
// The rule is Keras' `keras.optimizers.Adam.update_step`, in float32, in
// its order of operations (no contraction into fused multiply-adds):
//   m <- m + (g - m) * c1           c1 = 1 - beta_1 (float32)
//   v <- v + (g * g - v) * c2       c2 = 1 - beta_2 (float32)
//   w <- w - (m * alpha) / (sqrt(v) + eps)
// and each average is the averaging engine's `_mix` with the step's weight
// u (keras_ema_opt/averaging/engine.py): `a + u (w - a)` from the nearer
// end, the new weight copied where u is exactly 1 and the average kept
// where u is exactly 0, whatever the values.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxAverages = 2;
constexpr int64_t kPiece = 16384;  // elements of a unit of work (64 kB)

enum Mode : int { kMix = 0, kCopy = 1, kKeep = 2 };

struct Tensor {
  const float* g;
  const float* m_in;
  const float* v_in;
  const float* w_in;
  const float* a_in[kMaxAverages];
  float* m;
  float* v;
  float* w;
  float* a[kMaxAverages];
};

struct Piece {
  int64_t tensor, begin, end;
};

struct Work {
  std::vector<Tensor> tensors;
  std::vector<Piece> pieces;
  float alpha, c1, c2, eps;
  int mode[kMaxAverages];
  int near_average[kMaxAverages];
  float base_weight[kMaxAverages];
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
};

template <int K>
void UpdatePiece(const Work& work, const Piece& piece) {
  const Tensor& t = work.tensors[piece.tensor];
  const float alpha = work.alpha, c1 = work.c1, c2 = work.c2, eps = work.eps;
  const int64_t b = piece.begin, n = piece.end - piece.begin;
  const float* g = t.g + b;
  const float* m_in = t.m_in + b;
  const float* v_in = t.v_in + b;
  const float* w_in = t.w_in + b;
  float* m_out = t.m + b;
  float* v_out = t.v + b;
  float* w_out = t.w + b;
  const float* a_in[kMaxAverages + 1];
  float* a_out[kMaxAverages + 1];
  bool copy[kMaxAverages + 1], keep[kMaxAverages + 1], near[kMaxAverages + 1];
  float step[kMaxAverages + 1];
  for (int j = 0; j < K; ++j) {
    a_in[j] = t.a_in[j] + b;
    a_out[j] = t.a[j] + b;
    copy[j] = work.mode[j] == kCopy;
    keep[j] = work.mode[j] == kKeep;
    near[j] = work.near_average[j];
    step[j] = work.base_weight[j];
  }
  // Each element is read before it is written, by the same iteration:
  // the outputs may be the inputs' own buffers (aliased), and no
  // iteration depends on another.
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float m = m_in[i] + (gi - m_in[i]) * c1;
    const float v = v_in[i] + (gi * gi - v_in[i]) * c2;
    const float w = w_in[i] - (m * alpha) / (std::sqrt(v) + eps);
    m_out[i] = m;
    v_out[i] = v;
    w_out[i] = w;
    for (int j = 0; j < K; ++j) {
      const float a = a_in[j][i];
      const float mixed = (near[j] ? a : w) + step[j] * (w - a);
      a_out[j][i] = copy[j] ? w : keep[j] ? a : mixed;
    }
  }
}

void RunPieces(Work& work, int averages) {
  const size_t count = work.pieces.size();
  for (size_t p = work.next.fetch_add(1); p < count;
       p = work.next.fetch_add(1)) {
    switch (averages) {
      case 0: UpdatePiece<0>(work, work.pieces[p]); break;
      case 1: UpdatePiece<1>(work, work.pieces[p]); break;
      default: UpdatePiece<2>(work, work.pieces[p]); break;
    }
    work.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error AdamAverageImpl(ffi::ThreadPool pool,
                           ffi::Buffer<ffi::F32> scalars,
                           ffi::RemainingArgs args, ffi::RemainingRets rets,
                           int64_t averages) {
  if (averages < 0 || averages > kMaxAverages) {
    return ffi::Error::InvalidArgument("averages must be 0 to 2");
  }
  const int64_t in_per = 4 + averages, out_per = 3 + averages;
  if (args.size() % in_per != 0 ||
      rets.size() != args.size() / in_per * out_per) {
    return ffi::Error::InvalidArgument("unexpected number of buffers");
  }
  if (scalars.element_count() != 4 + averages) {
    return ffi::Error::InvalidArgument("unexpected number of scalars");
  }
  auto work = std::make_shared<Work>();
  const float* s = scalars.typed_data();
  work->alpha = s[0];
  work->c1 = s[1];
  work->c2 = s[2];
  work->eps = s[3];
  for (int j = 0; j < averages; ++j) {
    const float u = s[4 + j];
    work->mode[j] = u == 1.0f ? kCopy : u == 0.0f ? kKeep : kMix;
    work->near_average[j] = u < 0.5f;
    work->base_weight[j] = u < 0.5f ? u : u - 1.0f;
  }
  const size_t n = args.size() / in_per;
  work->tensors.resize(n);
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
    Tensor& t = work->tensors[i];
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
    for (int64_t begin = 0; begin < static_cast<int64_t>(size);
         begin += kPiece) {
      work->pieces.push_back(
          {static_cast<int64_t>(i), begin,
           std::min<int64_t>(begin + kPiece, static_cast<int64_t>(size))});
    }
  }
  // Helpers from XLA's intra-op pool take pieces as they come free; this
  // thread takes them too, and waits only for pieces a helper has begun,
  // never for a helper that has not started (the pool may be busy: it
  // runs other parts of the program, or this very call).
  const int64_t helpers = std::min<int64_t>(
      std::max<int64_t>(pool.num_threads(), 1) - 1,
      static_cast<int64_t>(work->pieces.size()) - 1);
  const int k = static_cast<int>(averages);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([work, k] { RunPieces(*work, k); });
  }
  RunPieces(*work, k);
  while (work->done.load(std::memory_order_acquire) < work->pieces.size()) {
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
                                  .Attr<int64_t>("averages"));
