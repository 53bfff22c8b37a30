// The tensor-core pass 1 (PASS1_MMA_BODY) in the CUDA pass 1 kernel's block frame.
#include "cuda_block_ids.inc"
#include "pass1_mma.inc"
