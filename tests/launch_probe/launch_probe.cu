// The torch-free launcher compiled for the host, with fake_cudart.cpp in place of the
// CUDA runtime (nvcc -cudart none), so that tests run its plans and launches without a
// GPU (tests/test_cupy_nvrtc.py, tests/test_cupy_launch_parity.py).
//
//   launch_probe geo     reads two lines from stdin, the row lengths H and the row counts,
//                        and prints the plans and geometries of normspec_launch.cu
//   launch_probe launch  reads one call a line from stdin and prints the launches that
//                        the torch extension's host code makes for it (fake_cudart.cpp's
//                        "L" lines), then "W 1" where the weight was copied to fp32 for the
//                        kernels, and "E"; the call's buffers are described by their
//                        addresses (their alignment is what the launcher looks at)
#include "normspec_launch.cu"
// every launch unit's instantiation (launch_units/*.cu), in this one translation unit
NORMSPEC_EACH_UNIT(NORMSPEC_FORWARD_UNIT, NORMSPEC_BACKWARD_UNIT)

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace normspec;

std::vector<long long> read_list(std::istream& in) {
  std::string line;
  std::getline(in, line);
  std::istringstream words(line);
  std::vector<long long> out;
  for (long long v; words >> v;) out.push_back(v);
  return out;
}

void print_geometry() {
  const std::vector<long long> Hs = read_list(std::cin), Rs = read_list(std::cin);
  const int Ss[] = {1, 7, 132};
  for (long long H : Hs) for (int vec : {4, 8}) {
    Geometry f = geometry(H, vec), b = backward_geometry(H, vec);
    printf("G %lld %d %d %d %d %d\n", H, vec, f.threads, f.np, b.threads, b.np);
  }
  for (int dt : {0, 1, 2}) for (long long H : Hs) for (long long R : Rs) for (int s : Ss) {
    BackwardPlan p = backward_plan(dt, R, H, s);
    printf("P %d %lld %lld %d %d %lld\n", dt, R, H, s, p.glog, p.groups);
  }
  // the pipelined kernels' plan, for aligned and for unaligned rows
  for (int dt : {0, 1, 2}) for (long long H : Hs) for (long long R : Rs) for (int s : Ss) {
    for (int aligned : {1, 0}) {
      LaunchArgs a;
      a.x = reinterpret_cast<const void*>(aligned ? 0x10000 : 0x10002);
      a.y = reinterpret_cast<void*>(0x20000);
      a.w = reinterpret_cast<const float*>(0x30000);
      a.rows = R;
      a.H = H;
      a.sx = a.sy = aligned ? 64 : 63;
      BackwardPlan p = backward_plan_for(dt, a, s);
      printf("Q %d %lld %lld %d %d %d %d %d %d %lld\n", dt, R, H, s, aligned, p.pipe,
             p.team_log, p.np, p.glog, p.groups);
    }
  }
  for (long long H : Hs) for (int vec : {4, 8}) {
    for (int bwd : {0, 1}) {
      PipeGeometry g = pipe_geometry(H, vec, bwd);
      printf("W %lld %d %d %d %d\n", H, vec, bwd, g.team_log, g.np);
    }
    for (int two : {0, 1}) for (long long R : Rs) {
      PipeGeometry r = row_geometry(H, vec, two, R, device_sms());
      printf("R %lld %d %d %lld %d %d %d\n", H, vec, two, R, r.team_log, r.np,
             r.np ? row_block(r, R, device_sms()) : 0);
    }
  }
  printf("S %d\n", device_sms());
  printf("O %d\n", device_smem_optin());
  // the stack depth cap under the shared-memory limits of other GPUs
  for (int tl = 0; tl <= 8; ++tl) for (int np : {1, 2, 4}) for (int vec : {4, 8})
    for (int optin : {232448, 101376, 65536, 49152}) {
      PipeGeometry g;
      g.team_log = tl;
      g.np = np;
      printf("M %d %d %d %d %d\n", tl, np, vec, optin, pipe_max_glog(g, vec, optin));
    }
  for (long long G : Rs) if (G > 0) printf("C %lld %lld\n", G, col_tree_rows_out(G));
  for (long long G = 1; G <= kColTreeLastMax; ++G) {
    const ColTreeLast t = col_tree_last_logs(G);
    printf("L %lld %d %d\n", G, t.clog1, t.slog);
  }
  for (long long u : Rs)
    for (int pb : {1, 4, 256}) printf("F %lld %d %u\n", u, pb, grid_for(u, pb));
}

// Addresses of the buffers the torch extension would allocate (16-byte aligned, as the
// caching allocator's are); nothing is ever read or written through them.
void* fake(unsigned long long slot) {
  return reinterpret_cast<void*>(0x7f0000000000ULL + (slot << 32));
}

