// A/B experiment for the one-row forward (normspec_fwd_row_kernel), bf16 rows and a
// bf16 weight as the bench passes them, launched through the shipped launcher
// (forward_t: the same geometry, block size and constant forms as the extension).
// The full bench put rms 4096 x 2048 at 14.3-14.5 us up to 146c85f and at 15.4-15.5 since
// 5e00fde; f07903c (fewer instructions in the one-row forward) is the one forward change
// in between. Build one binary per variant and compare their times; their output hashes
// must be equal (a variant changes the kernel's structure, never its arithmetic):
//
//   for v in "" -DNORMSPEC_ROW_ADDRESS_PER_PASS=0 -DNORMSPEC_ROW_ADDRESS_PER_PASS=1 \
//            -DNORMSPEC_ROW_WEIGHT_PREFETCH=1; do
//     nvcc -O3 -std=c++17 -arch=sm_90a -fmad=false -Ibackends/csrc $v \
//          bench/micro/row_forward_ab.cu -o /tmp/row_ab && /tmp/row_ab "${v:-default}"
//   done
//
//   NORMSPEC_ROW_ADDRESS_PER_PASS: =1 every form's loads (and the rms norm's stores)
//     addressed from the row's start, as before f07903c (its other change, the values
//     formed once, gives the rms forms the same SASS up to register names); =0 every
//     form from the lane's own pointers, as f07903c made them. Unset (the shipped
//     kernel): the row's start for the rms norm's constant forms of 64 and more lanes
//     only, which this harness found faster (row_per_pass_addressing in
//     normspec_pipe.cuh);
//   NORMSPEC_BLOCK_FOLD_LOCAL=0, NORMSPEC_FWD_ROW_PER_BLOCK=0: the multi-warp teams'
//     partials folded by shuffles and a broadcast, the whole-block teams' row from the
//     thread index, as before session 29 (the shipped kernel: =1 both; on the H200 the
//     row per block made most of rms 4096 x 2048's gain, 12.51 -> 11.93 us flushed,
//     bench/results/sweeps/block_fold_row_forward_2dd36d5.json, notes §34);
//   NORMSPEC_ROW_WEIGHT_EARLY=0: with more than one pass, the rms and fused forms load a
//     16-bit weight after the reduction, as before 71f0ae0, instead of with the row (=1,
//     the shipped kernel: on the H200 it won at rms and fused 4096 x 2048 and lost only
//     at rms 32768 x 2048 warm, by 0.2 %, notes §33;
//     bench/results/sweeps/row_weight_early_3c999ab.json, where the early load was the
//     =1 build and the late one the default);
//   NORMSPEC_ROW_WEIGHT_PREFETCH: with more than one pass, prefetch the weight's lines
//     into L1 before the reduction, for the forms that load it after (tried before the
//     early load: on the H200 this cost 9-44 %, rms 4096 x 2048 14.8 -> 23.5 us);
//   NORMSPEC_STREAMING_HINTS=1: the rows' 16-byte loads and stores with the
//     evict-first hint (normspec_pipe.cuh; the shipped kernels' until d9aea9e), in
//     every kernel, the gated one included.
//   NORMSPEC_PACKED_CVT=0: 16-bit values rounded one per conversion instead of two
//     (normspec_pipe.cuh).
// The gated cases also follow the launcher's run-time switches (NORMSPEC_GATE_TABLE,
// NORMSPEC_FULL_ROW, ...).
//
// The "normal" gated cases take the bench's inputs (torch.randn rows, a weight near one)
// instead of the other cases' values of magnitude 0.25..4: their gates spread over more
// of the table's slots.
//
// Prints one line per case: the label, microseconds (median of 40, each after a 512 MiB
// L2 flush, as triton's do_bench does), and an FNV-1a hash of the outputs.
//
// NORMSPEC_AB_ONLY=<text>[,<text>...] (run time) runs only the cases whose name contains
// one of the texts.
// NORMSPEC_AB_FLUSH_MIB=<1..512> (run time) flushes that much instead (1: warm, the
// launch's data and code in L2) and queues a spin kernel before each timed launch
// (micro_util.cuh's Timer); ab.py runs it as an --env variant:
//
//   NORMSPEC_AB_ONLY=rms,fused python3 bench/micro/ab.py bench/micro/row_forward_ab.cu \
//       --build "" --build=-DNORMSPEC_ROW_WEIGHT_EARLY=0 --env "" \
//       --env NORMSPEC_AB_FLUSH_MIB=1 --rounds 3
//
// NORMSPEC_AB_FOLLOWER=1 (run time) adds, per case, "+read y": the norm and then a kernel
// that reads its output y (as the next layer does), timed together, and "read y after":
// that read alone, timed after an untimed norm. An L2 policy that keeps the norm's inputs
// in L2 can leave less of y there for the reader; this shows what that costs.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "micro_util.cuh"
#include "normspec_launch_impl.cuh"

