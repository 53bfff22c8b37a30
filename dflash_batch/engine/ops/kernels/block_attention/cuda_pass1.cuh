#include "cuda_block_ids.inc"
#include "pass1.inc"
