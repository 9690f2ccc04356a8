// Paged decode instantiations for head_dim padded to 128 (fp16/bf16 queries, 16-bit or fp8 KV).
#include "decode_kernel.cuh"

HAB_DEFINE_DECODE_LAUNCH(128)