// One call: what normspec_cuda.cpp's forward() or backward() does around the launcher
// (offer_weight_as_is, weight_fp32_unless_as_is, the plan, the dweight tree), on the
// caller's row pointers and strides.
//   op dt wdt rows H x r dy dres w w_contiguous sx sr sdy sdres flags eps offset rstd bwd
// rstd: a forward writes rstd (rstd_out), a backward reads the forward's (rstd_in).
bool run_call(const std::string& line) {
  std::istringstream in(line);
  int op, dt, wdt, w_contiguous, flags, rstd, bwd;
  long long rows, H, sx, sr, sdy, sdres;
  unsigned long long x, r, dy, dres, w;
  float eps, offset;
  if (!(in >> op >> dt >> wdt >> rows >> H >> x >> r >> dy >> dres >> w >> w_contiguous >> sx >>
        sr >> sdy >> sdres >> flags >> eps >> offset >> rstd >> bwd))
    return false;
  LaunchArgs a;
  a.x = reinterpret_cast<const void*>(x);
  a.r = reinterpret_cast<const void*>(r);
  a.rows = rows;
  a.H = H;
  a.sx = sx;
  a.sr = sr;
  a.eps = eps;
  a.offset = offset;
  a.flags = flags;
  a.y = fake(1);
  a.sy = H;
  const bool two_out = bwd ? (op == OP_FUSED || op == OP_GATED) : op == OP_FUSED;
  if (two_out) {
    a.y2 = fake(2);
    a.sy2 = H;
  }
  if (bwd) {
    a.dy = reinterpret_cast<const void*>(dy);
    a.sdy = sdy;
    a.dres = reinterpret_cast<const void*>(dres);
    a.sdres = sdres;
    if (rstd) a.rstd_in = static_cast<const float*>(fake(3));
  } else if (rstd) {
    a.rstd_out = static_cast<float*>(fake(3));
  }
  // offer_weight_as_is
  if (dt != DT_F32 && wdt == dt && w_contiguous) a.w_in_dtype = reinterpret_cast<void*>(w);
  // weight_fp32_unless_as_is: whether the kernels read an fp32 weight (w32 defined);
  // weight_f32 (w.to(float).contiguous()) copies all but a contiguous fp32 weight, which
  // it returns as it is (maybe off 16 bytes)
  bool copied = false;
  const auto reads_fp32 = [&](const BackwardPlan* plan) {
    if (reads_weight_in_input_dtype(op, dt, a, plan)) return false;
    a.w_in_dtype = nullptr;
    copied = !(wdt == DT_F32 && w_contiguous);
    a.w = copied ? static_cast<const float*>(fake(4)) : reinterpret_cast<const float*>(w);
    return true;
  };
  if (!bwd) {
    reads_fp32(nullptr);
    launch_forward(op, dt, a, nullptr);
    if (copied) std::printf("W 1\n");
    return true;
  }
  const int sms = current_device_sms();
  BackwardPlan plan = backward_plan_for(dt, a, sms);
  if (reads_fp32(&plan)) plan = backward_plan_for(dt, a, sms);  // the alignment may differ
  if (writes_dweight_final(dt, wdt, plan)) {
    a.flags |= F_DW_FINAL;
    launch_backward(op, dt, a, static_cast<float*>(fake(5)), plan, nullptr);
  } else {
    long long G = plan.groups;
    const bool fp32_weight = wdt == DT_F32;
    const bool tree_follows = !(G == 1 && fp32_weight);
    if (tree_follows && chained_launches(nullptr)) a.flags |= F_LET_DEPENDENTS;
    launch_backward(op, dt, a, static_cast<float*>(fake(5)), plan, nullptr);
    while (G > kColTreeLastMax) {
      launch_col_tree(static_cast<float*>(fake(5)), static_cast<float*>(fake(6)), G, H, nullptr);
      G = col_tree_rows_out(G);
    }
    if (!(G == 1 && fp32_weight)) {
      launch_col_tree_last(static_cast<float*>(fake(5)), fake(7), wdt, G, H, nullptr);
    }
  }
  if (copied) std::printf("W 1\n");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "geo") == 0) {
    print_geometry();
    return 0;
  }
  if (argc == 2 && std::strcmp(argv[1], "launch") == 0) {
    for (std::string line; std::getline(std::cin, line);) {
      if (line.empty()) continue;
      if (!run_call(line)) {
        std::fprintf(stderr, "launch_probe: cannot read the call \"%s\"\n", line.c_str());
        return 2;
      }
      std::printf("E\n");
    }
    return 0;
  }
  std::fprintf(stderr, "usage: launch_probe geo|launch < input\n");
  return 2;
}
