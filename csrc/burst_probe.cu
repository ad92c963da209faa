// Burst-Gap calibration probes: trains of store bursts from K producer CTAs, timed on the GPU.
//
// K co-resident CTAs (the producers) repeat, for every burst of a train: meet at a grid-wide arrival counter
// (so that the K shares of a burst start together), spin a gap G, record the start, store their share of the
// burst's V bytes into the destination (a peer's symmetric buffer, or local memory in loopback), and record the
// end. The end is taken right after the CTA's threads issued their stores ("issue returned": st.global retires
// into the memory pipeline and only stalls when the path downstream is full), not when the bytes land; with
// `fence` every thread first waits for its stores to be visible at system scope, which measures the time until
// the destination sees the data instead. Bursts rotate through the destination buffer so a train does not
// rewrite cache-resident lines.
//
// Times are SM cycles (clock64: cycle resolution, per SM); `clock_rate` measures cycles per nanosecond against
// %globaltimer (nanoseconds, but updated only about once a microsecond on some parts) over a long spin, which
// converts them, and gaps are given in cycles. Every wait is bounded: a producer that does not arrive within
// `timeout_cycles` makes the kernel report the burst it stalled at instead of hanging.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <tuple>

namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 of every CTA arrives; returns false if the others did not all arrive in time, or if another
// producer already gave up (then the CTAs not yet resident leave at once instead of each timing out).
__device__ bool arrive_and_wait(unsigned int* counter, unsigned int target, long long timeout_cycles,
                                const int* error) {
  atomicAdd(counter, 1u);
  const long long start = clock64();
  while (load_acquire(counter) < target) {
    if (*reinterpret_cast<const volatile int*>(error) != 0 || clock64() - start > timeout_cycles) return false;
  }
  return true;
}

__global__ void burst_train_kernel(uint4* dst, int64_t slots, int64_t vec_per_cta, int bursts,
                                   long long gap_cycles, bool fence, long long timeout_cycles,
                                   unsigned int* counter, long long* clocks, int* error) {
  __shared__ long long start;
  const int cta = blockIdx.x;
  const int producers = gridDim.x;
  const int64_t burst_vec = vec_per_cta * producers;
  for (int b = 0; b < bursts; ++b) {
    if (threadIdx.x == 0) {
      if (!arrive_and_wait(counter, static_cast<unsigned int>(producers) * (b + 1), timeout_cycles, error)) {
        atomicCAS(error, 0, b + 1);
      }
      const long long spin_from = clock64();
      while (clock64() - spin_from < gap_cycles) {
      }
      start = clock64();
    }
    __syncthreads();
    if (*reinterpret_cast<volatile int*>(error) != 0) return;
    uint4* share = dst + (b % slots) * burst_vec + cta * vec_per_cta;
    const uint4 value = make_uint4(b, cta, threadIdx.x, 0x5eed);
    for (int64_t i = threadIdx.x; i < vec_per_cta; i += blockDim.x) share[i] = value;
    if (fence) __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      long long* record = clocks + (static_cast<int64_t>(cta) * bursts + b) * 2;
      record[0] = start;
      record[1] = clock64();
    }
  }
}

__global__ void clock_rate_kernel(int64_t duration_ns, long long* out) {
  const uint64_t t0 = global_timer_ns();
  const long long c0 = clock64();
  uint64_t t = t0;
  while (t - t0 < static_cast<uint64_t>(duration_ns)) t = global_timer_ns();
  out[0] = clock64() - c0;
  out[1] = static_cast<long long>(t - t0);
}

// (clocks, stalled): clocks (producers, bursts, 2) int64, the start and end cycle of every CTA's share of
// every burst; stalled, the burst at which the producers did not all arrive in time, or -1. The caller raises
// (the Python side names the cause), so a stalled train is not a C++ exception.
std::tuple<torch::Tensor, int64_t> burst_train(torch::Tensor dst, int64_t producers, int64_t burst_bytes, int64_t bursts,
                          int64_t gap_cycles, bool fence, int64_t threads, int64_t timeout_cycles) {
  TORCH_CHECK(dst.is_cuda(), "burst_train: the destination must be a CUDA tensor");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0, "burst_train: destination not 16-byte aligned");
  TORCH_CHECK(producers > 0 && bursts > 0 && threads > 0 && threads <= 1024, "burst_train: bad launch shape");
  TORCH_CHECK(burst_bytes % (16 * producers) == 0,
              "burst_train: burst_bytes must split into 16-byte stores evenly over the producers");
  const int64_t dst_bytes = dst.numel() * dst.element_size();
  TORCH_CHECK(dst_bytes >= burst_bytes, "burst_train: destination smaller than one burst");
  const int64_t slots = dst_bytes / burst_bytes;

  const c10::cuda::CUDAGuard guard(dst.device());
  const auto options = torch::TensorOptions().device(dst.device());
  auto clocks = torch::zeros({producers, bursts, 2}, options.dtype(torch::kInt64));
  auto counter = torch::zeros({1}, options.dtype(torch::kInt32));
  auto error = torch::zeros({1}, options.dtype(torch::kInt32));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  burst_train_kernel<<<producers, threads, 0, stream>>>(
      reinterpret_cast<uint4*>(dst.data_ptr()), slots, burst_bytes / 16 / producers, static_cast<int>(bursts),
      gap_cycles, fence, timeout_cycles, reinterpret_cast<unsigned int*>(counter.data_ptr<int>()),
      reinterpret_cast<long long*>(clocks.data_ptr<int64_t>()), error.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {clocks, static_cast<int64_t>(error.item<int>()) - 1};
}

// (cycles, nanoseconds) elapsed on one SM over a spin of about `duration_ns` of %globaltimer.
std::vector<int64_t> clock_rate(int64_t device, int64_t duration_ns) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  auto out = torch::zeros({2}, torch::TensorOptions().device(torch::kCUDA, device).dtype(torch::kInt64));
  clock_rate_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      duration_ns, reinterpret_cast<long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto host = out.cpu();
  return {host[0].item<int64_t>(), host[1].item<int64_t>()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "xstage_dit CUDA probes: Burst-Gap calibration microbenchmarks";
  m.def("burst_train", &burst_train, "Time a train of store bursts from K producer CTAs (cycles)",
        py::arg("dst"), py::arg("producers"), py::arg("burst_bytes"), py::arg("bursts"), py::arg("gap_cycles"),
        py::arg("fence"), py::arg("threads"), py::arg("timeout_cycles"));
  m.def("clock_rate", &clock_rate, "SM cycles and %globaltimer nanoseconds over one spin",
        py::arg("device"), py::arg("duration_ns"));
}
