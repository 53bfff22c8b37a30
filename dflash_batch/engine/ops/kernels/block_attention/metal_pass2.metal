    const int row = (int)threadgroup_position_in_grid.x;
    const int d = (int)thread_position_in_threadgroup.x;

#include "pass2.inc"
