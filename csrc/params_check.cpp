// Compiled by CMakeLists.txt only: proves params.h stands alone, without ATen or torch headers.
#include "params.h"

static_assert(sizeof(dilated_attn::Branch) == 6 * sizeof(int64_t), "Branch is a plain table row");
