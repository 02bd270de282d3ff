// cuda_bf16.h: stands in for the CUDA header of that name in the `cuda-emu` build (see emu.h).
#pragma once
#include "emu.h"
