// test_kernels.cpp — the CPU build of test_kernels.cu (the fixture's NAME.host.so).
#ifndef ABP_HOST
#define ABP_HOST 1
#endif
#include "test_kernels.cu"
