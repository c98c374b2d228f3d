// Keras' Adam update with the step's weight averages folded in, for
// float32 tensors: one pass over each tensor, reading g, m, v, w and each
// average once and writing m, v, w and each average once (9 floats an
// element with one average). Shared by the JAX (XLA FFI, jax_kernels.cc)
// and TensorFlow (custom op, tf_kernels.cc) kernels, built on first use by
// keras_ema_opt/backend/_native.py.
//
// The rule is Keras' `keras.optimizers.Adam.update_step`, in float32, in
// its order of operations (no contraction into fused multiply-adds), after
// its decoupled weight decay where the step has one (AdamW, or Adam with
// `weight_decay`: Keras' `_apply_weight_decay`, run right before the
// update step):
//   w <- w - w * wd * lr            (decayed tensors only)
//   m <- m + (g - m) * c1           c1 = 1 - beta_1 (float32)
//   v <- v + (g * g - v) * c2       c2 = 1 - beta_2 (float32)
//   w <- w - (m * alpha) / (sqrt(v) + eps)
// and each average is the averaging engine's `_mix` with the step's weight
// u (keras_ema_opt/averaging/engine.py): `a + u (w - a)` from the nearer
// end, the new weight copied where u is exactly 1 and the average kept
// where u is exactly 0, whatever the values.

#ifndef KERAS_EMA_OPT_ADAM_AVERAGE_H_
#define KERAS_EMA_OPT_ADAM_AVERAGE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace keras_ema_opt {

constexpr int kMaxAverages = 2;  // UpdatePiece spells out each
constexpr int kRuleScalars = 6;  // alpha, c1, c2, eps, wd, lr
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

struct Step {
  std::vector<Tensor> tensors;
  std::vector<Piece> pieces;
  int averages = 0;
  bool decay = false;  // every tensor of the step decayed, or none
  float alpha, c1, c2, eps, wd, lr;
  int mode[kMaxAverages];
  int near_average[kMaxAverages];
  float base_weight[kMaxAverages];

  // scalars (kRuleScalars + k): alpha, 1 - beta_1, 1 - beta_2, epsilon,
  // the weight decay and the learning rate (read where `decay`), then one
  // weight u per average.
  void SetScalars(const float* s, int k, bool decayed) {
    averages = k;
    decay = decayed;
    alpha = s[0];
    c1 = s[1];
    c2 = s[2];
    eps = s[3];
    wd = s[4];
    lr = s[5];
    for (int j = 0; j < k; ++j) {
      const float u = s[kRuleScalars + j];
      mode[j] = u == 1.0f ? kCopy : u == 0.0f ? kKeep : kMix;
      near_average[j] = u < 0.5f;
      base_weight[j] = u < 0.5f ? u : u - 1.0f;
    }
  }

  // Cut the tensor just added into pieces of work.
  void AddPieces(int64_t size) {
    const int64_t i = static_cast<int64_t>(tensors.size()) - 1;
    for (int64_t begin = 0; begin < size; begin += kPiece) {
      pieces.push_back({i, begin, std::min(begin + kPiece, size)});
    }
  }
};

// The average's update: the engine's `_mix`.
inline float Mix(float a, float w, bool copy, bool keep, bool near,
                 float step) {
  const float mixed = (near ? a : w) + step * (w - a);
  return copy ? w : keep ? a : mixed;
}

template <int K, bool D>
void UpdatePiece(const Step& s, const Piece& piece) {
  const Tensor& t = s.tensors[piece.tensor];
  const float alpha = s.alpha, c1 = s.c1, c2 = s.c2, eps = s.eps;
  const float wd = s.wd, lr = s.lr;
  const int64_t b = piece.begin, n = piece.end - piece.begin;
  const float* g = t.g + b;
  const float* m_in = t.m_in + b;
  const float* v_in = t.v_in + b;
  const float* w_in = t.w_in + b;
  float* m_out = t.m + b;
  float* v_out = t.v + b;
  float* w_out = t.w + b;
  // The averages' pointers and rules as locals, one set each (an array
  // of pointers indexed in the loop keeps GCC from vectorizing it).
  const float* a0_in = K > 0 ? t.a_in[0] + b : nullptr;
  const float* a1_in = K > 1 ? t.a_in[1] + b : nullptr;
  float* a0_out = K > 0 ? t.a[0] + b : nullptr;
  float* a1_out = K > 1 ? t.a[1] + b : nullptr;
  const bool copy0 = K > 0 && s.mode[0] == kCopy;
  const bool keep0 = K > 0 && s.mode[0] == kKeep;
  const bool near0 = K > 0 && s.near_average[0];
  const float step0 = K > 0 ? s.base_weight[0] : 0.0f;
  const bool copy1 = K > 1 && s.mode[1] == kCopy;
  const bool keep1 = K > 1 && s.mode[1] == kKeep;
  const bool near1 = K > 1 && s.near_average[1];
  const float step1 = K > 1 ? s.base_weight[1] : 0.0f;
  // Each element is read before it is written, by the same iteration:
  // the outputs may be the inputs' own buffers (aliased), and no
  // iteration depends on another.
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float m = m_in[i] + (gi - m_in[i]) * c1;
    const float v = v_in[i] + (gi * gi - v_in[i]) * c2;
    const float w0 = D ? w_in[i] - w_in[i] * wd * lr : w_in[i];
    const float w = w0 - (m * alpha) / (std::sqrt(v) + eps);
    m_out[i] = m;
    v_out[i] = v;
    w_out[i] = w;
    if (K > 0) a0_out[i] = Mix(a0_in[i], w, copy0, keep0, near0, step0);
    if (K > 1) a1_out[i] = Mix(a1_in[i], w, copy1, keep1, near1, step1);
  }
}

template <bool D>
void RunPieceWith(const Step& step, const Piece& piece) {
  switch (step.averages) {
    case 0: UpdatePiece<0, D>(step, piece); break;
    case 1: UpdatePiece<1, D>(step, piece); break;
    default: UpdatePiece<2, D>(step, piece); break;
  }
}

inline void RunPiece(const Step& step, const Piece& piece) {
  if (step.decay) {
    RunPieceWith<true>(step, piece);
  } else {
    RunPieceWith<false>(step, piece);
  }
}

}  // namespace keras_ema_opt

#endif  // KERAS_EMA_OPT_ADAM_AVERAGE_H_
