    threadgroup float4 smem4[SMEM_FLOATS / 4];
    threadgroup float* smem = (threadgroup float*)smem4;
    const int tid = (int)thread_position_in_threadgroup.x;
    const int lane = (int)thread_index_in_simdgroup;
    const int warp = (int)simdgroup_index_in_threadgroup;
    const int split = (int)threadgroup_position_in_grid.x;
    const int n_splits = (int)threadgroups_per_grid.x;
    const int bh = (int)threadgroup_position_in_grid.y;
    const int rg = (int)threadgroup_position_in_grid.z;

#include "pass1.inc"
