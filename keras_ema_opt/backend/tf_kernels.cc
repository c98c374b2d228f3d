// TensorFlow on a CPU: Keras' Adam with the step's averages folded in
// (adam_average.h) as one custom op over every variable of the step, in
// place of Keras' per-variable ops (about ten each, and one or two per
// average): one kernel launch and one pass over each tensor. Built by
// keras_ema_opt/backend/_tf_cpu.py against TensorFlow's headers.
//
// Inputs: the resource handles of the weights, one input each; then one
// tensor of resource handles, per variable its first and second moments and
// averages (2 + averages each); then the dense float32 gradients, then the
// float32 scalars of adam_average.h. The slots' handles come packed because
// TensorFlow pays for each resource a function takes, a few microseconds a
// call (_tf_cpu.py packs them once and orders the function's other uses of
// those variables around the op). The variables are locked (each mutex once,
// in address order, as TensorFlow's training ops lock theirs) and made sole
// owners of their buffers before they are written (copy-on-write, as
// TensorFlow's training ops do).

#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <vector>

#include "adam_average.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tensorflow {
namespace {

using CPUDevice = Eigen::ThreadPoolDevice;

REGISTER_OP("KerasEmaOptAdamAverage")
    .Input("weights: num_variables * resource")
    .Input("slots: resource")
    .Input("grads: num_variables * float")
    .Input("scalars: float")
    .Attr("num_variables: int >= 1")
    .Attr("averages: int >= 0")
    .Attr("decay: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

class AdamAverageOp : public OpKernel {
 public:
  explicit AdamAverageOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &num_variables_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("averages", &averages_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
    OP_REQUIRES(ctx, averages_ <= keras_ema_opt::kMaxAverages,
                errors::InvalidArgument("averages must be 0 to 2"));
  }

  void Compute(OpKernelContext* ctx) override {
    const int per = 3 + averages_;
    const int handles = num_variables_ * per;
    const Tensor& slots = ctx->input(num_variables_);
    OP_REQUIRES(ctx,
                slots.dims() == 1 &&
                    slots.NumElements() == num_variables_ * (2 + averages_),
                errors::InvalidArgument(
                    "expected ", num_variables_ * (2 + averages_),
                    " slot handles (2 + averages a variable), got shape ",
                    slots.shape().DebugString()));
    const auto slot_handles = slots.flat<ResourceHandle>();
    const int grads_at = num_variables_ + 1;  // after the weights, the pack
    const Tensor& scalars = ctx->input(grads_at + num_variables_);
    OP_REQUIRES(ctx,
                scalars.NumElements() == keras_ema_opt::kRuleScalars +
                                             averages_,
                errors::InvalidArgument("expected ",
                                        keras_ema_opt::kRuleScalars +
                                            averages_,
                                        " scalars, got ",
                                        scalars.NumElements()));
    std::vector<core::RefCountPtr<Var>> vars(handles);
    std::vector<mutex*> mutexes;
    mutexes.reserve(handles);
    for (int v = 0; v < num_variables_; ++v) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, v),
                                         &vars[v * per]));
      for (int k = 1; k < per; ++k) {
        OP_REQUIRES_OK(ctx,
                       LookupResource(ctx, slot_handles(v * (per - 1) + k - 1),
                                      &vars[v * per + k]));
      }
    }
    for (const auto& var : vars) mutexes.push_back(var->mu());
    std::sort(mutexes.begin(), mutexes.end());
    mutexes.erase(std::unique(mutexes.begin(), mutexes.end()),
                  mutexes.end());
    OP_REQUIRES(ctx, static_cast<int>(mutexes.size()) == handles,
                errors::InvalidArgument("a variable is given twice"));
    std::vector<mutex_lock> locks;
    locks.reserve(mutexes.size());
    for (mutex* mu : mutexes) locks.emplace_back(*mu);

    keras_ema_opt::Step step;
    step.SetScalars(scalars.flat<float>().data(), averages_, decay_);
    step.tensors.reserve(num_variables_);
    std::vector<Tensor> held;  // the buffers written, alive to the end
    held.reserve(handles);
    for (int v = 0; v < num_variables_; ++v) {
      const Tensor& grad = ctx->input(grads_at + v);
      float* buffers[3 + keras_ema_opt::kMaxAverages];
      for (int k = 0; k < per; ++k) {
        Var* var = vars[v * per + k].get();
        OP_REQUIRES(ctx, var->tensor()->IsInitialized(),
                    errors::FailedPrecondition("uninitialized variable"));
        OP_REQUIRES(ctx, var->tensor()->dtype() == DT_FLOAT,
                    errors::InvalidArgument("variables must be float32"));
        OP_REQUIRES(ctx, var->tensor()->shape() == grad.shape(),
                    errors::InvalidArgument(
                        "variable ", v, " has shape ",
                        var->tensor()->shape().DebugString(),
                        ", its gradient or slot ",
                        grad.shape().DebugString()));
        OP_REQUIRES_OK(ctx, PrepareToUpdateVariable<CPUDevice, float>(
                                ctx, var->tensor(),
                                var->copy_on_read_mode.load()));
        held.push_back(*var->tensor());
        buffers[k] = held.back().flat<float>().data();
      }
      keras_ema_opt::Tensor t{};
      t.g = grad.flat<float>().data();
      t.w_in = t.w = buffers[0];
      t.m_in = t.m = buffers[1];
      t.v_in = t.v = buffers[2];
      for (int j = 0; j < averages_; ++j) {
        t.a_in[j] = t.a[j] = buffers[3 + j];
      }
      step.tensors.push_back(t);
      step.AddPieces(grad.NumElements());
    }
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t pieces = static_cast<int64_t>(step.pieces.size());
    // A piece of 16,384 elements moves about 600 kB: always worth a thread.
    workers->ParallelFor(pieces, /*cost_per_unit=*/1 << 20,
                         [&step](int64_t begin, int64_t end) {
                           for (int64_t p = begin; p < end; ++p) {
                             keras_ema_opt::RunPiece(step, step.pieces[p]);
                           }
                         });
  }

 private:
  int num_variables_ = 0;
  int averages_ = 0;
  bool decay_ = false;
};

REGISTER_KERNEL_BUILDER(Name("KerasEmaOptAdamAverage").Device(DEVICE_CPU),
                        AdamAverageOp);

}  // namespace
}  // namespace tensorflow
