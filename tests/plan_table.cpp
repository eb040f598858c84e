// The C++ launch plan (backends/csrc/normspec_plan.h) for the queries read from stdin,
// one a line, printed one a line for tests/test_launch_plan.py (plain g++, no CUDA):
//   in:  op dtype backward rows H aligned w_raw hf w_is_input saved_rstd global_table
//        offsets_fit_32 sms smem_optin
//   out: the backward's groups (glog groups pipe team_log np; zeros for a forward), then
//        the plan (kernel np full_tl gt_form gc saved block_x block_y smem team_log glog
//        groups table persistent grid units), and persistent_grid(plan, 3, sms)
#include <cstdio>
#include <iostream>

#include "normspec_plan.h"

int main() {
  using namespace normspec;
  PlanQuery q;
  int bwd, al, raw, hf, wi, sv, gt, o32;
  while (std::cin >> q.op >> q.dtype >> bwd >> q.rows >> q.H >> al >> raw >> hf >> wi >> sv >>
         gt >> o32 >> q.sms >> q.smem_optin) {
    q.backward = bwd, q.aligned = al, q.w_raw = raw, q.hf = hf, q.w_is_input = wi;
    q.saved_rstd = sv, q.global_table = gt, q.offsets_fit_32 = o32;
    q.groups = BackwardPlan{};
    if (q.backward)
      q.groups = backward_plan_aligned(q.dtype, q.rows, q.H, q.aligned, q.sms, q.smem_optin);
    const BackwardPlan& b = q.groups;
    const LaunchPlan p = launch_plan(q);
    std::printf("%d %lld %d %d %d %d %d %d %d %d %d %d %d %lld %d %d %lld %d %d %lld %lld %lld\n",
                b.glog, b.groups, b.pipe, b.team_log, b.np, p.kernel, p.np, p.full_tl,
                p.gt_form, p.gc, p.saved, p.block_x, p.block_y, p.smem, p.team_log, p.glog,
                p.groups, p.table, p.persistent, p.grid, p.units, persistent_grid(p, 3, q.sms));
  }
  return 0;
}
