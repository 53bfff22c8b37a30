    const int row = blockIdx.x;
    const int d = threadIdx.x;

#include "pass2.inc"