using bf16 = __nv_bfloat16;
using namespace normspec;
using namespace normspec::launch_detail;

// Reads nvec 16-byte vectors at p, plainly, and folds them into *sink (never written
// unless the fold hits one value): the next layer's read of a norm's output.
__global__ void read_output(const uint4* p, size_t nvec, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < nvec;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// n bf16 values drawn as mean + scale * N(0, 1), rounded to nearest even: the bench's
// inputs (torch.randn rows, a weight near one), whose gates spread over many more
// exponents (table slots) than fill_bf16's. 2^16 draws (Box-Muller over an LCG seeded
// with `seed`), then n picks among them by the LCG: drawing 2^28 values one by one took
// the host ~10 s per buffer.
static void fill_normal_bf16(bf16* d, size_t n, unsigned seed, float mean, float scale) {
  unsigned s = seed;
  const auto next = [&] { return s = s * 1664525u + 1013904223u; };
  std::vector<unsigned short> pool(1u << 16);
  for (auto& p : pool) {
    const float u1 = (static_cast<float>(next() >> 8) + 1.0f) / 16777216.0f;  // (0, 1]
    const float u2 = static_cast<float>(next() >> 8) / 16777216.0f;
    const float v = mean + scale * std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
    unsigned b;
    std::memcpy(&b, &v, 4);
    p = static_cast<unsigned short>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
  std::vector<unsigned short> h(n);
  for (auto& v : h) v = pool[next() >> 16];
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
}

static bool follower_on() {
  const char* s = std::getenv("NORMSPEC_AB_FOLLOWER");
  return s != nullptr && std::strcmp(s, "1") == 0;
}

// Whether NORMSPEC_AB_ONLY (run time; comma-separated texts) selects the case `name`: one
// of its texts is part of the name (every case without it).
static bool selected(const char* name) {
  const char* only = std::getenv("NORMSPEC_AB_ONLY");
  if (only == nullptr || *only == '\0') return true;
  const std::string list(only), n(name);
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string text = list.substr(start, end - start);
    if (!text.empty() && n.find(text) != std::string::npos) return true;
    start = end + 1;
  }
  return false;
}

// rms (offset 1, the zero-centred norm), fused (rounded residual sum, offset 1) or
// gated (silu; `flags` adds F_HF for the transformers convention) over rows x H, as the
// bench times them. `normal`: the bench's values (fill_normal_bf16: rows N(0, 1), the
// weight 1 + 0.1 N(0, 1)) instead of fill_bf16's.
template <int OP>
static void run_case(const char* label, const char* name, long long rows, long long H,
                     Timer& timer, int flags = 0, bool normal = false) {
  if (!selected(name)) return;
  const size_t n = static_cast<size_t>(rows) * H;
  bf16 *x, *r = nullptr, *y, *y2 = nullptr, *w;
  CK(cudaMalloc(&x, n * 2));
  CK(cudaMalloc(&y, n * 2));
  CK(cudaMalloc(&w, H * 2));
  if (normal) {
    fill_normal_bf16(x, n, 1, 0.0f, 1.0f);
    fill_normal_bf16(w, H, 5, 1.0f, 0.1f);
  } else {
    fill_bf16(x, n, 1);
    fill_bf16(w, H, 5);
  }
  if (OP == OP_FUSED || OP == OP_GATED) {  // the residual, or the gate
    CK(cudaMalloc(&r, n * 2));
    if (normal) {
      fill_normal_bf16(r, n, 2, 0.0f, 1.0f);
    } else {
      fill_bf16(r, n, 2);
    }
  }
  if (OP == OP_FUSED) CK(cudaMalloc(&y2, n * 2));
  LaunchArgs a;
  a.x = x;
  a.r = r;
  a.y = y;
  a.y2 = y2;
  a.w_in_dtype = w;  // read as it is, as the extension does for a bf16 weight
  a.rows = rows;
  a.H = H;
  a.sx = a.sr = a.sy = a.sy2 = H;
  a.eps = 1e-6f;
  a.offset = OP == OP_GATED ? 0.0f : 1.0f;
  a.flags = (OP == OP_GATED ? 0 : F_OFFSET) | F_W_IS_INPUT | (OP == OP_FUSED ? F_ROUNDED : 0) |
            flags;
  set_alignment(a, 2);
  const float us = timer.median_us([&] { forward_t<OP, bf16>(a, nullptr); });
  CK(cudaDeviceSynchronize());
  unsigned long long h = fnv(y, n * 2, 1469598103934665603ull);
  if (y2 != nullptr) h = fnv(y2, n * 2, h);
  std::printf("%-34s %-10s %8lld x %-5lld %9.2f us  %016llx\n", label, name, rows, H, us, h);
  if (follower_on()) {
    unsigned* sink;
    CK(cudaMalloc(&sink, sizeof(unsigned)));
    const auto read_y = [&] {
      read_output<<<132 * 8, 256>>>(reinterpret_cast<const uint4*>(y), n * 2 / 16, sink);
    };
    const float both = timer.median_us([&] {
      forward_t<OP, bf16>(a, nullptr);
      read_y();
    });
    const float after = timer.median_us_after([&] { forward_t<OP, bf16>(a, nullptr); }, read_y);
    std::printf("%-34s %-10s %8lld x %-5lld +read y %9.2f us  %016llx\n", label, name, rows, H,
                both, h);
    std::printf("%-34s %-10s %8lld x %-5lld read y after %9.2f us  %016llx\n", label, name,
                rows, H, after, h);
    CK(cudaFree(sink));
  }
  CK(cudaFree(x));
  CK(cudaFree(y));
  CK(cudaFree(w));
  if (r != nullptr) CK(cudaFree(r));
  if (y2 != nullptr) CK(cudaFree(y2));
}

int main(int argc, char** argv) {
  const char* label = argc > 1 ? argv[1] : "default";
  Timer timer;
  run_case<OP_RMS>(label, "rms", 4096, 2048, timer);
  run_case<OP_RMS>(label, "rms", 32768, 2048, timer);
  run_case<OP_RMS>(label, "rms", 65536, 2048, timer);
  run_case<OP_RMS>(label, "rms", 64, 2048, timer);
  run_case<OP_RMS>(label, "rms", 1, 2048, timer);
  run_case<OP_RMS>(label, "q/k rms", 524288, 256, timer);
  run_case<OP_RMS>(label, "q/k rms", 4096, 256, timer);
  run_case<OP_FUSED>(label, "fused", 32768, 2048, timer);
  run_case<OP_FUSED>(label, "fused", 4096, 2048, timer);
  // the GDN norm: the one-row forward with the global gate table
  // (NORMSPEC_GATED_ROW_TABLE=0: the persistent kernel with a table per block)
  run_case<OP_GATED>(label, "gated vllm", 2097152, 128, timer);
  run_case<OP_GATED>(label, "gated hf", 2097152, 128, timer, F_HF);
  run_case<OP_GATED>(label, "gated vllm normal", 2097152, 128, timer, 0, true);
  run_case<OP_GATED>(label, "gated hf normal", 2097152, 128, timer, F_HF, true);
  return 0;
}
